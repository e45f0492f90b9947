"""Greedy decoding that checks a draft transcript: the `offline` final pass, drafted by the stream's own words.

By the time a turn ends, the causal stream has already written down what it heard; the final pass then decodes
the same audio with full context, one decoder call per token (tiny.en in bfloat16: about 9 ms a call on one core,
two thirds of the pass). Where the two agree, which on human speech is most words, those calls are wasted: one
call over the stream's next tokens scores them all, and each is the greedy choice exactly when it is the argmax
after the ones before it (speculative decoding with the stream as the drafter: Leviathan et al. 2023, greedy
case). The first disagreement gives the greedy token itself, so every call emits at least one token, and the
result is the greedy transcript whatever the draft: a bad draft costs time, never words. (Up to the arithmetic:
scoring tokens together rounds differently from one at a time, which in bfloat16 can tip a near tie.)

The next guess continues the draft from where the transcript so far last matches it (the longest of its last 3,
2 or 1 tokens found in the draft, nearest to the same position), as prompt-lookup decoding copies from a prompt:
after the pass inserts, drops or changes a word, the draft is picked up again at the following one. Where nothing
matches (a changed word, or its capital), the guess goes on as if that token had replaced the draft's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MAX_GUESS = 4  # draft tokens checked per call: fewest decoder time on the quick sets (4 against 8 or 16)
MATCH = (3, 2, 1)  # the transcript's last n tokens looked up in the draft, longest first


def follow(out: Sequence[int], draft: Sequence[int], at: int) -> int:
    """Where in `draft` the transcript `out` goes on: after the occurrence of `out`'s longest matching tail nearest to
    position len(out), else at `at` (where the last guess left off)."""
    for n in MATCH:
        if len(out) < n:
            continue
        tail = list(out[-n:])
        ends = [j + n for j in range(len(draft) - n + 1) if list(draft[j : j + n]) == tail]
        if ends:
            return min(ends, key=lambda end: (abs(end - len(out)), end))
    return at


def greedy(score: Callable[[list[int], int], torch.Tensor], drop: Callable[[int], None], prompt: Sequence[int],
           forced: Sequence[int], *, eos: int, max_tokens: int, draft: Sequence[int] = ()) -> list[int]:
    """Greedy transcript ids after `prompt` + `forced` (no eos), at most `max_tokens` in all, checking `draft`.

    `score(ids, rows)` feeds `ids` after everything fed before (a KV cache) and returns the next-token logits
    [rows, vocab] after each of the last `rows`; `drop(n)` takes the last n fed tokens back out of the cache."""
    out = list(forced)
    pending = [*prompt, *out]  # fed at the next call: not yet in the cache
    at = len(out)  # the draft position that the end of `out` stands for
    while len(out) < max_tokens:
        start = follow(out, draft, at)
        ahead = list(draft[start : start + min(max_tokens - len(out), MAX_GUESS)])
        if eos in ahead:
            ahead = ahead[: ahead.index(eos)]
        picks = score(pending + ahead, len(ahead) + 1).argmax(-1).tolist()
        kept = next((i for i, token in enumerate(ahead) if picks[i] != token), len(ahead))
        out += ahead[:kept]
        if kept < len(ahead):
            drop(len(ahead) - kept)
        token = picks[kept]
        if len(out) >= max_tokens or token == eos:
            break
        out.append(token)
        pending = [token]
        at = start + kept + 1  # the token took the place of the draft's next one: the commonest change
    return out
