"""The buffered peer's stream policy: LocalAgreement-2 over a growing buffer, re-decoded whole.

This is the peer policy (whisper_streaming) that the causal streaming backends must beat: every `step_s`
of new audio the whole buffer is re-encoded (padded to 30 s) and greedily re-decoded; the longest common
token prefix of the last two hypotheses becomes stable. Stable tokens are forced as the decoder prefix of
every later hypothesis, so stable text is never contradicted and the completed transcript always starts
with everything already emitted. At `segment_s` (or at the end of input) the item is completed and the
buffer cut. Its cost grows with the buffer, which is exactly what the causal backends avoid.

The policy only needs a `Decoder` (a hypothesis for some audio, text for ids), so it is tested over stubs; the
model that decodes for it, `whisper_buffered.WhisperBuffered`, opens one stream per session (`open_stream`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.events import new_id
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.asr.whisper_language import Speech


class Decoder(Protocol):
    """What the stream needs from a model: a hypothesis for some audio, and text for token ids."""

    def hypothesis(self, audio: np.ndarray, forced: Sequence[int] = (), previous: Sequence[int] = ()) -> list[int]:
        ...

    def text(self, ids: Sequence[int]) -> str: ...

    def context_ids(self, previous: str, vocabulary: str = "") -> list[int]:
        """The previous-text tokens of the turns before and the user's vocabulary."""
        ...


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _settled(text: str) -> str:
    """Hold back a trailing U+FFFD: an incomplete UTF-8 character that the next token may complete."""
    return text.rstrip("\ufffd")


class WhisperBufferedStream:
    """One session's buffer and LocalAgreement-2 state. Decode points fall at exact sample positions
    (every `step_s` of item audio, completion at `segment_s`), so the result does not depend on how the
    source cut its chunks."""

    def __init__(self, decoder: Decoder, *, step_s: float, segment_s: float) -> None:
        self._decoder = decoder
        self._previous: list[int] = []  # previous-text tokens (set_context)
        self._speech: Speech | None = None  # set_speech's; None: the model's own
        self._step = max(1, round(step_s * SAMPLE_RATE))
        self._segment = max(1, round(segment_s * SAMPLE_RATE))
        self._next_sample: int | None = None  # where the next chunk must start
        self._item_start = 0  # sample index of the open item's first sample
        self._state = "open"
        self._new_item()

    def _new_item(self) -> None:
        self._item_id = new_id("item")
        self._pieces: list[np.ndarray] = []
        self._buffered = 0  # samples in the open item
        self._since_decode = 0
        self._hyp: list[int] | None = None
        self._stable: list[int] = []
        self._emitted = ""  # text of the stable tokens already sent as deltas

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        if self._state != "open":
            raise RuntimeError(f"ASR stream is {self._state}; it accepts no more audio")
        if self._next_sample is None:
            self._next_sample = self._item_start = chunk.start_sample
        elif chunk.start_sample != self._next_sample:
            kind = "gap" if chunk.start_sample > self._next_sample else "overlap"
            raise ValueError(
                f"audio chunk starts at sample {chunk.start_sample}, expected {self._next_sample} ({kind})"
            )
        updates: list[TranscriptUpdate] = []
        samples, pos = chunk.samples, 0
        while pos < len(samples):
            take = min(len(samples) - pos, self._segment - self._buffered, self._step - self._since_decode)
            self._pieces.append(samples[pos : pos + take])
            pos += take
            self._buffered += take
            self._since_decode += take
            self._next_sample += take
            if self._buffered >= self._segment:
                updates.append(self._complete())
            elif self._since_decode >= self._step:
                updates.append(self._agree())
        return updates

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        """The turns before and the user's vocabulary as every hypothesis's previous text (before the first chunk)."""
        if self._next_sample is not None or self._state != "open":
            raise RuntimeError("set_context must come before the stream's first chunk")
        self._previous = self._decoder.context_ids(previous, vocabulary)

    def set_speech(self, speech: Speech) -> None:
        """The language spoken (`DETECT`: each hypothesis detects it) and the task, before the first chunk; a
        language or task the model cannot do is a ConfigError here."""
        if self._next_sample is not None or self._state != "open":
            raise RuntimeError("set_speech must come before the stream's first chunk")
        check = getattr(self._decoder, "prompt_for", None)
        if check is not None:
            check(Speech(speech.language or "en", speech.task))  # a language to detect: any of the model's
        self._speech = speech

    def finish(self) -> list[TranscriptUpdate]:
        if self._state != "open":
            return []
        self._state = "finished"
        return [self._complete()] if self._buffered else []

    def close(self) -> None:
        self._state = "closed"
        self._pieces = []
        self._hyp = None
        self._stable = []

    def _decode(self) -> list[int]:
        audio = np.concatenate(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
        self._pieces = [audio]
        self._since_decode = 0
        if self._speech is None:
            return self._decoder.hypothesis(audio, self._stable, self._previous)
        return self._decoder.hypothesis(audio, self._stable, self._previous, speech=self._speech)

    def _times(self) -> tuple[float, float]:
        return self._item_start / SAMPLE_RATE, (self._item_start + self._buffered) / SAMPLE_RATE

    def _agree(self) -> TranscriptUpdate:
        previous, hyp = self._hyp, self._decode()
        self._hyp = hyp
        if previous is not None:
            n = common_prefix(previous, hyp)
            if n > len(self._stable):
                self._stable = hyp[:n]
        stable_text = _settled(self._decoder.text(self._stable))
        delta = stable_text[len(self._emitted) :] if stable_text.startswith(self._emitted) else ""
        self._emitted += delta
        full = self._decoder.text(hyp)
        unstable = full[len(self._emitted) :] if full.startswith(self._emitted) else ""
        start, end = self._times()
        return TranscriptUpdate(self._item_id, delta, unstable, start, end)

    def _complete(self) -> TranscriptUpdate:
        hyp = self._hyp if self._hyp is not None and self._since_decode == 0 else self._decode()
        text = self._decoder.text(hyp)
        # `hyp` starts with the stable tokens, so `text` starts with what was emitted; keep it so if not.
        transcript = text if text.startswith(self._emitted) else self._emitted
        start, end = self._times()
        update = TranscriptUpdate(
            self._item_id, transcript[len(self._emitted) :], "", start, end, completed=True, transcript=transcript
        )
        self._item_start += self._buffered
        self._new_item()
        return update
