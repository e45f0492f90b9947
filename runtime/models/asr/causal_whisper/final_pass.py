"""The second pass of causal streaming Whisper: when an item ends at a commit (the end of a turn or of the
input), its text is decoded once more with everything the item heard, and that is the item's final transcript.

The block-causal stream decides each token with only the audio heard so far, so its words are shown within
the chunk plus a few hundred ms; the second pass costs one decode per item and fixes what only later audio
settles (two-pass streaming ASR, as U2/WeNet's attention rescoring or Google's two-pass decoders do). Captions
show the first pass as it streams; the completed event carries the second, which may revise it.

- `decoder`: the item's own decoder reads all of its block-causal encoder frames at once and decodes the item
  again from its context (cheap: decoder steps only; the encoder frames and their cross-attention K/V exist).
- `offline`: the base checkpoint (without the streaming adapter) decodes the item's audio with full context: the
  offline ceiling, for one encoder pass and one decode per item. Padded to 30 s as Whisper was trained, or
  (`asr.final_pass_window_s`) to its own windows with silence's encoder states after them (`whisper_window.py`).

An item that the stream heard no words in stays empty (Whisper given silence says "Thank you."), and an item
completed by a 30 s cache reset keeps its first pass (its audio was cut mid-stream; only the item a commit
ends is decoded again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.emission import ItemDecoder

FINAL_PASSES = ("none", "decoder", "offline")


class Hypothesis(Protocol):
    """A full-context Whisper decoder: greedy transcript ids of some audio (`whisper_buffered.WhisperBuffered`)."""

    def hypothesis(self, audio: np.ndarray, forced: Sequence[int] = ()) -> list[int]: ...


class FinalPass(Protocol):
    name: str

    def revise(self, item: ItemDecoder, audio: np.ndarray) -> list[int]:
        """The item's final token ids, given its decoder state after the last block and the audio it covers."""
        ...


class DecoderPass:
    name = "decoder"

    def revise(self, item: ItemDecoder, audio: np.ndarray) -> list[int]:
        item.redecode()
        return [t.id for t in item.tokens]


class OfflinePass:
    name = "offline"

    def __init__(self, offline: Hypothesis) -> None:
        self.offline = offline

    def revise(self, item: ItemDecoder, audio: np.ndarray) -> list[int]:
        return self.offline.hypothesis(audio)


def check(kind: str) -> str:
    if kind not in FINAL_PASSES:
        raise ConfigError(f"asr.final_pass={kind!r} is not one of {', '.join(FINAL_PASSES)}")
    return kind
