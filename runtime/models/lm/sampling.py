"""Token choice and the stop rule: the one home of greedy, temperature and top-p, of the end-of-sequence ids
and of when an answer ends. Every decoding path uses it: the generate answerer, the engine answerer, the
speculative decoder, the drafters and the reference targets' tests.

Two consumers need the same distribution in two precisions, and each is kept bit for bit as it was (seeded
outputs must not change):
- plain sampling (`Sampler.choose`, the generate answerer) draws from the float32 nucleus probabilities;
- speculative decoding (`Sampler.probs` = `sampling_probs`) needs them in float64, renormalised, since its
  residual arithmetic (rejection sampling) must not lose tiny probabilities; it draws with `draw`.
Greedy is `argmax`, which picks the first maximum on ties, as transformers' `generate` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def greedy_token(logits: torch.Tensor) -> int:
    """The most likely token; on ties the lowest id (torch.argmax's first maximum, as `generate`)."""
    return argmax_rows(logits)[0]


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's most likely token [n, vocab] -> n ids, the first maximum on ties (NaN counts as the maximum).
    A float32 CPU tensor goes through numpy, whose vectorised argmax takes 4 us over SmolLM2's 49,152 logits where
    torch's takes 45 (half a percent of a decode step); both pick the first maximum."""
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().resolve_neg().resolve_conj().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def top_k_ids(logits: torch.Tensor, k: int, block: int = 128) -> torch.Tensor:
    """Each row's k most likely ids, most likely first [..., vocab] -> [rows, k] (int64), for drafters learning what
    the target would say (ties in any order: a drafter's guess need not match `argmax_rows`'s choice).

    Why not `torch.topk` alone: over Qwen2.5's 151,936 logits it took 0.45 ms for the 4 rows of a verified tree at 2
    threads (0.94 for 9), 1-2 % of the step, paid again by every drafter that learns. The row's maximum per block
    of 128 is a cheap vectorised pass; the k best ids lie in the k blocks with the highest maxima (a block outside
    them has k blocks above it, each holding a larger value), so topk runs on k * 128 candidates: 0.11 ms."""
    rows = logits.reshape(-1, logits.shape[-1])
    vocab = rows.shape[-1]
    whole = vocab // block * block
    if rows.device.type != "cpu" or whole < 4 * k * block:
        return rows.topk(k, dim=-1).indices
    blocks = rows[:, :whole].view(rows.shape[0], whole // block, block)
    best = blocks.amax(-1).topk(k, dim=-1).indices  # [rows, k]
    at = torch.arange(rows.shape[0])[:, None]
    values = blocks[at, best].reshape(rows.shape[0], k * block)
    ids = (best[:, :, None] * block + torch.arange(block)).reshape(rows.shape[0], k * block)
    if whole < vocab:  # the last, partial block: always a candidate
        values = torch.cat([values, rows[:, whole:]], dim=-1)
        ids = torch.cat([ids, torch.arange(whole, vocab).expand(rows.shape[0], -1)], dim=-1)
    return ids.gather(1, values.topk(k, dim=-1).indices)


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """float32 probabilities [..., vocab] on the CPU: softmax of logits / temperature, then only the smallest
    most-likely head whose mass reaches top_p (always at least the most likely token). Not renormalised."""
    probs = torch.softmax(logits.detach().float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before a token already reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """`nucleus_probs` in float64, renormalised: what rejection sampling's residual arithmetic runs on."""
    probs = nucleus_probs(logits, temperature, top_p).double()
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from `probs` (need not sum to 1) with `generator`."""
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class Sampler:
    """The configured rule (`lm.temperature`, `lm.top_p`): greedy when temperature <= 0."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generator(self, seed: int) -> torch.Generator | None:
        """A CPU generator seeded for one answer; None when greedy (nothing is drawn)."""
        return None if self.greedy else torch.Generator().manual_seed(seed)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """Plain sampling of one token (argmax when greedy or without a generator)."""
        if self.greedy or generator is None:
            return greedy_token(logits)
        return draw(nucleus_probs(logits, self.temperature, self.top_p), generator)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """float64 probabilities for speculative sampling (`sampling_probs`)."""
        return sampling_probs(logits, self.temperature, self.top_p)


def eos_ids(generation_eos: int | Iterable[int] | None, tokenizer_eos: int | None) -> frozenset[int]:
    """The ids that end an answer: the generation config's `eos_token_id` (an id, a list, or None) and the
    tokenizer's own eos token."""
    ids = set() if generation_eos is None else {generation_eos} if isinstance(generation_eos, int) \
        else set(generation_eos)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)


@dataclass(frozen=True)
class StopRule:
    """When an answer ends: an end-of-sequence token ends it with "stop" (the token is not part of the answer);
    the `max_new_tokens`-th answer token ends it with "length". With `stop_repeats`, an answer that has started
    saying the same thing over and over (`repeats_itself`) also ends with "stop": a small model, once in a loop,
    never leaves it, and the rest of the budget would be the loop."""

    eos_ids: frozenset[int]
    max_new_tokens: int
    stop_repeats: bool = False

    def take(self, tokens: Iterable[int], generated: list[int]) -> str | None:
        """Append `tokens` to `generated` in order until one ends the answer; returns the finish reason
        ("stop" | "length") or None when the answer goes on. Tokens after the end are dropped."""
        tokens = list(tokens)
        for i, token in enumerate(tokens):
            if token in self.eos_ids:
                return "stop"
            generated.append(token)
            if len(generated) >= self.max_new_tokens:  # an end that came with the last token is still an end: a
                # JSON value completed by the budget's last token ends "stop" (its forced end arrives with it)
                return "stop" if i + 1 < len(tokens) and tokens[i + 1] in self.eos_ids else "length"
            if self.stop_repeats and repeats_itself(generated):
                return "stop"
        return None

    def room(self, generated: int) -> int:
        """How many more tokens the answer may take."""
        return self.max_new_tokens - generated


LONGEST_REPEAT = 32  # tokens: the longest phrase whose repetition ends an answer


def repeats_itself(tokens: list[int]) -> bool:
    """Whether `tokens` end in one phrase said again and again: one token four times, a phrase of 2-7 tokens
    three times, a longer one (a sentence) twice, back to back. Plain text rarely repeats itself so exactly
    ("at ten at ten at ten", a sentence said twice), and a decoding loop always does."""
    n = len(tokens)
    for size in range(1, min(LONGEST_REPEAT, n // 2) + 1):
        copies = 4 if size == 1 else 3 if size < 8 else 2
        if n < copies * size:
            continue
        last = tokens[n - size:]
        if all(tokens[n - (k + 1) * size : n - k * size] == last for k in range(1, copies)):
            return True
    return False
