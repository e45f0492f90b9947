"""Cut audio of any block size into fixed-size, sample-accurate chunks.

Decoders, devices and network peers deliver audio in whatever block sizes they like (1024-sample AAC frames,
10 ms ALSA periods, 20 ms Opus packets). The pipeline wants chunks of one fixed length whose positions are
sample indices, so media time never drifts however the stream was cut.
"""

from __future__ import annotations

import numpy as np

from runtime.chunks import AudioChunk


def to_mono_float32(samples: np.ndarray, *, channels_last: bool = False) -> np.ndarray:
    """Mono float32 in [-1, 1] from 1-D or 2-D audio of any numeric dtype.

    2-D input is (channels, samples), as PyAV's planar frames are; pass `channels_last=True` for
    (samples, channels) as soundfile returns. Integer PCM is scaled by its full range; channels are averaged.
    """
    array = np.asarray(samples)
    if array.ndim == 2:
        array = array.mean(axis=1 if channels_last else 0, dtype=np.float64)
    elif array.ndim != 1:
        raise ValueError(f"audio must be 1-D or 2-D, got shape {array.shape}")
    if np.issubdtype(array.dtype, np.integer):
        info = np.iinfo(array.dtype)
        half = float(-info.min) if info.min < 0 else (info.max + 1) / 2  # unsigned PCM centres on half
        offset = 0.0 if info.min < 0 else half
        return ((array.astype(np.float64) - offset) / half).astype(np.float32)
    return array.astype(np.float32, copy=False)


class AudioRechunker:
    """Accumulates float32 mono samples and returns chunks of exactly `chunk_samples`, numbered from
    `start_sample` on; `flush()` returns the final partial chunk. Output arrays never alias the input.

    `short_by`: a remainder that many samples short of a chunk, or less, is returned at once as a chunk of its own
    (0: never). For live audio that passed a resampler: it holds back the few samples its filter looks ahead at
    (`audio_formats.MAX_HELD_SAMPLES`), so a client's 100 ms message decodes to 17 samples short of a 100 ms chunk,
    and without this the chunk would wait for the next message: 100 ms added to every turn's end."""

    def __init__(self, chunk_samples: int, start_sample: int = 0, *, short_by: int = 0) -> None:
        if chunk_samples <= 0:
            raise ValueError(f"chunk_samples must be > 0, got {chunk_samples}")
        if start_sample < 0:
            raise ValueError(f"start_sample must be >= 0, got {start_sample}")
        if not 0 <= short_by < chunk_samples:
            raise ValueError(f"short_by must be in [0, {chunk_samples}), got {short_by}")
        self.short_by = short_by
        self.chunk_samples = chunk_samples
        self.next_sample = start_sample  # index of the first sample not yet returned in a chunk
        self._pending: list[np.ndarray] = []
        self._pending_len = 0

    @property
    def pending(self) -> int:
        """Samples held back, waiting for a full chunk."""
        return self._pending_len

    def push(self, samples: np.ndarray) -> list[AudioChunk]:
        array = np.asarray(samples, dtype=np.float32)
        if array.ndim != 1:
            raise ValueError(f"push expects 1-D mono samples, got shape {array.shape}")
        if len(array) == 0:
            return []
        self._pending.append(array.copy())
        self._pending_len += len(array)
        if self._pending_len < self.chunk_samples - self.short_by:
            return []
        buffer = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        full = len(buffer) // self.chunk_samples * self.chunk_samples
        chunks = [self._chunk(buffer[i : i + self.chunk_samples]) for i in range(0, full, self.chunk_samples)]
        rest = buffer[full:]
        if self.short_by and len(rest) >= self.chunk_samples - self.short_by:
            chunks.append(self._chunk(rest.copy()))
            rest = rest[:0]
        self._pending = [rest.copy()] if len(rest) else []
        self._pending_len = len(rest)
        return chunks

    def flush(self) -> list[AudioChunk]:
        if not self._pending_len:
            return []
        buffer = np.concatenate(self._pending)
        self._pending, self._pending_len = [], 0
        return [self._chunk(buffer)]

    def _chunk(self, samples: np.ndarray) -> AudioChunk:
        chunk = AudioChunk(samples=samples, start_sample=self.next_sample)
        self.next_sample += len(samples)
        return chunk
