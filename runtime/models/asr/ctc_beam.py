"""CTC prefix beam search with a word language model, frame-synchronous so it streams.

Why not greedy: greedy CTC takes each frame's argmax, so a word the model half-hears comes out half-spelt.
The beam keeps the `beam` most likely transcripts (summing every CTC path that spells them: CTC prefix
beam search, as in Hannun et al. 2014) and scores each completed word with a word n-gram
(`word_lm.WordLM`): ranking = ln P_ctc(text) + `lm_weight` * ln P_lm(words) + `word_bonus` * words. A word
outside the LM's vocabulary costs `oov_penalty` on top of the LM's <unk> probability; while a word is still
being spelt, the best unigram of any vocabulary word it could become stands in for it (a look-ahead that
only steers pruning).

Why here and not a library: the stream must say which words are final. Every future hypothesis extends one
of the beams alive now, so the words all beams agree on are final the moment they agree: that is the
stable text; the best beam's remaining words are the unstable tail. Pruning hypotheses more than
`beam_prune` nats behind the best makes them agree sooner. pyctcdecode has no incremental API and
flashlight's decoder exposes only its best hypothesis while decoding, so neither can give that guarantee.

Agreement alone has no deadline: two readings of an early word ("a red" / "a read") that every later frame
extends alike stay within the margin for as long as the utterance lasts, and the whole sentence waits with
them. So a word the leading hypothesis has kept unchanged for `commit_frames` frames is committed: the
hypotheses that disagree with it are dropped, and it is stable from then on (0 = agreement only).

Hypotheses are keyed by their text (completed words + the word being spelt) and their last CTC label, so
paths that spell the same text merge whatever pieces spelt it. Words every hypothesis shares are retired
from the keys as soon as they are shared (only the LM's history keeps the last few), so a frame costs the
same an hour into a pause-less item as in its first second.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from runtime.models.asr.word_lm import BOS, EOS, WordLM

NEG_INF = float("-inf")
WORD_START = "\u2581"  # SentencePiece's word-boundary mark
CACHE_ENTRIES = 200_000  # memoised (history, word) LM scores kept before the memo is cleared


@dataclass(frozen=True)
class BeamOptions:
    """The defaults are `asr.*`'s, chosen on a development set (docs/training_fastconformer.md)."""

    beam: int = 32
    lm_weight: float = 0.5
    word_bonus: float = 1.0
    oov_penalty: float = 20.0
    token_prune: float = 8.0  # only labels within this many nats of the frame's best are tried
    beam_prune: float = 10.0  # hypotheses this many nats behind the best are dropped (so words turn stable sooner)
    commit_frames: int = 0  # a word the best hypothesis has held this many frames is final (0: only on agreement)


Key = tuple[tuple[str, ...], str | None, int]  # (completed words, word being spelt or None, last label)


