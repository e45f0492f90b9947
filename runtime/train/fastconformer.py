"""`runtime train fastconformer`: a small cache-aware FastConformer-CTC from scratch, as it will stream.

Why it trains the way it does:
- **The inference mask and convolutions.** Every batch runs the encoder offline over whole utterances with the
  chunked-limited attention mask of one of the model's [left, right] contexts and the causal depthwise and
  subsampling convolutions, which is exactly what cache_aware_encoder.py reproduces chunk by chunk (tests prove the
  equality). Padding cannot leak: each subsampling stage zeroes the frames past an utterance's own length (the
  offline forward's right padding is zeros) and attention never sees padded keys, so every utterance's valid
  frames equal its own unbatched forward (tested). What is learnt is what runs live.
- **Several look-aheads at once.** Each batch draws one context from `att_context_sizes` ([70, 13] .. [70, 0]:
  look-ahead 520 / 240 / 40 / 0 ms at the default 4x subsampling, twice that at 8x; equally often, or as
  `--lookahead-weights` says), so one set of weights serves every `asr.lookahead_ms`.
- **CTC** (blank = the last class), AdamW, linear warm-up then cosine decay, gradient clipping, cheap
  SpecAugment (frequency and time masks). Batches are buckets of similar length cut by total padded duration.
- **Features once.** Log-mels are computed once per utterance with the model's own featurizer and kept in
  memory; on 2 CPU cores recomputing them per step would cost about as much as the model. A fixed per-bin
  mean/std from the training set is stored in the config (NeMo's causal `fixed_mean`/`fixed_std`), so the
  live featurizer applies the same normalisation.
- **Reproducible.** Data order, the look-ahead of each step and the SpecAugment masks are pure functions of
  (seed, step); `checkpoint-N/` holds the model directory plus `trainer_state.pt` (optimizer, step, total steps,
  RNG state), so `--resume` continues an interrupted run exactly where an uninterrupted one would be.

Data (`--data DIR`): `train.jsonl` / `heldout.jsonl` manifests (`runtime train synth-speech`), one
`{"audio": path relative to DIR, "text": ...}` per line; or, without manifests, the folder layout
`runtime.train.data` reads (audio + same-named .txt) from `DIR/train` (or DIR) and `DIR/heldout`.
Output (`--out DIR`): `checkpoint-N/`, `model/` (the shippable checkpoint: model.safetensors, config.json,
tokenizer.json; loadable with `--set asr.model=DIR/model`), `log.jsonl`, `metrics.json` (held-out WER/CER per
look-ahead with greedy CTC).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.errors import ConfigError
from runtime.models.asr.fastconformer.checkpoint import load_checkpoint, save_checkpoint
from runtime.models.asr.fastconformer.features import FeatureConfig, MelFeaturizer
from runtime.models.asr.fastconformer.model import (
    DEFAULT_CONTEXTS,
    FastConformerConfig,
    FastConformerCTC,
)
from runtime.models.asr.fastconformer.tokenizer import CTCTokenizer, train_unigram
from runtime.train.augment import VoiceWarp, spec_augment, tempo_stretch
from runtime.train.ctc_batched import ctc_loss, score_heldout
from runtime.train.ctc_data import (
    Utterance,
    batch_for_step,
    collate,
    compute_features,
    encoder_frames,
    feature_stats,
    load_split,
    make_batches,
    normalise_features,
    shortest_pool,
    step_generator,
)
from runtime.train.fastconformer_config import (  # noqa: F401  (add_arguments: the entry point)
    DEFAULT_STEPS,
    TrainConfig,
    add_arguments,
    check_config,
    config_from_args,
    lookahead_weights,
)
from runtime.train.outputs import out_folder
from runtime.train.run_state import (
    latest_checkpoint,
    restore_rng,
    rng_state,
    truncate_log,
    write_checkpoint,
)

SAVE_KEEP = 2  # periodic checkpoints kept (the newest)


def run(args: argparse.Namespace) -> int:
    metrics = train(config_from_args(args))
    print(json.dumps(metrics))
    return 0


def lr_at(step: int, peak: float, warmup: int, total: int | None) -> float:
    """Linear warm-up to `peak`, then cosine down to 5 % of it at `total` (a pure function: resume needs no
    scheduler state)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


# -- checkpoints ----------------------------------------------------------------------------------------------
def save_training_checkpoint(out: Path, step: int, model: FastConformerCTC, tokenizer: CTCTokenizer,
                             opt: torch.optim.Optimizer, total: int | None, training: dict[str, Any]) -> Path:
    """`checkpoint-N/`: the loadable model directory + `trainer_state.pt`; the newest SAVE_KEEP are kept."""

    def fill(tmp: Path) -> None:
        save_checkpoint(model, tokenizer, tmp, training={**training, "steps": step})
        torch.save({"step": step, "total_steps": total, "optimizer": opt.state_dict(), "rng": rng_state()},
                   tmp / "trainer_state.pt")

    return write_checkpoint(out, step, fill, keep=SAVE_KEEP)


