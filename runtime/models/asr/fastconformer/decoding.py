"""The open item's text as CTC frames arrive: greedy, or a beam search with a word LM (`asr.decoder`).

The stream (asr.py) decides where items start and end from the frames' argmax labels, the same rule for
both decoders, so both cut the audio at the same places; these classes only say what the item's frames
spell. `stable()` is text that no later frame can change, `unstable()` the tail that may still change, and
`finish()` the item's final text, which always starts with the last `stable()`.

- `GreedyText`: each frame's argmax, repeats collapsed, blanks dropped. Every token is final at once.
- `BeamText`: `ctc_beam.CTCBeamSearch` over the item's frames; the words all live hypotheses agree on (or
  the leading one has kept for `asr.commit_after_s`) are stable, the leading hypothesis' other words the
  unstable tail.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import numpy as np

from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.ctc_beam import BeamOptions, CTCBeamSearch, Pieces, WordScorer
from runtime.models.asr.fastconformer.tokenizer import CTCTokenizer
from runtime.models.asr.word_lm import WordLM

DECODERS = ("greedy", "beam")
LM_FILE = "lm.arpa"  # a checkpoint directory's own word LM, used by `asr.decoder = "beam"` unless `asr.lm` names one


class ItemText(Protocol):
    def push(self, label: int, logprobs: np.ndarray) -> None:
        """One frame: its argmax label and its CTC log-probabilities [V]."""
        ...

    def stable(self) -> str: ...

    def unstable(self) -> str: ...

    def finish(self) -> str:
        """The item's final text; the next frame starts a new item."""
        ...


class GreedyText:
    def __init__(self, tokenizer: CTCTokenizer, blank: int) -> None:
        self._tokenizer = tokenizer
        self._blank = blank
        self._previous: int | None = None  # repeats collapse across chunks (and items: they end on blanks)
        self._tokens: list[int] = []

    def push(self, label: int, logprobs: np.ndarray) -> None:
        if label != self._blank and label != self._previous:
            self._tokens.append(label)
        self._previous = label

    def stable(self) -> str:
        return self._tokenizer.decode(self._tokens).rstrip("\ufffd")  # a byte piece may complete later

    def unstable(self) -> str:
        return ""

    def finish(self) -> str:
        text = self._tokenizer.decode(self._tokens)
        self._tokens = []
        return text


class BeamText:
    def __init__(self, search: CTCBeamSearch) -> None:
        self._search = search

    def push(self, label: int, logprobs: np.ndarray) -> None:
        self._search.advance(logprobs[None])

    def stable(self) -> str:
        return " ".join(self._search.stable_words())

    def unstable(self) -> str:
        return " ".join(self._search.unstable_words())

    def finish(self) -> str:
        return " ".join(self._search.finish())


class BeamParts:
    """What every `BeamText` of one loaded model shares: the pieces, the LM and its memoised scores."""

    def __init__(self, tokenizer: CTCTokenizer, blank: int, lm: WordLM | None, cfg: ASRConfig,
                 frame_s: float) -> None:
        self.pieces = Pieces(tokenizer.pieces(), blank)
        self.options = BeamOptions(beam=cfg.beam, lm_weight=cfg.lm_weight, word_bonus=cfg.word_bonus,
                                   oov_penalty=cfg.oov_penalty,
                                   commit_frames=math.ceil(cfg.commit_after_s / frame_s - 1e-9))
        self.lm = lm
        self.scorer = WordScorer(lm, self.options)

    def open(self) -> BeamText:
        return BeamText(CTCBeamSearch(self.pieces, self.scorer))


def find_word_lm(cfg: ASRConfig, checkpoint: Path) -> WordLM | None:
    """The beam's word LM: `asr.lm`, else the checkpoint directory's lm.arpa, else none (a plain beam)."""
    if cfg.lm:
        path = Path(cfg.lm).expanduser()
        if not path.is_file():
            raise ConfigError(f"asr.lm={cfg.lm!r}: no such file (an ARPA word n-gram, see `runtime train word-lm`)")
    else:
        path = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / LM_FILE
        if not path.is_file():
            return None
    try:
        return WordLM.load_arpa(path)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"asr word LM {path}: {err}") from None
