"""Log-mel features as NeMo's `AudioToMelSpectrogramPreprocessor` computes them, but exactly incremental.

NeMo's featurizer (`FilterbankFeatures`): pre-emphasis 0.97 (y[0] = x[0]), `torch.stft(center=True,
pad_mode="constant")` with a symmetric Hann window of `window_size` (400 samples) zero-padded to `n_fft` (512),
power spectrum, slaney mel filterbank, `log(x + 2**-24)`, then optional normalisation. Frame t is centred on
sample t * hop, so its non-zero window covers samples [t * hop - 200, t * hop + 200): every frame depends on
a fixed, finite span of audio and nothing else. That makes the offline features *causal with 12.5 ms
latency*: a stream can emit frame t as soon as sample t * hop + 199 has arrived and get exactly the
offline value; at the end the stream zero-pads like `center=True` does, giving the same N // hop + 1 frames.
No approximation is needed for checkpoint compatibility, so this keeps NeMo's window alignment.

Normalisation: cache-aware checkpoints are trained with `normalize: "NA"` ("no normalization for
mel-spectrogram makes streaming easier", NeMo's streaming configs). `per_feature`/`all_features` need the
whole utterance's statistics and are refused by the loader; NeMo's fixed form (`{fixed_mean, fixed_std}`,
per mel bin) is causal and supported.

Features are computed on CPU in float64 whatever the model's device and dtype: the work is tiny, and it
makes every frame bitwise independent of how the audio was cut (batched FFT rows are computed alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers.audio_utils import mel_filter_bank


@dataclass(frozen=True)
class FeatureConfig:
    sample_rate: int = 16_000
    features: int = 80
    window_size: int = 400  # samples (25 ms)
    window_stride: int = 160  # samples (10 ms)
    n_fft: int = 512
    preemph: float | None = 0.97
    lowfreq: float = 0.0
    highfreq: float | None = None
    log_zero_guard: float = 2**-24
    fixed_mean: tuple[float, ...] | None = None  # NeMo's normalize={fixed_mean, fixed_std}; None = "NA"
    fixed_std: tuple[float, ...] | None = None


class MelFeaturizer(nn.Module):
    """NeMo's `preprocessor.featurizer`: buffers `window` [win] and `fb` [1, mels, n_fft // 2 + 1] under
    NeMo's names, so a checkpoint's own filterbank is used when it ships one."""

    def __init__(self, cfg: FeatureConfig) -> None:
        super().__init__()
        if cfg.window_size > cfg.n_fft:
            raise ValueError(f"window_size {cfg.window_size} exceeds n_fft {cfg.n_fft}")
        self.cfg = cfg
        self.register_buffer("window", torch.hann_window(cfg.window_size, periodic=False))
        fb = mel_filter_bank(
            num_frequency_bins=cfg.n_fft // 2 + 1,
            num_mel_filters=cfg.features,
            min_frequency=cfg.lowfreq,
            max_frequency=cfg.highfreq or cfg.sample_rate / 2,
            sampling_rate=cfg.sample_rate,
            norm="slaney",
            mel_scale="slaney",
        )
        self.register_buffer("fb", torch.tensor(fb.T, dtype=torch.float32).unsqueeze(0))

    @property
    def hop(self) -> int:
        return self.cfg.window_stride

    @property
    def first_offset(self) -> int:
        """Sample index (may be negative) of frame 0's first windowed sample under `center=True`."""
        return -(self.cfg.n_fft // 2) + (self.cfg.n_fft - self.cfg.window_size) // 2

    def preemphasis(self, x: np.ndarray, previous: float) -> np.ndarray:
        """Float64 pre-emphasised samples; `previous` is the raw sample before `x` (0.0 at the start, which
        gives NeMo's y[0] = x[0])."""
        x = x.astype(np.float64)
        if self.cfg.preemph is None:
            return x
        shifted = np.empty_like(x)
        if len(x):
            shifted[0] = previous
            shifted[1:] = x[:-1]
        return x - self.cfg.preemph * shifted

    def logmel(self, frames: torch.Tensor) -> torch.Tensor:
        """[n, window_size] float64 pre-emphasised samples -> [n, features] float32 log-mel."""
        window = self.window.detach().to("cpu", torch.float64)
        fb = self.fb.detach().to("cpu", torch.float64)[0]
        spec = torch.fft.rfft(frames * window, n=self.cfg.n_fft)  # |X|^2 ignores the window's offset in n_fft
        power = spec.real.square() + spec.imag.square()
        mel = torch.log(power @ fb.T + self.cfg.log_zero_guard)
        if self.cfg.fixed_mean is not None and self.cfg.fixed_std is not None:
            mean = torch.tensor(self.cfg.fixed_mean, dtype=torch.float64)
            std = torch.tensor(self.cfg.fixed_std, dtype=torch.float64)
            mel = (mel - mean) / std
        return mel.to(torch.float32)

    def num_frames(self, num_samples: int) -> int:
        """NeMo's feature count for `num_samples` of audio (center=True): N // hop + 1."""
        return num_samples // self.hop + 1

    @torch.no_grad()
    def forward(self, audio: np.ndarray) -> torch.Tensor:
        """Offline: all N // hop + 1 frames [T, features] of a whole 1-D float32 signal."""
        pre = self.preemphasis(np.asarray(audio, dtype=np.float32), 0.0)
        count = self.num_frames(len(pre))
        left = -self.first_offset
        right = max(0, (count - 1) * self.hop + self.first_offset + self.cfg.window_size - len(pre))
        padded = torch.from_numpy(np.concatenate([np.zeros(left), pre, np.zeros(right)]))
        frames = padded.unfold(0, self.cfg.window_size, self.hop)[:count]
        return self.logmel(frames)


class FeatureStream:
    """Incremental `MelFeaturizer.forward`: `accept` returns the frames whose window is complete; `finish`
    zero-pads the end as `center=True` does. Holds at most one window of samples."""

    def __init__(self, featurizer: MelFeaturizer) -> None:
        self.featurizer = featurizer
        self._buf = np.zeros(-featurizer.first_offset)  # pre-emphasised samples from index _buf_start
        self._buf_start = featurizer.first_offset
        self._previous = 0.0  # last raw sample, for pre-emphasis
        self._received = 0
        self._next = 0  # next frame index

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def _frames(self, end_frame: int) -> torch.Tensor:
        """Frames [_next, end_frame) from the buffer, then drop the samples no later frame needs."""
        f = self.featurizer
        count = end_frame - self._next
        if count <= 0:
            return torch.zeros(0, f.cfg.features)
        offset = self._next * f.hop + f.first_offset - self._buf_start
        span = self._buf[offset : offset + (count - 1) * f.hop + f.cfg.window_size]
        frames = torch.from_numpy(np.ascontiguousarray(span)).unfold(0, f.cfg.window_size, f.hop)
        out = f.logmel(frames)
        self._next = end_frame
        drop = self._next * f.hop + f.first_offset - self._buf_start
        if drop > 0:
            self._buf = self._buf[drop:]
            self._buf_start += drop
        return out

    def accept(self, samples: np.ndarray) -> torch.Tensor:
        if len(samples):
            self._buf = np.concatenate([self._buf, self.featurizer.preemphasis(samples, self._previous)])
            self._previous = float(samples[-1])
            self._received += len(samples)
        f = self.featurizer
        complete = self._received - f.first_offset - f.cfg.window_size  # last start whose window is in
        return self._frames(complete // f.hop + 1 if complete >= 0 else 0)

    def finish(self) -> torch.Tensor:
        f = self.featurizer
        end = f.num_frames(self._received)
        needed = (end - 1) * f.hop + f.first_offset + f.cfg.window_size - (self._buf_start + len(self._buf))
        if needed > 0:
            self._buf = np.concatenate([self._buf, np.zeros(needed)])
        return self._frames(end)
