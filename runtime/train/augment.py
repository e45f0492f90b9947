"""Training-time augmentation of normalised log-mel batches: SpecAugment, a voice warp and a tempo stretch.

Why a voice warp: a speaker's vocal tract length moves every formant by roughly one factor, so stretching the
frequency axis by a random factor per utterance (vocal tract length perturbation, Jaitly and Hinton 2013)
turns each training voice into a family of voices. It runs on the log-mels the step already holds: the
spectrum at frequency f is read from f / alpha, interpolated between the neighbouring filters' centres, in the
un-normalised log domain so every bin keeps its own statistics. It is off by default: on the demo data unseen
espeak-ng voices turned out not to be what the model lacked, and it did not lower the held-out error
(docs/training_fastconformer.md, "Where the held-out error comes from").

Why a tempo stretch: the synthesisers' rate settings bound how slow or fast the training speech is, and a
voice outside that range fails badly (flite's held-out rms speaks about a fifth slower than awb; stretching its
features by 1.15 raised the demo model's CER on it from 29.5 to 32.5 %, compressing them by 0.85 lowered it to
27.6). Resampling each utterance's frames in time makes it slower or faster with its pitch and formants kept,
which the waveform speed perturbation cannot do, and with fresh factors every epoch. Off by default: 8,000
steps with it (0.25) did not lower the demo model's rms error (docs/training_fastconformer.md).

All three draw only from the step's own generator, so resume stays exact.
"""

from __future__ import annotations

import math

import torch

from runtime.models.asr.fastconformer.features import MelFeaturizer


def spec_augment(x: torch.Tensor, lengths: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Two frequency masks (<= 15 bins) and one time mask per 1.5 s (<= 5 % of the utterance, <= 40 frames)
    per utterance, filled with 0 (the normalised mean). Cheap: index ranges, no copies per mask."""
    x = x.clone()
    mels = x.shape[2]
    for b in range(x.shape[0]):
        n = int(lengths[b])
        for _ in range(2):
            w = int(torch.randint(0, 16, (1,), generator=gen))
            f0 = int(torch.randint(0, max(1, mels - w), (1,), generator=gen))
            x[b, :n, f0 : f0 + w] = 0.0
        width = max(1, min(40, n // 20))
        for _ in range(n // 150 + 1):
            w = int(torch.randint(0, width + 1, (1,), generator=gen))
            t0 = int(torch.randint(0, max(1, n - w), (1,), generator=gen))
            x[b, t0 : t0 + w] = 0.0
    return x


def filter_centres_hz(featurizer: MelFeaturizer) -> torch.Tensor:
    """[mels] centre of mass of each mel filter, in Hz: where a warp has to move each bin's energy."""
    fb = featurizer.fb[0].double()  # [mels, n_fft // 2 + 1]
    hz = torch.linspace(0.0, featurizer.cfg.sample_rate / 2, fb.shape[1], dtype=torch.float64)
    return (fb * hz).sum(1) / fb.sum(1).clamp_min(1e-12)


class VoiceWarp:
    """Per utterance, alpha drawn log-uniformly from [1 / (1 + max_warp), 1 + max_warp]; alpha > 1 moves
    formants up (a shorter vocal tract), alpha < 1 down. Bins whose source falls outside the filterbank take
    the nearest filter's value."""

    def __init__(self, featurizer: MelFeaturizer, mean: tuple[float, ...], std: tuple[float, ...],
                 max_warp: float) -> None:
        if not 0.0 <= max_warp < 1.0:
            raise ValueError(f"max_warp must be in [0, 1), got {max_warp}")
        self.centres = filter_centres_hz(featurizer).float()
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.max_warp = max_warp

    def source_index(self, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each output bin: the two source bins and the weight of the upper one (linear in Hz)."""
        c = self.centres
        src = (c / alpha).clamp(float(c[0]), float(c[-1]))
        hi = torch.searchsorted(c, src).clamp(1, len(c) - 1)
        lo = hi - 1
        w = ((src - c[lo]) / (c[hi] - c[lo])).clamp(0.0, 1.0)
        return lo, hi, w

    def warp(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """[T, mels] normalised log-mels of one utterance, warped by `alpha`."""
        lo, hi, w = self.source_index(alpha)
        raw = x * self.std + self.mean
        return (raw[:, lo] * (1 - w) + raw[:, hi] * w - self.mean) / self.std

    def draw(self, n: int, gen: torch.Generator) -> list[float]:
        span = math.log1p(self.max_warp)
        return torch.exp((torch.rand(n, generator=gen) * 2 - 1) * span).tolist()

    def __call__(self, x: torch.Tensor, lengths: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """[B, T, mels] normalised log-mels, [B] lengths -> the same, each utterance warped by its own alpha.
        Padded frames stay zero."""
        if self.max_warp == 0.0:
            return x
        out = torch.zeros_like(x)
        for b, alpha in enumerate(self.draw(x.shape[0], gen)):
            n = int(lengths[b])
            out[b, :n] = self.warp(x[b, :n], alpha)
        return out


def tempo_stretch(x: torch.Tensor, lengths: torch.Tensor, gen: torch.Generator,
                  max_stretch: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, mels] normalised log-mels, [B] lengths -> the batch re-padded and its new lengths, each
    utterance's frames linearly interpolated to `round(n * r)` frames, r drawn log-uniformly from
    [1 / (1 + max_stretch), 1 + max_stretch] (r > 1: slower). Interpolating normalised features equals
    interpolating the log-mels: the normalisation is affine per bin."""
    if not 0.0 <= max_stretch < 1.0:
        raise ValueError(f"max_stretch must be in [0, 1), got {max_stretch}")
    if max_stretch == 0.0:
        return x, lengths
    span = math.log1p(max_stretch)
    rates = torch.exp((torch.rand(x.shape[0], generator=gen) * 2 - 1) * span)
    pieces = []
    for b in range(x.shape[0]):
        n = int(lengths[b])
        m = max(1, round(n * float(rates[b])))
        utt = x[b, :n].T.unsqueeze(0)  # [1, mels, n]
        pieces.append(torch.nn.functional.interpolate(utt, size=m, mode="linear", align_corners=True)[0].T
                      if n > 1 else x[b, :n].expand(m, -1))
    new_lengths = torch.tensor([p.shape[0] for p in pieces])
    out = x.new_zeros(x.shape[0], int(new_lengths.max()), x.shape[2])
    for b, p in enumerate(pieces):
        out[b, : p.shape[0]] = p
    return out, new_lengths
