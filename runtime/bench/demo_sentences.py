"""The shipped demo speech as a voice client sends it: cut into its sentences at the pauses, each sentence in
100 ms chunks of base64 24 kHz PCM16 (the Realtime API's input format), encoded once, up front.

Why a module of its own: `bench serve --conversations` and `bench serve --url` speak these sentences through the
openai SDK, and the abrupt-disconnect sessions (serve_disconnects.py) through a raw websocket; all of them must
send the same bytes. How the cuts are found, and why they are where Silero VAD puts the speech's ends, is in
serve_conversations.py's docstring (`tests/test_bench_serve_conversations.py` checks it).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np

from runtime.chunks import SAMPLE_RATE
from runtime.io.sample import demo_speech

RATE = 24_000  # the API's PCM16
CHUNK_MS = 100
CHUNK_S = CHUNK_MS / 1000
CHUNK_16K = SAMPLE_RATE * CHUNK_MS // 1000
CHUNK_24K = RATE * CHUNK_MS // 1000
QUIET_RMS = 1e-3  # a 20 ms frame quieter than this is a pause in the demo speech (espeak-ng writes zeros)
QUIET_FRAME = SAMPLE_RATE // 50
MIN_PAUSE_S = 0.25


@dataclass(frozen=True)
class Sentence:
    """One sentence of the demo speech, ready to send: 100 ms chunks of base64 24 kHz PCM16."""

    chunks: list[str]
    speech_end_chunk: int  # the chunk holding the last speech sample
    start_s: float  # where the clip starts in the demo speech
    speech_end_s: float  # where its speech ends in the demo speech
    samples: np.ndarray = field(repr=False)  # the clip at 16 kHz, zero-padded to whole chunks


def pcm24k(samples16k: np.ndarray) -> bytes:
    """16 kHz float audio as 24 kHz PCM16 little-endian (linear interpolation)."""
    t = np.arange(round(len(samples16k) * RATE / SAMPLE_RATE)) / RATE
    resampled = np.interp(t, np.arange(len(samples16k)) / SAMPLE_RATE, samples16k)
    return (np.clip(resampled, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()


def sentences(speech: np.ndarray | None = None) -> list[Sentence]:
    """The demo speech cut at its pauses: runs of >= MIN_PAUSE_S whose 20 ms RMS is under QUIET_RMS."""
    speech = demo_speech() if speech is None else speech
    frames = len(speech) // QUIET_FRAME
    rms = np.sqrt(np.mean(speech[: frames * QUIET_FRAME].reshape(frames, QUIET_FRAME) ** 2, axis=1))
    loud = np.flatnonzero(rms >= QUIET_RMS)
    if not len(loud):
        raise RuntimeError("the demo speech has no speech in it")
    # pauses between loud frames: (end of speech, start of the next speech) in samples
    gaps = [(int(a + 1) * QUIET_FRAME, int(b) * QUIET_FRAME) for a, b in zip(loud[:-1], loud[1:], strict=True)
            if (b - a - 1) * QUIET_FRAME >= MIN_PAUSE_S * SAMPLE_RATE]
    ends = [end for end, _ in gaps] + [int(loud[-1] + 1) * QUIET_FRAME]
    starts = [0] + [(end + nxt) // 2 for end, nxt in gaps]
    out = []
    for start, end in zip(starts, ends, strict=True):
        clip = speech[start:end]
        clip = np.concatenate([clip, np.zeros(-len(clip) % CHUNK_16K, np.float32)])
        raw = pcm24k(clip)
        step = CHUNK_24K * 2
        chunks = [base64.b64encode(raw[i : i + step]).decode() for i in range(0, len(raw), step)]
        out.append(Sentence(chunks, (end - start - 1) // CHUNK_16K, start / SAMPLE_RATE, end / SAMPLE_RATE, clip))
    return out


# 100 ms of digital silence, as a chunk
SILENCE = base64.b64encode(bytes(CHUNK_24K * 2)).decode()
