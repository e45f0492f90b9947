"""The data side of CTC training: utterances from a manifest or a folder, log-mels computed once and normalised
with the training set's own statistics, length buckets, and the per-step randomness (which bucket, the step's
generator that augment.py draws from) as pure functions of (seed, step), which is what makes `--resume` exact.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import ConfigError
from runtime.models.asr.fastconformer.features import FeatureConfig, MelFeaturizer
from runtime.train.data import load_audio, load_examples
from runtime.train.text_norm import normalize

MAX_BATCH = 64  # utterances per batch, whatever their length


@dataclass
class Utterance:
    audio: Path
    text: str  # normalised
    features: torch.Tensor | None = None  # [T, mels] float32, normalised once stats are known


def _manifest(path: Path) -> list[Utterance]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            out.append(Utterance(path.parent / entry["audio"], normalize(entry["text"])))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{path}:{n}: not a manifest entry with 'audio' and 'text' ({err})") from None
    return out


def load_split(data: Path, split: str) -> list[Utterance]:
    """`split` ("train" | "heldout") of a dataset folder; [] for a held-out set that is not there."""
    if (data / f"{split}.jsonl").is_file():
        return _manifest(data / f"{split}.jsonl")
    folder = data / split
    if not folder.is_dir():
        if split == "heldout":
            return []
        if (data / "heldout.jsonl").is_file() or (data / "heldout").is_dir():
            raise ConfigError(f"{data} has a held-out set but no train.jsonl or train/ folder")
        folder = data
    return [Utterance(e.path, normalize(e.text)) for e in load_examples(folder)]


def compute_features(utts: list[Utterance], featurizer: MelFeaturizer, desc: str, quiet: bool) -> None:
    """Fill `features` (raw log-mels) of each utterance: once, so steps only move tensors."""
    from tqdm import tqdm

    for u in tqdm(utts, desc=f"features {desc}", unit="utt", file=sys.stderr, disable=quiet or None):
        u.features = featurizer(load_audio(u.audio))


def feature_stats(utts: list[Utterance]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-bin mean and std over every training frame (float64 sums, so the order of utterances is immaterial)."""
    total = sum(u.features.shape[0] for u in utts)  # type: ignore[union-attr]
    s = sum(u.features.double().sum(0) for u in utts)  # type: ignore[union-attr]
    s2 = sum(u.features.double().square().sum(0) for u in utts)  # type: ignore[union-attr]
    mean = s / total
    std = (s2 / total - mean.square()).clamp_min(1e-8).sqrt()
    return tuple(round(float(v), 6) for v in mean), tuple(round(float(v), 6) for v in std)


def normalise_features(utts: list[Utterance], cfg: FeatureConfig) -> None:
    if cfg.fixed_mean is None or cfg.fixed_std is None:
        return
    mean = torch.tensor(cfg.fixed_mean, dtype=torch.float64)
    std = torch.tensor(cfg.fixed_std, dtype=torch.float64)
    for u in utts:
        u.features = ((u.features.double() - mean) / std).float()  # type: ignore[union-attr]


def encoder_frames(feature_frames: int, subsampling_factor: int) -> int:
    """NeMo's calc_length for causal dw_striding: floor(T / 2) + 1 per stride-2 stage."""
    for _ in range(int(math.log2(subsampling_factor))):
        feature_frames = feature_frames // 2 + 1
    return feature_frames


def make_batches(lengths: list[int], max_frames: int) -> list[list[int]]:
    """Buckets: utterances sorted by length, cut so that (longest x count) <= max_frames (and <= MAX_BATCH)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (lengths[i] * (len(current) + 1) > max_frames or len(current) >= MAX_BATCH):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def shortest_pool(step: int, n_batches: int, fraction: float, hold: int, grow: int) -> int:
    """Short clips first: how many of the shortest buckets step `step` may draw from. CTC leaves the blank and
    unigram plateau it starts on within a few hundred steps on short clips, and not in thousands on the whole
    set (measured in docs/training_fastconformer.md), so the first `hold` steps see only the shortest
    `fraction` of the buckets, and the pool then grows linearly to all of them over `grow` steps."""
    if fraction >= 1.0 or step >= hold + grow:
        return n_batches
    share = fraction + (1.0 - fraction) * max(0, step - hold) / max(1, grow)
    return max(1, min(n_batches, int(n_batches * share)))


def batch_for_step(step: int, n_batches: int, seed: int, pool: int | None = None) -> int:
    """Which bucket step `step` trains on. With `pool` < n_batches (the curriculum): a uniform draw among the
    first `pool` buckets, which `make_batches` sorted shortest first. Otherwise consecutive entries of per-epoch
    permutations seeded by (seed, epoch). Either way a pure function of its arguments."""
    if pool is not None and pool < n_batches:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 7 * step + 1)
        return int(torch.randint(0, pool, (1,), generator=gen))
    epoch, pos = divmod(step, n_batches)
    order = torch.randperm(n_batches, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return int(order[pos])


def step_generator(seed: int, step: int) -> torch.Generator:
    """The step's own randomness (look-ahead, masks): independent of what ran before, so resume is exact."""
    return torch.Generator().manual_seed((seed * 7_919 + 17) * 1_000_003 + step)


def collate(feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T_max, mels] zero-padded (zeros are also what the offline forward pads with) and [B] lengths."""
    lengths = torch.tensor([f.shape[0] for f in feats])
    out = feats[0].new_zeros(len(feats), int(lengths.max()), feats[0].shape[1])
    for i, f in enumerate(feats):
        out[i, : f.shape[0]] = f
    return out, lengths