def _logadd(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    return max(a, b) + math.log1p(math.exp(-abs(a - b)))


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CONTROL_PIECE = re.compile(r"<[^>]*>")


class Pieces:
    """What each CTC label writes: whether it starts a word, and its characters.

    `pieces[i]` is label i's vocabulary entry ('▁' marks a word start). Control pieces (`<unk>`, `<s>`)
    write nothing; a byte piece writes its character when it is ASCII (a multi-byte UTF-8 character split
    across byte pieces is dropped: the beam scores words, and such a word is out of any English lexicon).
    """

    def __init__(self, pieces: list[str], blank: int):
        if not 0 <= blank <= len(pieces):
            raise ValueError(f"blank label {blank} is outside the {len(pieces)} pieces")
        pieces = list(pieces) + [""] * (blank + 1 - len(pieces))
        self.blank = blank
        self.starts_word = [p.startswith(WORD_START) for p in pieces]
        self.chars = [_chars(p) if i != blank else "" for i, p in enumerate(pieces)]


def _chars(piece: str) -> str:
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte:
        code = int(byte.group(1), 16)
        return chr(code) if 32 < code < 128 else ""
    if _CONTROL_PIECE.fullmatch(piece):
        return ""
    return piece.lstrip(WORD_START)


class WordScorer:
    """LM scores of completed words and the look-ahead of partial ones, memoised (the beam asks repeatedly)."""

    def __init__(self, lm: WordLM | None, opts: BeamOptions):
        self.lm = lm
        self.opts = opts
        self._best_completion: dict[str, float] = {}
        if lm is not None:
            for word in lm.vocabulary:
                score = lm.logp((), word)
                for end in range(1, len(word) + 1):
                    prefix = word[:end]
                    if score > self._best_completion.get(prefix, NEG_INF):
                        self._best_completion[prefix] = score
        self._cache: dict[tuple[tuple[str, ...], str], float] = {}
        self.history_words = lm.order - 1 if lm is not None else 0  # words before a word its LM score depends on

    def word(self, words: tuple[str, ...], word: str) -> float:
        """Weighted LM score of `word` completing after `words`, with the word bonus and any OOV penalty."""
        if self.lm is None:
            return self.opts.word_bonus if word != EOS else 0.0
        history = (BOS, *words)[-(self.lm.order - 1) :] if self.lm.order > 1 else ()
        score = self._cache.get((history, word))
        if score is None:
            score = self.opts.lm_weight * self.lm.logp(history, word)
            if word != EOS:
                score += self.opts.word_bonus
                if word not in self.lm.vocabulary:
                    score -= self.opts.oov_penalty
            if len(self._cache) >= CACHE_ENTRIES:  # bounded: an hour of speech must not grow it forever
                self._cache.clear()
            self._cache[(history, word)] = score
        return score

    def partial(self, spelt: str | None) -> float:
        """Look-ahead for a word still being spelt: its best possible unigram, or the OOV cost if none fits."""
        if self.lm is None or not spelt:
            return 0.0
        best = self._best_completion.get(spelt)
        if best is None:
            return self.opts.lm_weight * self.lm.unk_logp - self.opts.oov_penalty
        return self.opts.lm_weight * best


class CTCBeamSearch:
    """One utterance's live hypotheses; `advance` takes frames as they come, `finish` picks the transcript."""

    def __init__(self, pieces: Pieces, scorer: WordScorer):
        self.pieces = pieces
        self.scorer = scorer
        self.opts = scorer.opts
        self._beams: dict[Key, tuple[float, float, float]] = {}
        self.reset()

    def reset(self) -> None:
        """Start a new utterance (the LM history starts again at <s>)."""
        self._beams = {((), None, -1): (0.0, NEG_INF, 0.0)}  # key -> (ln P ending in blank, in a label, LM)
        self._retired: list[str] = []  # leading words every hypothesis shared, taken out of the keys: final
        self._frame = 0
        self._leader: tuple[str, ...] = ()  # the best hypothesis' completed words after the last frame
        self._held_since: list[int] = []  # frame from which the leader has had each of those words unchanged
        self._committed = 0  # how many leading words every hypothesis now shares by commitment

    def advance(self, logprobs: np.ndarray) -> None:
        """Consume frames of CTC log-probabilities, [T, V]."""
        for row in np.asarray(logprobs, dtype=np.float64):
            self._step(row)
            self._frame += 1
            if self.opts.commit_frames > 0:
                self._commit_held_words()
            self._retire_shared_words()

    def _retire_shared_words(self) -> None:
        shared = self._shared()
        if not shared:
            return
        n = len(shared)
        self._retired += shared
        self._beams = {(k[0][n:], k[1], k[2]): v for k, v in self._beams.items()}  # still unique: all shared
        self._leader, self._held_since = self._leader[n:], self._held_since[n:]
        self._committed = max(0, self._committed - n)

    def _shared(self) -> tuple[str, ...]:
        """The leading completed words all live hypotheses have in common."""
        keys = iter(self._beams)
        common = next(keys)[0]
        for words, _, _ in keys:
            n = 0
            while n < len(common) and n < len(words) and common[n] == words[n]:
                n += 1
            common = common[:n]
        return common

    def _history(self, words: tuple[str, ...]) -> tuple[str, ...]:
        """`words` with as many retired words before them as the LM's history needs."""
        keep = self.scorer.history_words
        return (*self._retired[-keep:], *words) if keep and self._retired else words

    def _commit_held_words(self) -> None:
        """Drop every hypothesis that disagrees with the words the leader has held for `commit_frames` frames."""
        words = next(iter(self._beams))[0]  # `_step` leaves the hypotheses best first
        kept = 0
        while kept < min(len(words), len(self._leader)) and words[kept] == self._leader[kept]:
            kept += 1
        self._held_since = self._held_since[:kept] + [self._frame] * (len(words) - kept)
        self._leader = words
        old = self._frame - self.opts.commit_frames
        n = 0  # held_since never decreases along the words, so the committed ones are a prefix
        while n < len(words) and self._held_since[n] <= old:
            n += 1
        if n > self._committed:  # hypotheses born later extend survivors, so they share the committed words
            committed, self._committed = words[:n], n
            self._beams = {k: v for k, v in self._beams.items() if k[0][:n] == committed}

    def _step(self, lp: np.ndarray) -> None:
        blank, starts_word, chars = self.pieces.blank, self.pieces.starts_word, self.pieces.chars
        labels = [int(c) for c in np.flatnonzero(lp >= lp.max() - self.opts.token_prune) if c != blank]
        p_blank = float(lp[blank])
        nxt: dict[Key, list[float]] = {}
        for key, (pb, pnb, lm) in self._beams.items():
            words, spelt, last = key
            total = _logadd(pb, pnb)
            same = nxt.setdefault(key, [NEG_INF, NEG_INF, lm])
            same[0] = _logadd(same[0], total + p_blank)
            if last >= 0:  # the last label again, collapsed: the text does not change
                same[1] = _logadd(same[1], pnb + float(lp[last]))
            for c in labels:
                p = (pb if c == last else total) + float(lp[c])  # a repeat is a new label only after a blank
                if starts_word[c]:
                    new_words, new_lm = (words + (spelt,), lm + self.scorer.word(self._history(words), spelt)) \
                        if spelt else (words, lm)
                    new_key = (new_words, chars[c], c)
                else:
                    new_lm = lm
                    new_key = (words, (spelt or "") + chars[c], c)
                entry = nxt.get(new_key)
                if entry is None:
                    nxt[new_key] = [NEG_INF, p, new_lm]
                else:
                    entry[1] = _logadd(entry[1], p)
        # By score alone: tied scores must not fall through to comparing keys (None and str do not order).
        ranked = sorted(((self._rank(k, v), k) for k, v in nxt.items()), key=lambda rk: rk[0], reverse=True)
        floor = ranked[0][0] - self.opts.beam_prune
        self._beams = {k: tuple(nxt[k]) for score, k in ranked[: self.opts.beam] if score >= floor}  # type: ignore

    def _rank(self, key: Key, entry: list[float] | tuple[float, float, float]) -> float:
        return _logadd(entry[0], entry[1]) + entry[2] + self.scorer.partial(key[1])

    def stable_words(self) -> tuple[str, ...]:
        """Words every live hypothesis has completed identically: no later frame can change them."""
        return (*self._retired, *self._shared())

    def unstable_words(self) -> tuple[str, ...]:
        """The leading hypothesis' words beyond the stable ones (without copying the retired words: per chunk)."""
        key = max(self._beams, key=lambda k: self._rank(k, self._beams[k]))
        return (*key[0], *((key[1],) if key[1] else ()))[len(self._shared()) :]

    def best_words(self) -> tuple[str, ...]:
        """The leading hypothesis as it stands, its word being spelt included."""
        key = max(self._beams, key=lambda k: self._rank(k, self._beams[k]))
        return (*self._retired, *key[0], *((key[1],) if key[1] else ()))

    def finish(self) -> tuple[str, ...]:
        """The utterance's transcript (the last word and </s> scored), then reset for the next one.

        Hypotheses that end as the same words (spelt by different last labels) are one transcript: their
        CTC probabilities add up before the best is picked."""
        acoustic: dict[tuple[str, ...], float] = {}
        language: dict[tuple[str, ...], float] = {}
        for (words, spelt, _), (pb, pnb, lm) in self._beams.items():
            if spelt:
                lm += self.scorer.word(self._history(words), spelt)
                words = words + (spelt,)
            acoustic[words] = _logadd(acoustic.get(words, NEG_INF), _logadd(pb, pnb))
            language[words] = lm + self.scorer.word(self._history(words), EOS)
        retired = tuple(self._retired)
        self.reset()
        return retired + max(acoustic, key=lambda words: acoustic[words] + language[words])
