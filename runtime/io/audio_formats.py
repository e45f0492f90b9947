"""The OpenAI Realtime API's input audio formats, decoded as a stream to what the models take: float32 mono
16 kHz in [-1, 1].

Formats (GA `session.audio.input.format`): `{"type": "audio/pcm", "rate": 24000}` (PCM16 little-endian mono),
`{"type": "audio/pcmu"}` and `{"type": "audio/pcma"}` (G.711 mu-law / A-law, 8 kHz mono, one byte a sample).
`"rate": 16000` is this runtime's own extension: it is the models' rate, so it decodes with plain numpy and no
resampler at all. The Realtime beta's strings ("pcm16" = 24 kHz PCM, "g711_ulaw", "g711_alaw") are accepted too,
so older clients keep working.

Why the decoder keeps state: a client cuts its stream into `input_audio_buffer.append` messages wherever it
likes, and a resampler's output sample depends on input samples on both sides of it (its filter is about 32
input samples wide). A resampler started afresh for each message would restart its filter at every cut:
each message would begin and end with a ramp (a click at every message boundary) and its length would be
rounded on its own, so the rounding errors add up and media time drifts. One `AudioResampler` kept for the
whole stream gives, cut anywhere, the very samples (and the same count) as one call on the whole stream;
`flush()` at the end of the stream returns the few samples it still holds.

Latency (measured with PyAV 18.1 and FFmpeg's libswresample defaults; output samples at 16 kHz): the
resampler holds back the half of its filter that looks ahead.
- 24 kHz PCM: 16-17 samples (about 1.05 ms) in steady state; `flush()` returns 17. Nothing comes out before
  the first 50 input samples (2.1 ms) have arrived, so a stream that opens with smaller messages than that
  waits for at most 34 samples (2.1 ms), once.
- G.711 (8 kHz): 32 samples (2 ms, 16 input bytes) in steady state; `flush()` returns 32. Nothing comes out
  before the first 32 bytes (4 ms), so the most ever held is 64 samples (4 ms), once, at the start.
- 16 kHz PCM: none.
A 20 ms message (480 samples at 24 kHz, 160 bytes of G.711) is well past the start-up, so in practice only the
steady-state figure applies. G.711 decoding itself holds nothing back (one byte is one sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np

from runtime.chunks import SAMPLE_RATE

# the most samples (at 16 kHz) a decoder here holds back at once: G.711's start-up (above); what the websocket's
# rechunker sends without waiting for (rechunk.AudioRechunker's `short_by`)
MAX_HELD_SAMPLES = 64

PCM = "audio/pcm"
PCMU = "audio/pcmu"
PCMA = "audio/pcma"
G711_RATE = 8000
PCM_RATES = (24000, SAMPLE_RATE)  # 24000 is the API's; 16000 is this runtime's extension (no resampling)
G711_CODECS = {PCMU: "pcm_mulaw", PCMA: "pcm_alaw"}

ALLOWED = (
    '{"type": "audio/pcm", "rate": 24000} (or "rate": 16000), {"type": "audio/pcmu"}, {"type": "audio/pcma"}, '
    'or the beta strings "pcm16" (24 kHz), "g711_ulaw", "g711_alaw"'
)


@dataclass(frozen=True)
class AudioFormat:
    """One input audio format; checked on construction, so a decoder is never built for one it cannot read."""

    type: str
    rate: int

    def __post_init__(self) -> None:
        if self.type == PCM and self.rate in PCM_RATES:
            return
        if self.type in G711_CODECS and self.rate == G711_RATE:
            return
        raise ValueError(f"unsupported audio format {self.type!r} at {self.rate} Hz; allowed: {ALLOWED}")

    def to_dict(self) -> dict[str, str | int]:
        """The API's JSON shape: G.711's rate is fixed by the standard, so the API never writes it."""
        if self.type == PCM:
            return {"type": self.type, "rate": self.rate}
        return {"type": self.type}


DEFAULT_FORMAT = AudioFormat(PCM, 24000)
BETA_FORMATS = {
    "pcm16": DEFAULT_FORMAT,
    "g711_ulaw": AudioFormat(PCMU, G711_RATE),
    "g711_alaw": AudioFormat(PCMA, G711_RATE),
}


def parse_audio_format(value: object, param: str) -> AudioFormat:
    """A client's format field -> AudioFormat; ValueError with one line naming `param` and the allowed values.

    The SDK's types make `rate` optional (it is "always 24000" for PCM), so a missing rate means 24000; a
    G.711 format may repeat its fixed rate (8000) but not change it.
    """
    if isinstance(value, AudioFormat):
        return value
    if isinstance(value, str) and value in BETA_FORMATS:
        return BETA_FORMATS[value]
    if isinstance(value, dict) and set(value) <= {"type", "rate"}:
        kind, rate = value.get("type"), value.get("rate")
        default = DEFAULT_FORMAT.rate if kind == PCM else G711_RATE
        if rate is None:
            rate = default
        valid_rate = isinstance(rate, int) and not isinstance(rate, bool)
        if kind == PCM and valid_rate and rate in PCM_RATES:
            return AudioFormat(PCM, rate)
        if kind in G711_CODECS and valid_rate and rate == G711_RATE:
            return AudioFormat(kind, G711_RATE)
    shown = " ".join(repr(value).split())
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise ValueError(f"{param} must be {ALLOWED}; got {shown}")


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


class AudioDecoder:
    """One stream's decoder (one per session): raw bytes of `fmt` in, float32 mono 16 kHz out.

    Creating one costs microseconds: the G.711 codec and the resampler are made on first use (the resampler's
    filter graph is configured on its first frame, about 0.3 ms, once).
    """

    def __init__(self, fmt: AudioFormat = DEFAULT_FORMAT) -> None:
        self.format = fmt
        self._codec: av.AudioCodecContext | None = None
        self._resampler: av.AudioResampler | None = None

    def decode(self, raw: bytes | bytearray | memoryview) -> np.ndarray:
        """The samples `raw` completes; the resampler's look-ahead ones arrive with later calls or `flush()`.

        PCM16 messages must hold whole samples (the API's rule): an odd byte count raises ValueError rather
        than carrying half a sample over, since it means the client's framing is broken.
        """
        raw = bytes(raw)
        if self.format.type == PCM and len(raw) % 2:
            raise ValueError(f"PCM16 audio has an odd number of bytes ({len(raw)})")
        if not raw:  # and an empty av.Packet would drain the G.711 decoder for good
            return _empty()
        if self.format.type == PCM:
            samples = np.frombuffer(raw, dtype="<i2")
            if self.format.rate == SAMPLE_RATE:
                return samples.astype(np.float32) / np.float32(32768.0)
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = self.format.rate
            frames = [frame]
        else:
            frames = self._g711().decode(av.Packet(raw))
        return self._resample(frames)

    def flush(self) -> np.ndarray:
        """The samples the resampler still holds, at the end of the stream.

        A flushed PyAV resampler cannot take more input, so this also ends the stream: a later `decode` starts
        a new one with a fresh resampler (and its start-up hold-back again).
        """
        if self._resampler is None:
            return _empty()
        resampler, self._resampler = self._resampler, None
        return _samples(resampler.resample(None))

    def _g711(self) -> av.AudioCodecContext:
        if self._codec is None:
            codec = av.CodecContext.create(G711_CODECS[self.format.type], "r")
            codec.sample_rate = G711_RATE
            codec.layout = "mono"
            self._codec = codec
        return self._codec

    def _resample(self, frames: list[av.AudioFrame]) -> np.ndarray:
        if self._resampler is None:
            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        resampler = self._resampler
        return _samples([out for frame in frames for out in resampler.resample(frame)])


def _samples(frames: list[av.AudioFrame]) -> np.ndarray:
    """Frames -> one float32 array, clipped: the resampler's filter overshoots (Gibbs) on full-scale input,
    and the models are promised [-1, 1]."""
    if not frames:
        return _empty()
    samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames])
    return np.clip(samples, -1.0, 1.0).astype(np.float32, copy=False)
