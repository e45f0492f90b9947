"""The voice's samples as a client takes them: the Realtime API's output formats, encoded as a stream.

Formats (GA `session.audio.output.format`, the same `AudioFormat`s as the input side in
`runtime/io/audio_formats.py`): `audio/pcm` at 24 kHz (PCM16 little-endian mono; 16 kHz is this runtime's
extension), `audio/pcmu` and `audio/pcma` (G.711 mu-law / A-law, 8 kHz, one byte a sample).

Resampling is PyAV's (FFmpeg's libswresample), already a dependency. G.711 is numpy (`g711.py`): FFmpeg's encoders
round to the nearest level and so leave the standard's decision levels on about 1% of input values, and `audioop`,
which had a standard one, is gone from Python 3.13. The tests check the G.711 bytes against an independent
implementation of the standard over every 16-bit value.

Why a stream with state, as on the input side: an answer is synthesised clause by clause, and a resampler started
afresh for each clause would restart its filter (a ramp at every clause boundary) and round each clause's length
on its own, so the audio's clock would drift from its sample count. One resampler kept for the whole response gives
the same samples, and the same count, as one call on the whole answer; `flush()` at the end returns the few
samples its look-ahead still holds.
"""

from __future__ import annotations

import av
import numpy as np

from runtime.io.audio_formats import DEFAULT_FORMAT, G711_CODECS, PCM, PCMU, AudioFormat
from runtime.models.tts.g711 import alaw_encode, ulaw_encode
from runtime.models.tts.voice import to_int16


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """A whole clip, float32 mono, from `rate_in` to `rate_out` (band-limited, libswresample), clipped to [-1, 1]."""
    stream = _Resampler(rate_in, rate_out)
    return np.concatenate([stream.push(samples), stream.flush()])


class _Resampler:
    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.rate_in, self.rate_out = rate_in, rate_out
        self._resampler: av.AudioResampler | None = None

    def push(self, samples: np.ndarray) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if self.rate_in == self.rate_out or not len(samples):
            return np.clip(samples, -1.0, 1.0)
        if self._resampler is None:
            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=self.rate_out)
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = self.rate_in
        return _joined(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        if self._resampler is None:
            return np.zeros(0, dtype=np.float32)
        resampler, self._resampler = self._resampler, None  # a flushed PyAV resampler takes no more input
        return _joined(resampler.resample(None))


def _joined(frames: list[av.AudioFrame]) -> np.ndarray:
    if not frames:
        return np.zeros(0, dtype=np.float32)
    samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames])
    return np.clip(samples, -1.0, 1.0).astype(np.float32, copy=False)  # the filter overshoots full-scale input


def g711_encode(pcm: np.ndarray, fmt_type: str) -> bytes:
    """16-bit samples -> G.711 bytes of `fmt_type` (audio/pcmu or audio/pcma), one byte a sample."""
    if fmt_type not in G711_CODECS:
        raise ValueError(f"not a G.711 format: {fmt_type!r}")
    return ulaw_encode(pcm) if fmt_type == PCMU else alaw_encode(pcm)


class AudioEncoder:
    """One response's audio: float32 samples at the voice's rate in, bytes of `fmt` out.

    `encode(samples)` returns the bytes those samples complete (the resampler holds back a few for its
    look-ahead); `flush()` returns the rest at the end of the response, after which the encoder starts afresh.
    """

    def __init__(self, fmt: AudioFormat = DEFAULT_FORMAT, voice_rate: int = 22050) -> None:
        self.format = fmt
        self.voice_rate = voice_rate
        self._resampler = _Resampler(voice_rate, fmt.rate)
        self.samples_out = 0  # at fmt.rate: the audio's clock (audio_end_ms of a truncation counts on it)

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.format.type == PCM else 1

    def encode(self, samples: np.ndarray) -> bytes:
        return self._bytes(self._resampler.push(samples))

    def flush(self) -> bytes:
        return self._bytes(self._resampler.flush())

    def _bytes(self, samples: np.ndarray) -> bytes:
        self.samples_out += len(samples)
        pcm = to_int16(samples)
        if self.format.type == PCM:
            return pcm.astype("<i2", copy=False).tobytes()
        return g711_encode(pcm, self.format.type)
