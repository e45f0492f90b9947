"""`lm.drafter` to a drafter: the factory, and `auto`, which picks among drafters by measured acceptance.

`auto` exists because no drafter wins everywhere (runtime bench llm --model ...: on answers that quote the
transcript n-gram copies and tri-gram chains accept 2 tokens a step; in open chat nothing accepts much; Token
Recycling's wide trees pay on a GPU and cost more than they save on 2 CPU cores). So it keeps the candidates
that suit the device, asks each of them at every step (on a CPU, once the copy stops earning: `wake_below`), and
proposes with the one whose proposals would have been accepted most. "Would have been": each candidate's proposal is
scored against the tokens the answer went on to decode (the target's own choices), whichever candidate's tree was
verified, so every estimate stays current without spending verification on the losers. An earlier `auto` scored
only the proposal it verified: once the tri-gram table's always-available drafts ranked first they shadowed the copy,
and `auto` fell to 1.38x where the copy alone gave 1.82x on transcript answering (docs/llm.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from runtime.config import LMConfig
from runtime.errors import ConfigError
from runtime.models.lm.drafters import (
    DRAFTERS,
    EMPTY,
    Draft,
    Drafter,
    DraftModelDrafter,
    NgramDrafter,
    TokenRecyclingDrafter,
    TrigramDrafter,
)
from runtime.models.lm.dynamic_tree import DynamicTreeDrafter
from runtime.models.lm.target import Target

OUTSTANDING = 64  # proposals per candidate waiting for the decoded tokens that score them (bounded)
# on a CPU, the copy alone until it earns less than a token a step (`AutoDrafter`'s `wake_below`): a transcript
# answer's copy earned 2-3 a step after its first words, open chat's almost none
WAKE_BELOW = 1.0
KEY = 4  # tokens before a proposal's first position that must still be there when it is scored


def greedy_accepted(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> int:
    """How many draft nodes below the root a greedy target accepts in a scored tree (root = node 0)."""
    best = logits.argmax(-1).tolist()
    node, accepted = 0, 0
    while True:
        child = next((c for c in range(len(tokens)) if parents[c] == node and tokens[c] == best[node]), None)
        if child is None:
            return accepted
        node, accepted = child, accepted + 1


def matched_path(draft: Draft, decoded: Sequence[int]) -> tuple[int, bool]:
    """How many levels of `draft` (a tree below the pending token) follow `decoded` (the tokens after the pending
    one, as far as they are known), and whether that is final: the walk stopped at a token the tree does not
    hold, or at a leaf, rather than at the end of what is known."""
    node, depth = -1, 0
    while True:
        kids = [i for i, parent in enumerate(draft.parents) if parent == node]
        if not kids:
            return depth, True
        if depth >= len(decoded):
            return depth, False
        node = next((i for i in kids if draft.tokens[i] == decoded[depth]), -2)
        if node == -2:
            return depth, True
        depth += 1


@dataclass
class _Proposal:
    start: int  # index in the sequence (context + pending) of the first token it guesses
    key: tuple[int, ...]  # the sequence's last KEY tokens before `start` when it was made
    draft: Draft


class AutoDrafter:
    """`auto`: the n-gram copy, the tri-gram table and (where wide trees are cheap to verify: `wide_trees`, a
    GPU) Token Recycling. At each step every candidate proposes; each proposal is later scored by how many of its
    levels the decoded answer followed (`matched_path`), and `auto` returns the proposal of the candidate with the
    highest expected accepted tokens per proposal (an exponential average, per candidate, over its scored
    proposals), ties to the earlier candidate. A candidate with nothing to propose is skipped; when none proposes,
    the step is plain. Every candidate asked also learns from every verified tree (`observe`).

    `wake_below`: when given, the first candidate (the copy) is asked alone until the tokens its proposals earn a
    step (an exponential average, a step it proposes nothing counting 0) fall below it; then every candidate is
    asked from that step on. Why, on a CPU: the others cost at every step (the tri-gram table's learning, the top-k
    of every scored row: 0.44 ms of a 45-65 ms step of the 1.5B at 2 threads) and, while the copy earns, never win:
    over the bench's transcript and summarising answers `auto` proposed the copy's draft at every step, so it was
    the copy with 1 % more work a step (docs/llm.md). None: every candidate is asked from the start (a GPU, where
    Token Recycling's wide trees may beat a copy that earns)."""

    def __init__(self, vocab_size: int, ngram: NgramDrafter | None = None, wide_trees: bool = True,
                 decay: float = 0.9, candidates: dict[str, Drafter] | None = None,
                 wake_below: float | None = None) -> None:
        """`candidates`: the drafters to choose among, in tie-breaking order (default: see the class doc)."""
        if candidates is None:
            candidates = {"ngram": ngram or NgramDrafter(), "trigram": TrigramDrafter()}
            if wide_trees:
                candidates["recycling"] = TokenRecyclingDrafter(vocab_size)
        self.candidates = candidates
        self.free = all(getattr(c, "free", False) for c in candidates.values())  # see `Drafter.free`
        self.decay, self.wake_below = decay, wake_below
        self.lead = next(iter(candidates))
        self.reset_estimates()

    def reset_estimates(self) -> None:
        # optimistic start for the copy (free, and long when it matches), modest for the others
        self.start_gain = {name: 2.0 if i == 0 else 0.5 for i, name in enumerate(self.candidates)}
        self.gain = dict(self.start_gain)  # per candidate, over every kind of its drafts
        # per candidate and kind of draft (`Draft.kind`: the copy's one-token matches are right far less often than
        # its longer ones, and are then worth less than the tri-gram table's guess)
        self.kind_gain: dict[tuple[str, int], float] = {}
        self.scored = dict.fromkeys(self.candidates, 0)
        self.chosen = dict.fromkeys(self.candidates, 0)
        self._waiting: dict[str, deque[_Proposal]] = {name: deque() for name in self.candidates}
        # the candidates asked (`wake_below`), and what the first one earns a step
        self.asked = list(self.candidates) if self.wake_below is None else [self.lead]
        self.lead_rate = self.start_gain[self.lead]

    def _lead_earned(self, tokens: int) -> None:
        self.lead_rate = self.decay * self.lead_rate + (1 - self.decay) * tokens
        if self.wake_below is not None and self.lead_rate < self.wake_below and len(self.asked) < len(self.candidates):
            self.asked = list(self.candidates)

    def _score(self, context: Sequence[int], pending: int) -> None:
        """Score the waiting proposals that the decoded tokens now decide; drop those of another context. Only the
        sequence's tail from the oldest waiting proposal on is read (no copy of a long context per step)."""
        starts = [w[0].start for w in self._waiting.values() if w]
        if not starts:
            return
        base = max(0, min(starts) - KEY)
        seq = [*context[base:], pending]  # positions from `base` on
        length = base + len(seq)
        for name, waiting in self._waiting.items():
            while waiting:
                prop = waiting[0]
                at = prop.start - base
                if length < prop.start or tuple(seq[max(0, at - KEY) : at]) != prop.key:
                    waiting.popleft()  # the context moved on (a new answer): it can no longer be scored
                    continue
                accepted, final = matched_path(prop.draft, seq[at:])
                if not final:
                    break  # later proposals start later still: none of them is decided either
                waiting.popleft()
                self.gain[name] = self.decay * self.gain[name] + (1 - self.decay) * accepted
                key = (name, prop.draft.kind)
                self.kind_gain[key] = (self.decay * self.kind_gain.get(key, self.start_gain[name])
                                       + (1 - self.decay) * accepted)
                self.scored[name] += 1
                if name == self.lead:
                    self._lead_earned(accepted)

    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        self._score(context, pending)
        start, key = len(context) + 1, (*context[-(KEY - 1):], pending)
        best: tuple[float, str, Draft] | None = None
        for name in self.asked:  # every candidate asked keeps up with the context
            draft = self.candidates[name].propose(context, pending, budget)
            if not draft.tokens:
                if name == self.lead and budget > 0:
                    self._lead_earned(0)
                continue
            waiting = self._waiting[name]
            waiting.append(_Proposal(start, key, draft))
            if len(waiting) > OUTSTANDING:
                waiting.popleft()
            gain = self.kind_gain.get((name, draft.kind), self.start_gain[name])
            if best is None or gain > best[0]:
                best = (gain, name, draft)
        if best is None:
            return EMPTY
        self.chosen[best[1]] += 1
        return best[2]

    def observe(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> None:
        for name in self.asked:
            self.candidates[name].observe(tokens, parents, logits)

    def reset(self) -> None:
        for drafter in self.candidates.values():
            drafter.reset()
        self.reset_estimates()


def make_drafter(
    cfg: LMConfig,
    *,
    vocab_size: int,
    draft_target: Target | None = None,
    draft_fed: Sequence[int] = (),
    generator: torch.Generator | None = None,
    wide_trees: bool = True,
    line_ends: Collection[int] = frozenset(),
) -> Drafter | None:
    """The drafter `cfg.drafter` names (None for "none"). draft-model needs `draft_target`: a session of
    `cfg.draft_model` holding `draft_fed` (the same prompt as the main target). `wide_trees`: whether the
    target verifies a wide tree about as fast as one token (a GPU), which decides `auto`'s fallback. `line_ends`: the
    tokens that end a line, where the copy stops (`NgramDrafter`; `tokenizer.line_end_ids`)."""
    kind = cfg.drafter
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(line_ends=line_ends)
    if kind == "recycling":
        return TokenRecyclingDrafter(vocab_size)
    if kind == "trigram":
        return TrigramDrafter()
    if kind == "auto":
        return AutoDrafter(vocab_size, NgramDrafter(line_ends=line_ends), wide_trees=wide_trees,
                           wake_below=None if wide_trees else WAKE_BELOW)
    if kind in ("draft-model", "dyspec", "swift"):
        if draft_target is None:
            raise ConfigError(f"lm.drafter = {kind} needs a draft session: lm.draft_model (a smaller model, same "
                              "tokenizer) for draft-model and dyspec; the engine builds the layer-skip view for swift")
        if kind == "dyspec":
            return DynamicTreeDrafter(draft_target, fed=draft_fed)
        return DraftModelDrafter(
            draft_target, fed=draft_fed, temperature=cfg.temperature, top_p=cfg.top_p, generator=generator
        )
    raise ConfigError(f"lm.drafter {kind!r} is not one of {', '.join(DRAFTERS)}")
