"""`lm.drafter` to a drafter: the factory, and `auto`, which picks among drafters by measured acceptance.

`auto` exists because no drafter wins everywhere (runtime bench llm --model ...: on answers that quote the
transcript n-gram copies and tri-gram chains accept 2 tokens a step; in open chat nothing accepts much; Token
Recycling's wide trees pay on a GPU and cost more than they save on 2 CPU cores). So it keeps the candidates
that suit the device, learns from every verified tree how many of each one's proposed nodes the target
accepted, and proposes with the best, trying the others now and then so the estimates stay current.
"""

from __future__ import annotations

from collections.abc import Sequence

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
from runtime.models.lm.target import Target

EXPLORE_EVERY = 16  # every 16th proposal goes to a candidate other than the current best


def greedy_accepted(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> int:
    """How many draft nodes below the root a greedy target accepts in a scored tree (root = node 0)."""
    best = logits.argmax(-1).tolist()
    node, accepted = 0, 0
    while True:
        child = next((c for c in range(len(tokens)) if parents[c] == node and tokens[c] == best[node]), None)
        if child is None:
            return accepted
        node, accepted = child, accepted + 1


class AutoDrafter:
    """`auto`: the n-gram copy, the tri-gram table and (where wide trees are cheap to verify: `wide_trees`, a
    GPU) Token Recycling, chosen per proposal by measured acceptance: an exponential average, per candidate,
    of accepted draft tokens per proposed node (a node costs verification time whether accepted or not). A
    candidate with nothing to propose is skipped. Every candidate learns from every verified tree."""

    def __init__(self, vocab_size: int, ngram: NgramDrafter | None = None, wide_trees: bool = True,
                 decay: float = 0.9) -> None:
        self.candidates: dict[str, Drafter] = {"ngram": ngram or NgramDrafter(), "trigram": TrigramDrafter()}
        if wide_trees:
            self.candidates["recycling"] = TokenRecyclingDrafter(vocab_size)
        self.decay = decay
        self.reset_estimates()
        self._last: tuple[str, int] | None = None  # (candidate, nodes) of the proposal being verified

    def reset_estimates(self) -> None:
        # optimistic start: the copy first (it is free and long when it matches), then the others
        self.rate = {name: 1.0 if name == "ngram" else 0.5 for name in self.candidates}
        self.proposals = 0

    def _order(self) -> list[str]:
        ranked = sorted(self.candidates, key=lambda name: -self.rate[name])
        if self.proposals % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            ranked = ranked[1:] + ranked[:1]
        return ranked

    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        self.proposals += 1
        self._last = None
        for name in self._order():  # the first with something to propose; the others catch up on the context
            draft = self.candidates[name].propose(context, pending, budget)  # incrementally when next asked
            if draft.tokens:
                self._last = (name, len(draft.tokens))
                return draft
        return EMPTY

    def observe(self, tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> None:
        for drafter in self.candidates.values():
            drafter.observe(tokens, parents, logits)
        if self._last is not None and len(tokens) > 1:
            name, nodes = self._last
            rate = greedy_accepted(tokens, parents, logits) / max(1, nodes)
            self.rate[name] = self.decay * self.rate[name] + (1 - self.decay) * rate
        self._last = None

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
) -> Drafter | None:
    """The drafter `cfg.drafter` names (None for "none"). draft-model needs `draft_target`: a session of
    `cfg.draft_model` holding `draft_fed` (the same prompt as the main target). `wide_trees`: whether the
    target verifies a wide tree about as fast as one token (a GPU), which decides `auto`'s fallback."""
    kind = cfg.drafter
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter()
    if kind == "recycling":
        return TokenRecyclingDrafter(vocab_size)
    if kind == "trigram":
        return TrigramDrafter()
    if kind == "auto":
        return AutoDrafter(vocab_size, wide_trees=wide_trees)
    if kind in ("draft-model", "swift"):
        if draft_target is None:
            raise ConfigError(f"lm.drafter = {kind} needs a draft session: lm.draft_model (a smaller model, same "
                              "tokenizer) for draft-model; the engine builds the layer-skip view for swift")
        return DraftModelDrafter(
            draft_target, fed=draft_fed, temperature=cfg.temperature, top_p=cfg.top_p, generator=generator
        )
    raise ConfigError(f"lm.drafter {kind!r} is not one of {', '.join(DRAFTERS)}")
