"""Beam search for Whisper's full-context decodes: the search openai-whisper and faster-whisper run by default
(5 beams), for the final pass that rewrites each turn once it is committed. The pass runs it when its greedy
transcript loops (`final_pass.py`), or for every turn with `asr.final_pass_beam` > 1.

Why: greedy decoding commits to the likeliest next token even when the sentence it starts is unlikely as a whole,
and sometimes never leaves a phrase ("wait, wait, wait, ..."). On synthetic narration tiny.en greedy wrote "the
more that proved the mergers on Monday" where 5 beams write "... the budget on Monday"; on the synthetic held-out
set 5 beams took no clip into a loop where greedy took 5 (docs/model_card_causal_whisper.md has the figures). A
turn is searched after it is over, so only its final transcript waits for the search; each token costs a decoder
step over `beams` rows.

The rules are openai-whisper's `BeamSearchDecoder` with patience 1 and its default ranking:
- each live beam proposes its `beams + 1` likeliest next tokens; the candidates, scored by their summed log
  probability, are taken best first: one ending in end-of-text is a finished hypothesis, any other a live beam,
  until `beams` live beams are kept;
- the search ends once `beams` hypotheses have finished (or at `max_tokens`, when the live beams count as
  finished);
- the result is the finished hypothesis with the highest summed log probability per token (end-of-text not
  counted in the length, its log probability counted in the sum).
With one beam this is greedy decoding, token for token up to exact ties of two logits (`topk` and `argmax` may break
them differently), so `WhisperBuffered.decode` runs its greedy loop for one beam.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class BeamDecoder(Protocol):
    """A decoder whose rows are beams: log probabilities [rows, vocab] of the next token."""

    def start(self, prefix: Sequence[int]) -> torch.Tensor:
        """Feed the prompt (one row); its next-token log probabilities [1, vocab]."""
        ...

    def extend(self, sources: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Row i becomes a copy of row `sources[i]` fed `tokens[i]`; the new rows' log probabilities."""
        ...


def beam_search(decoder: BeamDecoder, prefix: Sequence[int], *, beams: int, eos: int, max_tokens: int) -> list[int]:
    """The tokens after `prefix` (no end-of-text) of the best hypothesis, by the module's rules."""
    if beams < 1:
        raise ValueError(f"beams must be >= 1, got {beams}")
    live: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]  # (summed log probability, tokens)
    finished: list[tuple[float, tuple[int, ...]]] = []
    if max_tokens <= 0:
        return []
    logprobs = decoder.start(prefix)
    while True:
        top = logprobs.topk(min(beams + 1, logprobs.shape[-1]), dim=-1)
        candidates = sorted(
            ((live[row][0] + float(lp), row, int(token))
             for row in range(len(live))
             for lp, token in zip(top.values[row].tolist(), top.indices[row].tolist(), strict=True)),
            key=lambda c: -c[0])
        kept: list[tuple[float, int, int]] = []
        ended: list[tuple[float, tuple[int, ...]]] = []
        for score, row, token in candidates:
            if score == float("-inf"):
                break  # suppressed tokens: nothing after them is possible either
            if token == eos:
                ended.append((score, live[row][1]))
            else:
                kept.append((score, row, token))
                if len(kept) == beams:
                    break
        finished += ended[: beams - len(finished)]
        live = [(score, live[row][1] + (token,)) for score, row, token in kept]
        if len(finished) >= beams or not live:
            break
        if len(live[0][1]) >= max_tokens:
            finished += live[: beams - len(finished)]
            break
        sources = torch.tensor([row for _, row, _ in kept])
        logprobs = decoder.extend(sources, torch.tensor([token for _, _, token in kept]))
    if not finished:
        return []
    return list(max(finished, key=lambda h: h[0] / max(1, len(h[1])))[1])