def build_model(cfg: TrainConfig, vocab_size: int, features: FeatureConfig) -> FastConformerCTC:
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"--n-heads {cfg.n_heads} must divide --d-model {cfg.d_model}")
    return FastConformerCTC(FastConformerConfig(
        vocab_size=vocab_size, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
        ff_expansion_factor=cfg.ff_expansion, subsampling_factor=cfg.subsampling,
        subsampling_conv_channels=cfg.sub_channels,
        conv_kernel_size=cfg.conv_kernel, conv_norm_type="layer_norm", att_context_sizes=DEFAULT_CONTEXTS,
        features=features,
    ))


def vocab_floor(utts: list[Utterance], vocab: int) -> int:
    """`vocab`, checked against the transcripts: the unigram trainer must fit every distinct character (the
    word boundary "▁" included) and otherwise fails with a library error that does not name the flag."""
    needed = len(set("▁" + "".join(u.text for u in utts).replace(" ", "▁")))
    if vocab < needed:
        raise ConfigError(f"--vocab {vocab} is too small: the transcripts use {needed} distinct characters "
                          f"(the word boundary included), so --vocab must be at least {needed}")
    return vocab


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA GPU is visible to torch")
    return name


@dataclass
class TrainResult:
    model: FastConformerCTC
    tokenizer: CTCTokenizer
    losses: list[float]  # of the steps run by this call
    metrics: dict[str, Any]


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume), save `model/` and return the metrics (also written to metrics.json)."""
    return train_model(cfg).metrics


def train_model(cfg: TrainConfig) -> TrainResult:
    """The whole recipe; returns the trained model as well (tests compare it with what was saved)."""
    from tqdm import tqdm

    check_config(cfg)
    started = time.monotonic()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    data, out = Path(cfg.data).expanduser(), Path(cfg.out).expanduser()
    if not data.is_dir():
        raise ConfigError(f"--data {data} is not a directory")
    ckpt = latest_checkpoint(out)
    if ckpt is not None and not cfg.resume:
        raise ConfigError(f"{out} already holds {ckpt.name}: pass --resume to continue it, or a new --out")
    out_folder(out)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)

    train_utts, heldout = load_split(data, "train"), load_split(data, "heldout")
    if not train_utts:
        raise ConfigError(f"{data}: no training utterances")
    if ckpt is not None:
        model, tokenizer = load_checkpoint(ckpt)
        features = model.cfg.features
    else:
        tokenizer = train_unigram([u.text for u in train_utts], vocab_floor(train_utts, cfg.vocab))
        features = FeatureConfig()
        model = None
    # the look-ahead weights are checked before the features pass (minutes on a large set), against the
    # contexts the model has or will have
    arch = model.cfg if model is not None else FastConformerConfig(1, subsampling_factor=cfg.subsampling)
    weights = lookahead_weights(cfg.lookahead_weights, [arch.lookahead_ms(c) for c in arch.att_context_sizes])
    context_probs = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    raw = replace(features, fixed_mean=None, fixed_std=None)
    featurizer = MelFeaturizer(raw)
    compute_features(train_utts, featurizer, "train", cfg.quiet)
    if model is None:
        mean, std = feature_stats(train_utts)
        features = replace(raw, fixed_mean=mean, fixed_std=std)
        model = build_model(cfg, tokenizer.vocab_size, features)
    normalise_features(train_utts, features)

    targets = [tokenizer.encode(u.text) for u in train_utts]
    usable = [i for i, u in enumerate(train_utts)
              if 0 < len(targets[i]) <= encoder_frames(u.features.shape[0], cfg.subsampling)]  # type: ignore[union-attr]
    if not usable:
        raise ConfigError(f"{data}: no training utterance has a transcript that fits its audio")
    if len(usable) < len(train_utts) and not cfg.quiet:
        print(f"fastconformer: skipping {len(train_utts) - len(usable)} utterances whose transcript is empty or "
              "longer than their encoder frames", file=sys.stderr)
    batches = [[usable[i] for i in b] for b in
               make_batches([train_utts[i].features.shape[0] for i in usable],  # type: ignore[union-attr]
                            round(cfg.batch_seconds * 100))]

    model.to_runtime(device, torch.float32)
    model.train()
    params = [p for p in (*model.encoder.parameters(), *model.decoder.parameters())]
    for p in params:
        p.requires_grad_(True)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98), eps=1e-9)
    start, total = 0, cfg.steps if cfg.steps is not None else (None if cfg.hours is not None else DEFAULT_STEPS)
    log_path = out / "log.jsonl"
    if ckpt is not None:
        state = torch.load(ckpt / "trainer_state.pt", map_location=device, weights_only=False)
        start, total = int(state["step"]), state["total_steps"] if cfg.steps is None else cfg.steps
        opt.load_state_dict(state["optimizer"])
        restore_rng(state["rng"])
        truncate_log(log_path, start)
    elif log_path.exists():
        log_path.unlink()

    n_params = sum(p.numel() for p in model.state_dict().values())
    training = {"preset": cfg.preset, "seed": cfg.seed, "data": str(data), "train_utterances": len(usable),
                "train_hours": round(sum(train_utts[i].features.shape[0] for i in usable) / 100 / 3600, 3),
                "parameters": n_params, "device": device, "batch_seconds": cfg.batch_seconds, "lr": cfg.lr,
                "warmup": cfg.warmup, "voice_warp": cfg.voice_warp, "tempo": cfg.tempo,
                "lookahead_weights": cfg.lookahead_weights,
                "curriculum": [cfg.short_first, cfg.short_first_steps, cfg.grow_steps]}
    if not cfg.quiet:
        print(f"fastconformer: {n_params / 1e6:.2f} M parameters ({n_params * 4 / 1e6:.1f} MB fp32), "
              f"{tokenizer.vocab_size} tokens, {len(usable)} utterances in {len(batches)} batches/epoch, "
              f"device {device}, steps {total if total is not None else f'from --hours {cfg.hours}'}",
              file=sys.stderr)

    contexts = model.cfg.att_context_sizes
    warp = None
    if cfg.voice_warp:
        if features.fixed_mean is None or features.fixed_std is None:
            raise ConfigError(f"--voice-warp needs the checkpoint's fixed feature mean/std; {ckpt} has none")
        warp = VoiceWarp(featurizer, features.fixed_mean, features.fixed_std, cfg.voice_warp)
    losses: list[float] = []
    calib_from, calib_time = None, 0.0
    bar = tqdm(total=total, initial=start, desc="train fastconformer", unit="step", file=sys.stderr,
               disable=cfg.quiet or None)
    ema = None
    step = start
    with log_path.open("a") as log:
        while total is None or step < total:
            gen = step_generator(cfg.seed, step)
            if context_probs is None:  # uniform: the draw every earlier run made, kept so they reproduce
                context = contexts[int(torch.randint(0, len(contexts), (1,), generator=gen))]
            else:
                context = contexts[int(torch.multinomial(context_probs, 1, generator=gen))]
            pool = shortest_pool(step, len(batches), cfg.short_first, cfg.short_first_steps, cfg.grow_steps)
            idx = batches[batch_for_step(step, len(batches), cfg.seed, pool)]
            feats, lengths = collate([train_utts[i].features for i in idx])  # type: ignore[misc]
            if warp is not None:
                feats = warp(feats, lengths, gen)
            if cfg.tempo:  # drawn only when on, so runs without it keep their generator stream
                feats, lengths = tempo_stretch(feats, lengths, gen, cfg.tempo)
            if cfg.spec_augment:
                feats = spec_augment(feats, lengths, gen)
            lr = lr_at(step, cfg.lr, cfg.warmup, total)
            for group in opt.param_groups:
                group["lr"] = lr
            t0 = time.monotonic()
            loss = ctc_loss(model, feats.to(device), lengths, [targets[i] for i in idx], context)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            if torch.isfinite(norm):
                opt.step()
            step += 1
            value = float(loss.item())
            losses.append(value)
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            log.write(json.dumps({"step": step, "loss": round(value, 5), "lr": lr, "lookahead_ms":
                                  model.cfg.lookahead_ms(context), "grad_norm": round(float(norm), 4),
                                  "s": round(time.monotonic() - t0, 3)}) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}")
            if total is None:  # --hours: fix the step count from the speed of steps 3 .. warmup
                if step - start == 3:
                    calib_from, calib_time = step, time.monotonic()
                elif calib_from is not None and step >= max(calib_from + 5, cfg.warmup):
                    per_step = (time.monotonic() - calib_time) / (step - calib_from)
                    left = cfg.hours * 3600 - (time.monotonic() - started)  # type: ignore[operator]
                    total = max(step + 1, step + int(left / per_step))
                    bar.total = total
                    if not cfg.quiet:
                        print(f"fastconformer: {per_step:.2f} s/step: {total} steps fit in --hours {cfg.hours} "
                              f"(pass --steps {total} to reproduce this run)", file=sys.stderr)
            if step % cfg.save_every == 0 or step == total:
                save_training_checkpoint(out, step, model, tokenizer, opt, total, training)
    bar.close()

    model.eval()
    for p in params:
        p.requires_grad_(False)
    elapsed = time.monotonic() - started
    training = {**training, "steps": step, "wall_s": round(elapsed, 1)}
    save_checkpoint(model, tokenizer, out / "model", training=training)
    metrics: dict[str, Any] = {"steps": step, "final_loss": losses[-1] if losses else None,
                               "parameters": n_params, "wall_s": round(elapsed, 1),
                               "s_per_step": round(elapsed / max(1, len(losses)), 3), "heldout": {}}
    if heldout:
        scored = heldout[: cfg.eval_limit] if cfg.eval_limit else heldout
        compute_features(scored, featurizer, "heldout", cfg.quiet)
        normalise_features(scored, features)
        metrics["heldout"] = score_heldout(model, tokenizer, scored, round(cfg.batch_seconds * 100))
        if not cfg.quiet:
            for name, m in metrics["heldout"].items():
                print(f"fastconformer: held-out {name}: WER {m['wer']:.1%} CER {m['cer']:.1%}", file=sys.stderr)
    metrics["config"] = asdict(cfg)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return TrainResult(model, tokenizer, losses, metrics)
