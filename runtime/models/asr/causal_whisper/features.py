"""A causal log-mel front end for streaming Whisper, exact between chunked and offline computation.

Whisper's extractor (n_fft 400, hop 160, Slaney mel filters, log10) is not causal in two places:
it centres every frame with reflect padding (frame k reads 200 samples into the future), and it floors the
dynamic range at `log_spec.max() - 8` over the whole 30 s window (the first frame depends on the last).
This module keeps Whisper's filters, window and `(x + 4) / 4` scaling and changes only those two:

- Frames are left-aligned with a fixed left context: frame k reads samples [160k - 240, 160k + 160), zeros
  before the stream starts. A frame is complete as soon as its own 10 ms hop has arrived (no look-ahead),
  there are ceil(N / 160) frames for N samples (3000 for 30 s, as Whisper), and each frame sits only
  40 samples (2.5 ms) earlier than Whisper's centred one, so the model's sense of time barely moves.
- The floor is `running_max - 8`, where the running max is the largest log-mel value of this frame and
  every earlier one, seeded with `init_max` (default 0.0). A fixed floor would ignore loudness entirely,
  while a pure running max would leave digital silence at the start of a stream at log10(1e-10) = -10, far
  below the `max - 8` (about -7 for ordinary speech) that Whisper gives it; the seed caps the floor at -8
  until louder audio arrives, after which the floor tracks the loudest audio so far exactly like Whisper's
  (which, for speech, is reached within the first words). Training must use the same `init_max`.

Everything is computed per frame in float64 (numpy's FFT works row by row, the max is exact) and cast to
float32 once, so any chunking gives the same frames as `log_mel` over the whole signal.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import window_function

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160  # samples per mel frame: 10 ms
LEFT = N_FFT - HOP  # left context of a frame beyond its own hop: zeros at stream start
DYNAMIC_RANGE = 8.0  # log10 units (80 dB) below the (running) max, as Whisper
INIT_MAX = 0.0  # seed of the running max: the floor is never below INIT_MAX - DYNAMIC_RANGE
LOG_FLOOR = 1e-10  # mel power clamp before log10, as Whisper


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> np.ndarray:
    """Whisper's Slaney mel filter bank [201, n_mels] (float64) for 80 or 128 bins."""
    return WhisperFeatureExtractor(feature_size=n_mels).mel_filters


@lru_cache(maxsize=1)
def _window() -> np.ndarray:
    return window_function(N_FFT, "hann")  # periodic Hann, float64, as Whisper


def mel_frames_for(n_samples: int) -> int:
    """Mel frames produced by `n_samples` samples once flushed: ceil(n / HOP)."""
    return -(-n_samples // HOP)


def _log_power(buf: np.ndarray, n: int, n_mels: int) -> np.ndarray:
    """log10 mel power [n, n_mels] (float64) of the frames starting at buf[0], buf[HOP], ..."""
    frames = np.lib.stride_tricks.sliding_window_view(buf, N_FFT)[: (n - 1) * HOP + 1 : HOP]
    spec = np.fft.rfft(frames * _window(), axis=-1)
    power = spec.real**2 + spec.imag**2
    return np.log10(np.maximum(power @ mel_filters(n_mels), LOG_FLOOR))


def _normalise(log_spec: np.ndarray, running_max: float) -> tuple[torch.Tensor, float]:
    """Causal floor and Whisper's scaling: ([n_mels, n] float32, the running max after the last frame)."""
    peaks = np.maximum.accumulate(np.concatenate([[running_max], log_spec.max(axis=1)]))[1:]
    out = (np.maximum(log_spec, peaks[:, None] - DYNAMIC_RANGE) + 4.0) / 4.0
    return torch.from_numpy(np.ascontiguousarray(out.T, dtype=np.float32)), float(peaks[-1])


def _as_samples(samples: np.ndarray) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
        raise ValueError(f"audio must be 1-D float samples at {SAMPLE_RATE} Hz, got {samples.dtype} {samples.shape}")
    return samples.astype(np.float64)


def log_mel(samples: np.ndarray, n_mels: int = 80, *, init_max: float = INIT_MAX) -> torch.Tensor:
    """Offline causal log-mel [n_mels, ceil(N / 160)] of a whole signal: the concatenation of what
    `StreamingLogMel` emits for it under any chunking (the last partial hop is zero-padded, as at flush)."""
    x = _as_samples(samples)
    n = mel_frames_for(len(x))
    if n == 0:
        return torch.empty(n_mels, 0)
    buf = np.concatenate([np.zeros(LEFT), x, np.zeros(n * HOP - len(x))])
    return _normalise(_log_power(buf, n, n_mels), init_max)[0]


class StreamingLogMel:
    """Causal log-mel of one audio stream: each frame is emitted by the call that completes its hop.

    `accept(samples)` -> [n_mels, new_frames] float32 (possibly 0 frames); `flush()` at the end of input
    emits the last partial hop zero-padded (if any samples are pending) and closes the stream. Holds at most
    LEFT + HOP - 1 samples between calls, so every call costs only its own frames.
    """

    def __init__(self, n_mels: int = 80, *, init_max: float = INIT_MAX) -> None:
        self.n_mels = n_mels
        self._buf = np.zeros(LEFT)  # samples not yet consumed, preceded by LEFT samples of context
        self._max = init_max
        self.samples_seen = 0
        self.frames_done = 0
        self.closed = False

    def _emit(self, n: int) -> torch.Tensor:
        if n == 0:
            return torch.empty(self.n_mels, 0)
        out, self._max = _normalise(_log_power(self._buf, n, self.n_mels), self._max)
        self._buf = self._buf[n * HOP :].copy()
        self.frames_done += n
        return out

    def accept(self, samples: np.ndarray) -> torch.Tensor:
        """Feed samples (1-D float, 16 kHz); returns the mel frames [n_mels, k] they complete."""
        if self.closed:
            raise RuntimeError("StreamingLogMel.accept after flush: open a new stream")
        x = _as_samples(samples)
        self.samples_seen += len(x)
        self._buf = np.concatenate([self._buf, x])
        return self._emit((len(self._buf) - LEFT) // HOP)

    def peek(self, samples: np.ndarray) -> torch.Tensor:
        """The frames [n_mels, k] that `accept(samples)` would return, leaving the stream as it is (a preview)."""
        if self.closed:
            raise RuntimeError("StreamingLogMel.peek after flush")
        buf = np.concatenate([self._buf, _as_samples(samples)])
        n = (len(buf) - LEFT) // HOP
        if n == 0:
            return torch.empty(self.n_mels, 0)
        return _normalise(_log_power(buf, n, self.n_mels), self._max)[0]

    def flush(self) -> torch.Tensor:
        """End of input: the last partial frame (zero-padded on the right), then the stream is closed."""
        if self.closed:
            raise RuntimeError("StreamingLogMel.flush called twice")
        self.closed = True
        pending = len(self._buf) - LEFT
        if pending == 0:
            return torch.empty(self.n_mels, 0)
        self._buf = np.concatenate([self._buf, np.zeros(HOP - pending)])
        return self._emit(1)
