"""What `runtime train fastconformer` can be told: the model presets, the run's settings and their flags.

Kept apart from the training loop (`fastconformer.py`) so that the loop reads top-down as the recipe, and the
flags, with their help and defaults, read as one list.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from typing import Any

from runtime.errors import ConfigError

# Model sizes and the optimiser settings that go with them. `small` is the shipped demo model: 4 x 176 at 4x
# subsampling (40 ms encoder steps) with 128 tokens, 3.04 M parameters, 12.2 MB as float32 safetensors; small
# batches (24 s of padded audio) for many updates. `tiny` exists for tests.
PRESETS: dict[str, dict[str, Any]] = {
    "small": {"subsampling": 4, "d_model": 176, "n_layers": 4, "n_heads": 4, "ff_expansion": 3,
              "sub_channels": 128, "conv_kernel": 9, "vocab": 128, "lr": 2e-3, "warmup": 100, "batch_seconds": 24.0},
    "tiny": {"subsampling": 8, "d_model": 64, "n_layers": 2, "n_heads": 4, "ff_expansion": 2,
             "sub_channels": 32, "conv_kernel": 9, "vocab": 32, "lr": 3e-3, "warmup": 5, "batch_seconds": 24.0},
}
SIZE_KEYS = ("subsampling", "d_model", "n_layers", "n_heads", "ff_expansion", "sub_channels", "conv_kernel",
             "vocab", "lr", "warmup", "batch_seconds")
DEFAULT_STEPS = 33000  # the shipped run: about 85 min on 2 CPU cores at 0.155 s/step


@dataclass(frozen=True)
class TrainConfig:
    data: str
    out: str
    preset: str = "small"
    subsampling: int = 4
    d_model: int = 176
    n_layers: int = 4
    n_heads: int = 4
    ff_expansion: int = 3
    sub_channels: int = 128
    conv_kernel: int = 9
    vocab: int = 128
    lr: float = 2e-3
    warmup: int = 100
    batch_seconds: float = 24.0
    steps: int | None = None  # None: --hours decides (or DEFAULT_STEPS)
    hours: float | None = None
    save_every: int = 250
    resume: bool = False
    seed: int = 0
    device: str = "auto"
    threads: int = 0
    weight_decay: float = 1e-3
    clip: float = 1.0
    spec_augment: bool = True
    voice_warp: float = 0.0  # VTLP: frequency axis stretched by up to 1 +- this per utterance (0: off)
    tempo: float = 0.0  # time axis stretched by up to 1 +- this per utterance (0: off)
    lookahead_weights: str = ""  # "0=3,240=1": how often each look-ahead is drawn (unnamed: 1; empty: uniform)
    short_first: float = 0.05  # the curriculum: share of the shortest buckets the first steps draw from
    short_first_steps: int = 1000  # steps on those alone
    grow_steps: int = 4000  # then the pool grows linearly to every bucket
    eval_limit: int = 0  # held-out utterances scored at the end (0 = all)
    quiet: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig("", "")
    parser.add_argument("--data", required=True, help="dataset folder: train.jsonl + heldout.jsonl (synth-speech), "
                        "or audio files with same-named .txt transcripts (train/ and heldout/ subfolders)")
    parser.add_argument("--out", required=True, help="output folder: checkpoint-N/, model/, log.jsonl, metrics.json")
    parser.add_argument("--preset", default=d.preset, choices=sorted(PRESETS),
                        help="model size and optimiser defaults (small: the shipped model; tiny: tests)")
    g = parser.add_argument_group("size (default: the preset's)")
    g.add_argument("--subsampling", type=int, choices=[4, 8], default=None,
                   help="time subsampling of the dw_striding front end (8: 80 ms encoder steps, 4: 40 ms)")
    g.add_argument("--d-model", type=int, default=None)
    g.add_argument("--n-layers", type=int, default=None)
    g.add_argument("--n-heads", type=int, default=None)
    g.add_argument("--ff-expansion", type=int, default=None, help="feed-forward width / d_model")
    g.add_argument("--sub-channels", type=int, default=None, help="channels of the subsampling convolutions")
    g.add_argument("--conv-kernel", type=int, default=None, help="causal depthwise convolution kernel")
    g.add_argument("--vocab", type=int, default=None, help="unigram tokenizer size (trained on the transcripts)")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate")
    g.add_argument("--warmup", type=int, default=None, help="linear warm-up steps, then cosine decay")
    g.add_argument("--batch-seconds", type=float, default=None, help="padded audio seconds per batch")
    g.add_argument("--steps", type=int, default=None,
                   help=f"total optimizer steps (default: from --hours, else {DEFAULT_STEPS})")
    g.add_argument("--hours", type=float, default=None, help="wall-clock budget: the step count is fixed from "
                   "the measured speed of the warm-up steps (use --steps to reproduce a run exactly)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--clip", type=float, default=d.clip, help="gradient norm clip")
    g.add_argument("--no-spec-augment", dest="spec_augment", action="store_false", help="no time/frequency masks")
    g.add_argument("--voice-warp", type=float, default=d.voice_warp,
                   help="stretch each utterance's frequency axis by a factor in [1/(1+W), 1+W] (vocal tract "
                        "length perturbation; 0: off, the default)")
    g.add_argument("--tempo", type=float, default=d.tempo, metavar="S",
                   help="stretch each utterance's time axis by a factor in [1/(1+S), 1+S]: slower and faster "
                        "speech, pitch and formants kept (0: off, the default)")
    g.add_argument("--lookahead-weights", default=d.lookahead_weights, metavar="MS=W,...",
                   help="relative frequency of each trained look-ahead in ms, e.g. 0=3 to train the 0 ms one "
                        "three times as often as each other (NeMo's att_context_probs); unnamed ones: 1; "
                        "default: all equally")
    g = parser.add_argument_group("curriculum: short clips first (CTC leaves its plateau far sooner on them)")
    g.add_argument("--short-first", type=float, default=d.short_first,
                   help="share of the length-sorted buckets the first steps draw from (1: no curriculum)")
    g.add_argument("--short-first-steps", type=int, default=d.short_first_steps, help="steps on those alone")
    g.add_argument("--grow-steps", type=int, default=d.grow_steps,
                   help="steps over which the pool then grows linearly to the whole set")
    parser.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the latest --out/checkpoint-N")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default=d.device, help="auto (cuda when available) | cpu | cuda | cuda:N")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--eval-limit", type=int, default=d.eval_limit,
                        help="held-out utterances scored at the end (0: all)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Flags win over the preset; the preset wins over the dataclass defaults."""
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    preset = PRESETS[values.get("preset") or "small"]
    for key in SIZE_KEYS:
        if values.get(key) is None:
            values[key] = preset[key]
    return TrainConfig(**values)


