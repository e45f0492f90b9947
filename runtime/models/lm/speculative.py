"""Lossless speculative decoding against a `Target` (design §3: token recycling, prompt lookup, draft models).

One `step()` is one target forward: the tree [pending token, draft nodes below it] is scored in a single
`Target.score` call, walked from the root, and exactly the accepted root-to-node path is committed, so rejected
branches never reach the target's committed sequence. Every step returns at least one token (the target's own
choice after the last accepted node), so decoding never slows below plain decoding by more than the draft's
overhead, and a caller that streams each step's tokens can stop (cancel, EOS, length) between steps.

Token bookkeeping: `start()` chooses the first token from the prompt's logits and returns it at once (TTFT does
not wait for a forward). The last returned token is always *pending*: chosen, emitted, not yet fed to the
target; it is the root of the next step's tree. Hence, at any time,
`target.committed_tokens() == prompt tokens + emitted tokens - 1`, and stopping costs no wasted forward.

Lossless:
- temperature 0: the walk follows the target's argmax, so the output is token-identical to plain greedy decoding
  (`torch.argmax` picks the first maximum, as `generate` does).
- temperature > 0: recursive rejection sampling over the children of each visited node. Child j with token x,
  drawn from q_j (its drafter's distribution given its ancestors and earlier siblings; one-hot for
  deterministic drafters), is accepted with probability min(1, r(x)/q_j(x)); on rejection the residual becomes
  r <- norm(max(0, r - q_j)) (for a one-hot q: r with x zeroed). r starts as p, the target's distribution after
  temperature and top-p exactly as plain sampling computes it (`sampling.sampling_probs`). If no child is accepted the
  token is drawn from r. Each node's output is therefore distributed exactly as p (Leviathan/Chen for chains,
  SpecTr-style recursive rejection for siblings), and the walk descends into the accepted child.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field

import torch

from runtime.models.lm.draft_depth import Acceptance, DraftController, StepCosts
from runtime.models.lm.drafters import Drafter
from runtime.models.lm.json_constraint import JsonConstraint
from runtime.models.lm.sampling import Sampler, argmax_rows, draw, greedy_token
from runtime.models.lm.target import Target


@dataclass
class SpecStats:
    """Counters for metrics (Spec-Bench conventions: tokens per target forward, acceptance)."""

    steps: int = 0  # target forwards made by step()
    drafted: int = 0  # draft nodes sent to the target
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens returned by step() (accepted drafts + one target token per step)
    k: int = 0  # draft depth chosen for the last step
    verify_s: float = 0.0  # wall seconds in Target.score (to the first host sync)
    draft_s: float = 0.0  # wall seconds in Drafter.propose
    depth_acceptance: list[float] = field(default_factory=list)  # current estimate per depth 1..max

    @property
    def accepted_per_step(self) -> float:
        """Mean tokens per target forward (>= 1 by construction)."""
        return self.emitted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float | int | list[float]]:
        return {**asdict(self), "accepted_per_step": self.accepted_per_step}


@dataclass
class Tree:
    """A planned step: the draft depth chosen, the tree to score (node 0 the pending token) and each node's draft
    distribution (None: deterministic), and what drafting it cost."""

    k: int
    tokens: list[int]
    parents: list[int]
    qs: list[torch.Tensor | None]
    draft_s: float


class SpeculativeDecoder:
    """Decodes from `target` with drafts from `drafter` (None = plain decoding, one token per step).

    `stop_ids`: tokens that end the answer; an accepted draft token in it ends the step there and is not
    committed (it stays pending, like any last token). `cost_model(nodes) -> seconds` replaces measured costs in
    the depth choice (tests, or a per-device table). `constraint`: every token is chosen from the target's logits
    masked by it (a JSON schema), drafts are checked against it before the forward, and once it is finished the
    answer ends with its stop token, without a forward.
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_draft_tokens: int = 8,
        generator: torch.Generator | None = None,
        adapt: bool = True,
        stop_ids: Collection[int] = (),
        cost_model: Callable[[int], float] | None = None,
        constraint: JsonConstraint | None = None,
        costs: StepCosts | None = None,
        acceptance: Acceptance | None = None,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.temperature, self.top_p = temperature, top_p
        self.sampler = Sampler(temperature, top_p)
        self.max_draft_tokens = max(0, max_draft_tokens) if drafter is not None else 0
        self.generator, self.adapt = generator, adapt
        self.stop_ids = frozenset(stop_ids)
        self.constraint = constraint
        self.controller = DraftController(max(1, self.max_draft_tokens), cost_model, costs=costs,
                                          acceptance=acceptance)
        self.stats = SpecStats()
        self.context: list[int] = []  # prompt/context ids + emitted tokens, without the pending one
        self.pending: int | None = None
        self.done = False

    @property
    def greedy(self) -> bool:
        return self.sampler.greedy

    def _choose(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return greedy_token(logits)
        return draw(self.sampler.probs(logits), self.generator)

    @torch.inference_mode()
    def start(self, first_logits: torch.Tensor, context: Sequence[int] = ()) -> int:
        """Choose the first token from the logits after the prompt and return it (stream it now). `context` is
        what drafters may look things up in: the prompt ids (transcript, question); the target must have exactly
        these committed if a draft-model drafter mirrors it."""
        first_logits = first_logits.reshape(-1)
        self.context = list(context)
        if self.constraint is None:
            self.pending = self._choose(first_logits)
        else:
            self.pending = self._choose(self.constraint.mask(first_logits))
            self.constraint.consume(self.pending)
        self.done = self.pending in self.stop_ids
        if self.drafter is not None and self.context:
            self.drafter.observe([self.context[-1]], [-1], first_logits[None])
        return self.pending

    def _limit(self, max_tokens: int | None, max_depth: int | None = None) -> int:
        """The deepest draft this step may score."""
        limit = self.max_draft_tokens if max_depth is None else min(self.max_draft_tokens, max_depth)
        if max_tokens is not None:
            limit = min(limit, max_tokens - 1)
        return max(0, limit)

    def _cut(self, tokens: list[int], parents: list[int], qs: list[torch.Tensor | None], kind: int,
             ) -> tuple[int, list[int], list[int], list[torch.Tensor | None]]:
        """The tree cut to the depth `DraftController.choose_cut` picks for it (node 0, the root, always kept)."""
        depth = [0]
        for par in parents[1:]:
            depth.append(depth[par] + 1)
        nodes_within = [sum(1 for d in depth[1:] if d <= k) for k in range(max(depth) + 1)]
        k = self.controller.choose_cut(nodes_within, kind)
        if nodes_within[k] == len(tokens) - 1:
            return k, tokens, parents, qs
        keep = [i for i, d in enumerate(depth) if d <= k]  # parents come first, so every kept node's parent is kept
        new = {old: i for i, old in enumerate(keep)}
        return k, [tokens[i] for i in keep], [-1] + [new[parents[i]] for i in keep[1:]], [qs[i] for i in keep]

    def _draft(self, k: int) -> tuple[list[int], list[int], list[torch.Tensor | None], int]:
        """The tree to score: node 0 = pending (parent -1), draft node i -> node i+1 with parent p+1. Nodes deeper
        than k, or under a dropped node, are dropped (drafters should honour the budget; this enforces it). Also
        returns the draft's kind (`Draft.kind`)."""
        assert self.pending is not None
        tokens, parents, qs = [self.pending], [-1], [None]
        if k == 0 or self.drafter is None:
            return tokens, parents, qs, 0
        draft = self.drafter.propose(self.context, self.pending, k)
        dq = draft.q if draft.q is not None else [None] * len(draft.tokens)
        if not (len(draft.tokens) == len(draft.parents) == len(dq)):
            raise ValueError("draft tokens, parents and q differ in length")
        where, depth = {-1: 0}, [0]
        for i, (tok, par) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
            if not -1 <= par < i:
                raise ValueError(f"draft node {i} has parent {par}; parents must come first (-1 = pending)")
            if par not in where or depth[where[par]] >= k:
                continue
            where[i] = len(tokens)
            depth.append(depth[where[par]] + 1)
            tokens.append(int(tok))
            parents.append(where[par])
            qs.append(dq[i])
        if self.constraint is not None and len(tokens) > 1:
            # a node the grammar rejects is never the masked target's choice: drop it before the forward. A sampled
            # node (q given) stays when sampling: rejecting it also shapes the residual its later siblings see.
            removable = [self.greedy or q is None for q in qs]
            keep = self.constraint.keep_tree(tokens, parents, removable)
            if len(keep) < len(tokens):
                new = {old: i for i, old in enumerate(keep)}
                tokens = [tokens[i] for i in keep]
                parents = [-1] + [new[parents[i]] for i in keep[1:]]
                qs = [qs[i] for i in keep]
        return tokens, parents, qs, draft.kind

    def _accept(self, p: torch.Tensor, tokens: list[int], kids: list[int], qs: list) -> int | None:
        """Recursive rejection sampling over one node's children; returns the accepted child or None (then the
        residual, left in `p`, is what the next token is drawn from)."""
        for c in kids:
            x, q = tokens[c], qs[c]
            u = float(torch.rand((), dtype=torch.float64, generator=self.generator))
            if q is None:
                if u < float(p[x]):
                    return c
                p[x] = 0.0
            else:
                q = q.detach().double().cpu().reshape(-1)
                if q.numel() < p.numel():
                    q = torch.cat([q, q.new_zeros(p.numel() - q.numel())])
                q = q[: p.numel()]
                if float(q[x]) > 0 and u < min(1.0, float(p[x]) / float(q[x])):
                    return c
                p.sub_(q).clamp_(min=0.0)
            total = float(p.sum())
            if total <= 1e-300:  # float residue only (the last mass was rejected with u ~ 1): nothing else is left
                return c
            p.div_(total)
        return None

    @torch.inference_mode()
    def step(self, max_tokens: int | None = None) -> list[int]:
        """One target forward; returns the newly decided tokens (>= 1, at most `max_tokens`). The last returned
        token becomes pending. Raises once a stop token has been emitted."""
        planned = self.plan(max_tokens)
        if not isinstance(planned, Tree):
            return planned
        t = time.perf_counter()
        logits = self.target.score(planned.tokens, planned.parents)
        argmax = argmax_rows(logits)  # one host sync: the forward is done
        return self.finish(planned, logits, argmax, time.perf_counter() - t)

    @torch.inference_mode()
    def plan(self, max_tokens: int | None = None, max_depth: int | None = None) -> Tree | list[int]:
        """A step's first half: the tree to score (drafted now), or the step's tokens when it needs no forward (a
        finished constraint: only its stop token may follow). `step` is `plan`, `target.score`, `finish`; a caller
        that scores several answers' trees in one forward (`engine_session.score_together`) calls the halves, and
        may hold each tree to `max_depth` so that the forward stays about one deep tree's size."""
        if self.pending is None:
            raise RuntimeError("SpeculativeDecoder.step() before start()")
        if self.done:
            raise RuntimeError("SpeculativeDecoder.step() after a stop token")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        constraint = self.constraint
        if constraint is not None and constraint.finished:  # only the end may follow: no forward to learn it
            self.pending, self.done = constraint.stop, True
            return [constraint.stop]
        limit = self._limit(max_tokens, max_depth)
        cut = self.adapt and getattr(self.drafter, "free", False)  # propose at the limit, then cut (`choose_cut`)
        k = limit if cut or not self.adapt or limit <= 0 else self.controller.choose(limit)
        t0 = time.perf_counter()
        tokens, parents, qs, kind = self._draft(k)
        if cut and k > 0:
            k, tokens, parents, qs = self._cut(tokens, parents, qs, kind)
        return Tree(k, tokens, parents, qs, time.perf_counter() - t0)

    @torch.inference_mode()
    def finish(self, tree: Tree, logits: torch.Tensor, argmax: list[int], verify_s: float,
               rows: int | None = None) -> list[int]:
        """A step's second half: walk the scored tree (`logits` [nodes, vocab], `argmax` its rows' argmax), commit
        the accepted path and return the decided tokens. `verify_s`: what the forward cost, the depth controller's
        price of a forward of `rows` rows (default: this tree's; all the trees' when several answers shared it)."""
        constraint = self.constraint
        k, tokens, parents, qs = tree.k, tree.tokens, tree.parents, tree.qs
        kids: list[list[int]] = [[] for _ in tokens]
        for i, par in enumerate(parents[1:], start=1):
            kids[par].append(i)

        path, out, node, stopped = [0], [], 0, False
        while True:
            row = logits[node] if constraint is None else constraint.mask(logits[node])
            if self.greedy:
                want = argmax[node] if constraint is None else greedy_token(row)
                nxt = next((c for c in kids[node] if tokens[c] == want), None)
                residual = None
            else:
                residual = self.sampler.probs(row)
                nxt = self._accept(residual, tokens, kids[node], qs)
            if nxt is None:
                out.append(want if residual is None else draw(residual, self.generator))
                if constraint is not None:
                    constraint.consume(out[-1])
                break
            out.append(tokens[nxt])
            if constraint is not None:
                constraint.consume(tokens[nxt])
            if tokens[nxt] in self.stop_ids:  # stop inside the draft: emit it as pending, commit what precedes
                stopped = True
                break
            path.append(nxt)
            node = nxt
        self.target.commit(path)
        if self.drafter is not None:
            self.drafter.observe(tokens, parents, logits)

        self.context.extend(tokens[n] for n in path)
        accepted = len(out) if stopped else len(out) - 1
        if constraint is not None and constraint.finished and out[-1] not in self.stop_ids:
            out.append(constraint.stop)  # the value is complete: the answer ends with this step's text
        self.pending = out[-1]
        self.done = self.pending in self.stop_ids
        s = self.stats
        s.steps += 1
        s.drafted += len(tokens) - 1
        s.accepted += accepted
        s.emitted += len(out)
        s.k = k
        s.draft_s += tree.draft_s
        s.verify_s += verify_s
        if self.adapt:
            self.controller.record_cost(k, len(tokens) - 1, verify_s, tree.draft_s, rows)
            if k > 0:
                self.controller.record_acceptance(accepted, bool(kids[node]) and not stopped)
                s.depth_acceptance = self.controller.alphas()
        return out
