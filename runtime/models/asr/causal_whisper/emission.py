"""The emission rule of causal streaming Whisper (CarelessWhisper): what one block of new encoder frames adds
to an item's transcript. `stream.py` runs it over a stream (and `reference.py` over the offline reference, identically).

Per block: re-check the unstable tail (a token stays if its probability under the new encoder context did not
fall, or it is still the argmax; at the first that fails it and everything after it are cut), then decode on
greedily until eos, a loop (`loops`), `block_tokens` new tokens or the item's budget. Tokens older than the
look-back window are stable.

Refresh (`asr.refresh_ms`): a decoder position keeps the states it got from the frames heard when it was fed
(`decoder.py`), so the prompt and the stable tokens of a long item were computed on a fraction of its audio.
Under short blocks this stale prefix makes the model predict eos after a sentence ("Ever tried.") and keep
predicting it while the speaker goes on. A block that stops on eos or a loop, when position 0 was last fed
`refresh` frames or more before, is decoded once more with every position re-fed on all the frames heard, as the
`decoder` final pass does once at the end. It costs one feed of the item's positions, only when a block stops, at
most once per `refresh` frames (model card: it keeps 100 ms blocks going, and does not help 300 ms ones).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from runtime.models.asr.causal_whisper.decoder import Scorer


def argmax(row: torch.Tensor) -> int:
    """The index of a 1-D tensor's largest value (the first of equal ones, as `torch.argmax`). On the CPU numpy's,
    which takes a tenth of torch's time over a vocabulary row (5 against 50 us here), and a stream takes one for
    every token it feeds."""
    return int(row.numpy().argmax()) if row.device.type == "cpu" and row.dtype == torch.float32 else int(row.argmax())


def keep_count(ids: Sequence[int], old_probs: Sequence[float], logprobs: torch.Tensor) -> int:
    """The look-back rule: how many of the re-checked tokens `ids` stay. Token i stays if its probability
    under the new context (`logprobs[i]`, log-probs over the vocabulary) did not fall below `old_probs[i]`,
    or it is still the argmax; the first that fails is cut together with everything after it."""
    for i, tok in enumerate(ids):
        p = math.exp(float(logprobs[i, tok]))
        if not (p >= old_probs[i] or argmax(logprobs[i]) == tok):
            return i
    return len(ids)


LONGEST_LOOP = 16  # tokens in the longest phrase `loops` looks for


def loops(ids: Sequence[int], tok: int, repeats: int = 3, longest: int = LONGEST_LOOP) -> bool:
    """Would `tok` make the transcript's end a loop: one token said `repeats` + 1 times in a row, or a phrase of
    2 to `longest` tokens `repeats` times (`asr.loop_repeats`; 0 never)? Whisper reading past the audio it has falls
    into such loops ("3. 3. 3. 3. ...", or "I'm going to eat in the last 10th," fifteen times over a 100 ms
    stream), and greedy decoding never leaves them; people almost never say a phrase three times running. The rule
    treats a looping token as the end of what can be said for now (like eos): the next block may go on with
    anything else."""
    if repeats < 1:
        return False
    seq = [*ids[-(longest * repeats) :], tok]
    for n in range(1, longest + 1):
        times = repeats + (n == 1)
        if len(seq) >= n * times and all(seq[-n * k - n : len(seq) - n * k] == seq[-n:] for k in range(1, times)):
            return True
    return False


@dataclass
class Token:
    id: int
    prob: float  # its probability when last evaluated
    frame: int  # absolute encoder frame count (stream time / 20 ms) heard when it was decoded


class ItemDecoder:
    """The emission rule over one encoder segment (one transcript item)."""

    def __init__(self, scorer: Scorer, context: list[int], *, eos_id: int, lookback: int, max_tokens: int,
                 block_tokens: int, frame0: int, loop_repeats: int = 0, suppress: Sequence[int] = (),
                 refresh: int = 0, previous: Sequence[int] = ()) -> None:
        """`refresh`: frames after which a stopped block re-feeds every position (0: never). `previous`: the text
        before the item that its `context` conditions on (what the final pass gives its own decoder as prompt)."""
        self.scorer, self.context, self.eos_id = scorer, context, eos_id
        self.previous = list(previous)
        self.lookback, self.max_tokens, self.block_tokens = lookback, max_tokens, block_tokens
        self.frame0 = frame0  # absolute frame of the segment's start
        self.loop_repeats = loop_repeats
        self.suppress = torch.tensor(sorted(set(suppress)), dtype=torch.long)  # never chosen (Whisper's non-speech)
        self._mask: torch.Tensor | None = None  # 0, and -inf at the suppressed ids: added to the log-probabilities
        self.tokens: list[Token] = []
        self.stable = 0  # tokens[:stable] are stable
        self.refresh = refresh
        self.fed_at = 0  # frames heard when position 0 (and so every position) was last fed

    def step(self, frames: torch.Tensor, *, final: bool = False, refresh: bool = True) -> None:
        """Take a block of new encoder frames [n, d], re-check the tail, decode on; if it stopped on stale
        positions (module docstring), re-feed them all and decode on once more (not when `refresh` is False)."""
        s = self.scorer
        s.add_frames(frames)
        if not s.n_frames:
            return
        stable = self.stable
        stopped = self._decode(final)
        if stopped and refresh and self.refresh and s.n_frames - self.fed_at >= self.refresh:
            # what the stale pass made stable is re-judged too (nothing was shown in between); the re-fed pass
            # has its own `block_tokens`, so a block after a stall may add up to twice as many
            self.stable = stable
            s.truncate(0)
            self._decode(final)

    def _decode(self, final: bool, recheck: bool = True) -> bool:
        """One pass of the rule over the frames heard; True if it stopped on eos or a loop (not on a budget).
        Without `recheck` the unstable tail is kept as it is and only decoded on from (a preview's pass)."""
        s = self.scorer
        tail = self.tokens[self.stable :] if recheck else []
        ids = self.context + [t.id for t in self.tokens]
        anchor = len(ids) - 1 - len(tail)  # the last position not re-checked: predicts tail[0], or what follows
        start = min(s.length, anchor)
        s.truncate(start)
        if start == 0:
            self.fed_at = s.n_frames
        logp = self._allowed(s.feed(ids[start : anchor + 1 + len(tail)], last=1 + len(tail)))
        keep = keep_count([t.id for t in tail], [t.prob for t in tail], logp)
        for i in range(keep):
            tail[i].prob = math.exp(float(logp[i, tail[i].id]))
        if keep < len(tail):
            del self.tokens[self.stable + keep :]
            s.truncate(anchor + 1 + keep)
        nxt = logp[keep]
        budget = self.max_tokens - len(self.tokens)
        if not final:
            budget = min(budget, self.block_tokens)
        stopped = False
        while budget > 0:
            tok = argmax(nxt)
            if tok == self.eos_id or loops([t.id for t in self.tokens], tok, self.loop_repeats):
                stopped = True
                break
            self.tokens.append(Token(tok, math.exp(float(nxt[tok])), self.frame0 + s.n_frames))
            budget -= 1
            if budget:
                nxt = self._allowed(s.feed([tok]))[0]
        self.stable = len(self.tokens) if final else max(self.stable, len(self.tokens) - self.lookback)
        return stopped

    def _allowed(self, logp: torch.Tensor) -> torch.Tensor:
        """Log-probabilities with the suppressed tokens at -inf: neither chosen nor the argmax a kept token
        is checked against (the probabilities of the others are left as they are)."""
        if not len(self.suppress):
            return logp
        mask = self._mask
        if mask is None or (mask.shape[-1], mask.device, mask.dtype) != (logp.shape[-1], logp.device, logp.dtype):
            mask = self._mask = torch.zeros(logp.shape[-1], dtype=logp.dtype, device=logp.device)
            mask[self.suppress.to(logp.device)] = float("-inf")
        return logp + mask  # one pass over the row, where a copy and a scatter took two

    def preview(self, frames: torch.Tensor) -> list[int]:
        """The ids this item would hold if its open block ended with `frames` (a partial block's states, from
        the encoder's `preview`) and the block only added words: the item's tokens as they are, then greedy
        decoding on from the last of them over every frame heard, by the rule's budget and stops. Then everything
        is taken back (the tokens added, the scorer's frames and every position fed with them), so the next real
        step runs exactly as if no preview had been made.

        A preview does not re-check the unstable tail, as a block's step does: the re-check feeds the tail's
        positions with a vocabulary row each (three rows under the two-token look-back, where decoding on from the
        last token feeds one), which was a fifth of a previewed stream's compute and showed a median word 80 ms
        sooner on human speech (docs/model_card_causal_whisper.md). The block's step re-judges the tail at its end.

        Only what the preview fed is taken back: it feeds from `kept` on (the last token, or from where the
        scorer stops), so the positions before are as the last real step left them, and the next preview or step
        finds the scorer as if no preview had been made: a preview does not depend on earlier ones, whichever
        preview points a stream's calls reach (the reference makes every one), and the next real step re-feeds
        from its own start, at or before `kept`."""
        s = self.scorer
        tokens, stable, n_frames, fed_at = [replace(t) for t in self.tokens], self.stable, s.n_frames, self.fed_at
        kept = min(s.length, len(self.context) + len(self.tokens) - 1)  # where this preview starts feeding
        try:
            s.add_frames(frames)
            if s.n_frames:
                self._decode(final=False, recheck=False)  # no refresh: it would re-feed positions before `kept`
            return [t.id for t in self.tokens]
        finally:
            self.tokens, self.stable, self.fed_at = tokens, stable, fed_at
            s.truncate(kept)
            s.drop_frames(n_frames)

    def redecode(self) -> None:
        """Decode the whole item again from its context over every frame it has (the `decoder` final pass):
        each position, the context's too, is fed again, so it sees the item's whole audio instead of the blocks
        heard when it was first fed."""
        self.tokens.clear()
        self.stable = 0
        self.scorer.truncate(0)
        if self.scorer.n_frames:
            self._decode(final=True)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.max_tokens
