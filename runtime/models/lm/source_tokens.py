"""A growing text's token ids, re-tokenising only the changed tail where the tokenizer is seen to re-synchronise.

The language engine's source is a transcript that grows and is revised many times a second; tokenising all of it
each time costs more than the prefill it feeds (`engine.py` keeps the KV cache up to the first changed id).
"""

from __future__ import annotations

import bisect

from transformers import PreTrainedTokenizerBase


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings, by binary search over C-level comparisons."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


class SourceTokens:
    """A growing text's token ids, re-tokenising only the tail that changed.

    Tokenising a whole hour of transcript costs ~70 ms, too much per ASR update. Instead the text from a token
    `margin` tokens before the first changed character is re-tokenised and spliced on, provided its first
    tokens reproduce the old ones there (the tokenizer has re-synchronised: for regex pre-tokenizers with
    byte-level BPE it always has once a pre-token boundary is shared); otherwise the whole text is
    re-tokenised, so the ids always equal a full tokenisation in every case the check can see."""

    margin, check = 8, 4

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.ids: list[int] = []
        self.starts: list[int] = []  # character offset of each token
        self.full_encodes = 0

    def _encode(self, text: str, offset: int = 0) -> tuple[list[int], list[int]]:
        if not self.tokenizer.is_fast:  # no offsets: every update re-tokenises the whole text
            ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            return ids, [offset] * len(ids)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return enc["input_ids"], [offset + s for s, _ in enc["offset_mapping"]]

    def update(self, text: str) -> int | None:
        """Make `ids` those of `text`; returns how many leading ids are unchanged (None: text unchanged)."""
        if text == self.text:
            return None
        first = bisect.bisect_left(self.starts, common_prefix(self.text, text))  # first token at/after the edit
        k = first - self.margin
        while k > 0 and self.starts[k] == self.starts[k - 1]:  # start on a character boundary
            k -= 1
        if k > 0 and self.tokenizer.is_fast:
            ids, starts = self._encode(text[self.starts[k] :], self.starts[k])
            n = self.check
            if ids[:n] == self.ids[k : k + n] and starts[:n] == self.starts[k : k + n]:
                self.ids, self.starts, self.text = self.ids[:k] + ids, self.starts[:k] + starts, text
                return k
        self.ids, self.starts = self._encode(text)
        self.text = text
        self.full_encodes += 1
        return 0