def check_config(cfg: TrainConfig) -> None:
    """Refuse, before any data or feature is loaded, settings that would crash deep in the run (a traceback from
    torch) or silently train something else (--hours 0 read as "unset" meant the full default run): one
    ConfigError naming the flag and what it allows."""
    whole = {"--d-model": cfg.d_model, "--n-layers": cfg.n_layers, "--n-heads": cfg.n_heads,
             "--ff-expansion": cfg.ff_expansion, "--sub-channels": cfg.sub_channels,
             "--conv-kernel": cfg.conv_kernel, "--save-every": cfg.save_every, "--steps": cfg.steps}
    for flag, value in whole.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    for flag, value in {"--warmup": cfg.warmup, "--threads": cfg.threads, "--eval-limit": cfg.eval_limit,
                        "--short-first-steps": cfg.short_first_steps, "--grow-steps": cfg.grow_steps}.items():
        if value < 0:
            raise ConfigError(f"{flag} must be at least 0, got {value}")
    if cfg.subsampling not in (4, 8):
        raise ConfigError(f"--subsampling must be 4 or 8, got {cfg.subsampling}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"--n-heads {cfg.n_heads} must divide --d-model {cfg.d_model}")
    if cfg.d_model % 2:  # the relative positions are sine/cosine pairs
        raise ConfigError(f"--d-model must be even, got {cfg.d_model}")
    if cfg.vocab < 2:
        raise ConfigError(f"--vocab must be at least 2 (and at least the number of distinct characters in the "
                          f"transcripts), got {cfg.vocab}")
    for flag, number in {"--lr": cfg.lr, "--batch-seconds": cfg.batch_seconds, "--clip": cfg.clip,
                         "--hours": cfg.hours}.items():
        if number is not None and not 0.0 < number < math.inf:
            raise ConfigError(f"{flag} must be a finite number > 0, got {number}")
    if not 0.0 <= cfg.weight_decay < math.inf:
        raise ConfigError(f"--weight-decay must be a finite number >= 0, got {cfg.weight_decay}")
    if not 0.0 < cfg.short_first <= 1.0:
        raise ConfigError(f"--short-first must be in (0, 1], got {cfg.short_first}")
    if not 0.0 <= cfg.voice_warp < 1.0:
        raise ConfigError(f"--voice-warp must be in [0, 1), got {cfg.voice_warp}")
    if not 0.0 <= cfg.tempo < 1.0:
        raise ConfigError(f"--tempo must be in [0, 1), got {cfg.tempo}")


def lookahead_weights(spec: str, offered_ms: list[int]) -> list[float] | None:
    """--lookahead-weights as one weight per trained context (in `offered_ms` order), or None for uniform.

    A look-ahead the model does not train, a repeated one, or a weight that is negative, infinite or not a number is a
    ConfigError naming what is offered."""
    if not spec.strip():
        return None
    weights = dict.fromkeys(offered_ms, 1.0)
    named: set[int] = set()
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        try:
            ms, w = int(key), float(value)
        except ValueError:
            ms, w = -1, -1.0
        if not sep or ms not in weights or ms in named or not 0.0 <= w < math.inf:
            raise ConfigError(f"--lookahead-weights: bad item {item.strip()!r}; expected MS=W with MS one of "
                              f"the trained look-aheads {offered_ms} (each once) and W >= 0")
        weights[ms] = w
        named.add(ms)
    if sum(weights.values()) <= 0.0:
        raise ConfigError("--lookahead-weights: at least one weight must be positive")
    return [weights[ms] for ms in offered_ms]
