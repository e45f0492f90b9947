"""Drafters: cheap guesses of the next tokens, verified losslessly by `SpeculativeDecoder`.

Tree convention (everything a drafter returns): a `Draft` is a tree *below the pending token* (the last emitted
token, which the decoder feeds as the root of the verification tree). `parents[i] == -1` makes node i a child of
the pending token, otherwise `parents[i]` is the index of an earlier draft node (`-1 <= parents[i] < i`).
`budget` is the maximum depth (levels below the pending token), chosen by the decoder's adaptive controller;
nodes deeper than that are dropped by the decoder. Siblings should carry distinct tokens (a duplicate is
harmless, only wasted). `q[i]` is the probability vector node i's token was *sampled* from (given its ancestors
and earlier siblings), or None when the drafter chose it deterministically; losslessness relies on this being
exact, so a drafter that picks by argmax must report None, not its softmax.

`observe(tokens, parents, logits)` receives every verification tree the target scored (root included, parents
in the target's convention: -1 = after the committed sequence) with its logits, for drafters that learn online.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from runtime.models.lm.sampling import Sampler, draw, greedy_token, top_k_ids
from runtime.models.lm.target import Target

DRAFTERS = ("none", "ngram", "recycling", "trigram", "draft-model", "dyspec", "swift", "auto")
# drafters that decode a model (another one, or the target's own layers)
MODEL_DRAFTERS = ("draft-model", "dyspec", "swift")


class Draft(NamedTuple):
    tokens: list[int]
    parents: list[int]
    q: list[torch.Tensor | None] | None = None  # None: every node deterministic
    # what kind of guess this is, for a drafter whose guesses differ in how often they are right: the depth
    # controller counts acceptance apart per kind (`DraftController.choose_cut`). The copy's kinds are how many
    # tokens its match rests on: a 1.5B took the first token of 27 % of one-token copies, 70-95 % of longer ones.
    kind: int = 0


EMPTY = Draft([], [])


def chain(tokens: Sequence[int]) -> list[int]:
    """Parents of a chain below the pending token."""
    return list(range(-1, len(tokens) - 1))


class Drafter(Protocol):
    # Whether the decoder asks for the deepest tree a step may score and cuts it to the depth that pays at its real
    # size (`DraftController.choose_cut`): right for a table lookup, whose proposal costs nothing and offers nothing
    # at one step and a long chain at the next. A drafter that runs a model per level, or whose tree's size the depth
    # alone decides, is asked for a depth chosen beforehand (`DraftController.choose`). Absent counts as False.
    free: bool

    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        """A draft tree below `pending`, at most `budget` levels deep. `context` holds every token before
        `pending` that the drafter may look things up in (prompt/transcript + answer so far); it only grows
        during an answer."""
        ...

    def observe(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> None: ...

    def reset(self) -> None: ...


class NgramDrafter:
    """Prompt/context lookup: find the most recent earlier occurrence of the last n tokens (n = n_max down to
    n_min, longest first) of context + [pending] and copy what followed it (at most max_copy tokens, and not past
    the end of the line it copies from).

    Streaming QA answers quote the transcript, so copies are often right, and the drafter costs no model. Why the
    longest match and not the last few tokens': the question is the most recent text, and it shares words with the
    transcript line the answer quotes ("Who will lead the rollout, and ..." against "Kofi will lead the rollout,
    starting ..."); matched on three tokens, the answer's quote copied on into the question. Why the line's end
    (`line_ends`: the ids of tokens that hold a newline): a transcript line is followed by the next one's time
    stamp and speaker, which no answer quotes; a copy that ran on scored those rows for nothing at the end of every
    quote. The index (n-gram -> most recent position whose continuation is known) grows incrementally as the
    context grows; a context that is not an extension of the last one (checked by length and last token)
    rebuilds it.
    """
    free = True

    def __init__(self, n_max: int = 8, max_copy: int = 10, n_min: int = 1,
                 line_ends: Collection[int] = frozenset(), kinds: int = 2) -> None:
        """`kinds`: a draft's kind (`Draft.kind`) is the length of the match it copies from, counted up to this."""
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_max, self.n_min, self.max_copy, self.kinds = n_max, n_min, max_copy, kinds
        self.line_ends = frozenset(line_ends)
        self.reset()

    def reset(self) -> None:
        self._seq: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> start of its continuation (most recent)

    def _sync(self, context: Sequence[int]) -> None:
        known = len(self._seq)
        if len(context) < known or (known and context[known - 1] != self._seq[-1]):
            self.reset()
            known = 0
        self._seq.extend(context[known:])
        # index n-grams ending at e whose continuation e+1 is now known: e in [known-1, len-2]
        for e in range(max(0, known - 1), len(self._seq) - 1):
            for n in range(self.n_min, self.n_max + 1):
                if e + 1 >= n:
                    self._index[tuple(self._seq[e + 1 - n : e + 1])] = e + 1

    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        self._sync(context)
        limit = min(budget, self.max_copy)
        if limit <= 0:
            return EMPTY
        tail = [*self._seq[-(self.n_max - 1) :], pending] if self.n_max > 1 else [pending]
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            start = self._index.get(tuple(tail[-n:]))
            if start is not None:
                tokens = self._seq[start : start + limit]
                # stop at a VLM's visual stand-in ids (not tokens: never drafted), and after a line's end
                cut = next((i + (t >= 0) for i, t in enumerate(tokens) if t < 0 or t in self.line_ends), None)
                if cut is not None:
                    tokens = tokens[:cut]
                elif len(tokens) < limit and start + len(tokens) == len(self._seq):
                    tokens.append(pending)  # the copy ran into the present: the pending token comes next
                return Draft(tokens, chain(tokens), kind=min(n, self.kinds)) if tokens else EMPTY
        return EMPTY

    def observe(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> None:
        pass


def static_tree(branching: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """A fixed BFS draft tree: (parent, rank, depth) per node, parent -1 = the pending token. A node whose path
    has rank sum s (0 = always the top candidate) gets max(0, branching[depth] - s) children, so likely paths
    are deep and wide and unlikely ones end early. (8, 6, 4, 3, 2, 2) gives 77 nodes over 6 levels."""
    parent, rank, depth = [], [], []
    frontier = [(-1, 0)]  # (node, rank sum of its path)
    for d, width in enumerate(branching):
        nxt = []
        for node, penalty in frontier:
            for r in range(max(0, width - penalty)):
                parent.append(node)
                rank.append(r)
                depth.append(d + 1)
                nxt.append((len(parent) - 1, penalty + r))
        frontier = nxt
    return parent, rank, depth


class TokenRecyclingDrafter:
    """Token Recycling (2024): an adjacency matrix [vocab, k] (int32) holding, for each token id, the top-k
    next tokens the target last predicted after it. Every scored tree refreshes the rows of all its nodes
    (accepted or not: the candidates are "recycled"); drafts walk the matrix from the pending token along a
    static BFS tree. Rows never seen are pruned from the tree (no point verifying zeros). Size: vocab * k * 4
    bytes, e.g. 1.6 MB for 50k ids, 4.9 MB for Qwen2.5's 151,936. It stays warm across answers: do not reset
    between questions of one model."""
    free = False  # its static tree's size follows from the depth asked: priced before proposing as well as after

    def __init__(self, vocab_size: int, k: int = 8, branching: Sequence[int] = (8, 6, 4, 3, 2, 2)) -> None:
        if max(branching) > k:
            raise ValueError("branching per node cannot exceed k candidates")
        self.vocab_size, self.k = vocab_size, k
        parent, rank, depth = static_tree(branching)
        self.tree_parent, self.tree_rank = np.array(parent), np.array(rank)
        self.tree_depth = np.array(depth)
        self.adjacency = torch.zeros(vocab_size, k, dtype=torch.int32)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        self._adj, self._seen = self.adjacency.numpy(), self.seen.numpy()  # shared memory views

    @property
    def nbytes(self) -> int:
        return self.adjacency.numel() * self.adjacency.element_size()

    def reset(self) -> None:
        self.adjacency.zero_()
        self.seen.zero_()

    def observe(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> None:
        top = top_k_ids(logits[..., : self.vocab_size], self.k).to(torch.int32).cpu()
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        keep = ids < self.vocab_size
        self.adjacency[ids[keep]] = top[keep]
        self.seen[ids[keep]] = True

    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        n = int(np.searchsorted(self.tree_depth, budget, side="right"))  # BFS order: depths ascend
        if n == 0 or not 0 <= pending < self.vocab_size:
            return EMPTY
        par, rank = self.tree_parent[:n], self.tree_rank[:n]
        tok = np.full(n, -1, dtype=np.int64)
        for d in range(1, int(self.tree_depth[n - 1]) + 1):
            level = np.flatnonzero(self.tree_depth[:n] == d)
            src = np.where(par[level] < 0, pending, tok[np.maximum(par[level], 0)])
            ok = src >= 0
            ok[ok] = self._seen[src[ok]]
            tok[level] = np.where(ok, self._adj[np.maximum(src, 0), rank[level]], -1)
        kept = np.flatnonzero(tok >= 0)  # a pruned node's descendants are pruned too (their src is -1)
        new = {-1: -1, **{int(old): i for i, old in enumerate(kept)}}
        return Draft([int(t) for t in tok[kept]], [new[int(par[o])] for o in kept])


class TrigramDrafter:
    """ADED-style (2024) tri-gram drafting without a corpus: a table (a, b) -> next tokens, adapted online from two
    sources, the context (every tri-gram of transcript and answer, most recent continuation first) and the target
    itself (every scored node's top-k, keyed by the node and its parent, as Token Recycling does with one token).
    Drafts follow the table greedily from (last context token, pending) for up to `budget` tokens, with the
    first level branching into the top `width` candidates. Deterministic (q is None): lossless for sampling too."""
    free = True

    def __init__(self, k: int = 4, width: int = 2, max_entries: int = 1 << 17) -> None:
        self.k, self.width, self.max_entries = k, width, max_entries
        self.reset()

    def reset(self) -> None:
        self.table: dict[tuple[int, int], list[int]] = {}
        self._seen = 0
        self._ctx: tuple[int, ...] = ()
        self._root: tuple[int, int] | None = None  # (token before it, pending) of the proposal being verified

    def _put(self, key: tuple[int, int], nxt: list[int]) -> None:
        if len(self.table) >= self.max_entries and key not in self.table:
            self.table.clear()  # bounded: start over rather than grow without limit
        self.table[key] = nxt[: self.k]

    def _ingest(self, context: Sequence[int]) -> None:
        if len(context) < self._seen or (self._seen and context[self._seen - 1] != self._ctx[-1]):
            self._seen = 0
        for i in range(max(2, self._seen), len(context)):
            key = (context[i - 2], context[i - 1])
            old = self.table.get(key, [])
            self._put(key, [context[i], *[t for t in old if t != context[i]]])
        self._seen = len(context)
        self._ctx = tuple(context[-1:])

    def observe(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> None:
        """A root's key needs the token before it, known only for a tree this drafter proposed below (the
        decoder also reports trees it scored without asking: an answer's first token, depth-0 steps)."""
        top = top_k_ids(logits, self.k).tolist()
        root, self._root = self._root, None
        for i, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
            if par >= 0:
                before = tokens[par]
            elif root is not None and root[1] == tok:
                before = root[0]
            else:
                continue
            if before >= 0 and tok >= 0:
                self._put((before, tok), top[i])

    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        self._ingest(context)
        before = context[-1] if context else -1
        self._root = (before, pending)
        if budget <= 0:
            return EMPTY
        first = self.table.get((before, pending), [])[: self.width]
        tokens: list[int] = []
        parents: list[int] = []
        for rank, tok in enumerate(first):
            a, b, parent = pending, tok, -1
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
            for _ in range(budget - 1 if rank == 0 else min(1, budget - 1)):
                nxt = self.table.get((a, b))
                if not nxt:
                    break
                a, b = b, nxt[0]
                tokens.append(b)
                parents.append(parent)
                parent = len(tokens) - 1
        return Draft(tokens, parents) if tokens else EMPTY


class DraftModelDrafter:
    """A smaller model of the same tokenizer, driven through the Target protocol (its own KV session).

    Its target must hold, when the drafter is made, exactly `fed` committed (the prompt, as the main target).
    Each propose first feeds what it has not seen (the tokens accepted since, plus the pending token, which the
    main target always commits) and commits them, then drafts a chain of `budget` tokens with tentative
    forwards that are dropped again (`commit([])`), because the protocol cannot roll back a commit. With
    temperature > 0 it samples each token from q = `Sampler.probs` (draft logits) (the decoder's temperature and
    top_p, which maximises acceptance) and reports q; at temperature 0 it drafts greedily and reports None.
    Cost: budget forwards of the draft model per step, the last ones on chains of up to budget tokens.
    """
    free = False

    def __init__(
        self,
        draft: Target,
        *,
        fed: Sequence[int] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> None:
        if draft.committed_tokens() != len(fed):
            raise ValueError(f"draft target holds {draft.committed_tokens()} tokens, `fed` names {len(fed)}")
        self.draft, self.fed = draft, list(fed)
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.sampler = Sampler(temperature, top_p)

    def reset(self) -> None:
        """Nothing to forget: a new context must extend what was fed (else make a new draft session)."""

    def observe(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> None:
        pass

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.sampler.greedy:
            return greedy_token(logits), None
        q = self.sampler.probs(logits)
        return draw(q, self.generator), q

    def _feed(self, context: Sequence[int], pending: int) -> torch.Tensor:
        """Commit what the draft has not seen (the tokens accepted since the last propose, and the pending token,
        which the main target always commits: safe to keep) and return its logits after the pending token."""
        n = len(self.fed)
        if len(context) < n or list(context[:n]) != self.fed:
            raise RuntimeError("draft model out of sync: the context does not extend what it was fed")
        new = [*context[n:], pending]
        logits = self.draft.score(new, chain(new))
        self.draft.commit(list(range(len(new))))
        self.fed.extend(new)
        return logits[-1]

    @torch.inference_mode()
    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        if budget <= 0:
            return EMPTY
        row = self._feed(context, pending)
        tokens: list[int] = []
        qs: list[torch.Tensor | None] = []
        while True:
            tok, q = self._pick(row)
            tokens.append(tok)
            qs.append(q)
            if len(tokens) >= budget:
                break
            row = self.draft.score(tokens, chain(tokens))[-1]
            self.draft.commit([])
        return Draft(tokens, chain(tokens), None if self.sampler.greedy else qs)
