"""`runtime train causal-whisper`: LoRA adapters that turn an offline Whisper into a causal streaming one.

The loss is Whisper's own: teacher-forced decoder cross-entropy on each clip's transcript (after the
`<|startoftranscript|><|lang|><|transcribe|><|notimestamps|>` prompt, ending in eos), but the encoder runs
`forward_full` under the block-causal mask of `--chunk-ms`, so the adapters learn to read causal encoder
states. Batches pad the shorter clips' AUDIO with silence (the causal encoder then sees what it would see
live if the speaker paused) and the decoder's cross-attention is masked to each clip's own frames, so
padding changes no clip's loss target; labels are padded with -100.

Run state is exact: data order is a pure function of (seed, step), and `checkpoint-N/` holds the adapter,
the optimizer, the step and the RNG state, so `--resume` continues the loss trajectory of an uninterrupted
run. The final adapter goes to `--out/adapter/` (peft layout), loadable with `--set asr.adapter=DIR`.
`--init ADAPTER` starts a new run from an adapter's weights instead of zero (its rank, a fresh optimizer): to
specialise an adapter trained over several chunk sizes to one of them, or to go on with new data.

`--stale-share S` trains that share of each batch's clips on decoder positions about as stale as the stream leaves
them: each position's cross-attention sees only the frames heard when a stream of the step's block size predicts
its next token (the prompt the first block, the position predicting a token the block where that token ends,
`--stale-lag-ms` later; `token_times.py`), instead of the whole clip. The token times come from the base model's
alignment heads, once per clip, cached in `--out/token_ends.json`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.encoder import FRAME_MS, CausalWhisperEncoder, block_frames_for
from runtime.models.asr.causal_whisper.features import log_mel, mel_frames_for
from runtime.models.asr.causal_whisper.lora import adapter_path, add_lora, load_adapter
from runtime.models.asr.whisper_checkpoint import load_whisper, transcript_prompt
from runtime.train.causal_whisper_config import TrainConfig, add_arguments  # noqa: F401  (add_arguments: the entry point)
from runtime.train.data import load_examples
from runtime.train.outputs import out_folder
from runtime.train.run_state import latest_checkpoint, restore_rng, rng_state, truncate_log, write_checkpoint
from runtime.train.token_times import cached_token_ends, fed_frames

BUCKET_POOL = 16  # batches whose clips are sorted by length together (see batch_indices)


def run(args: argparse.Namespace) -> int:
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    train(cfg)
    return 0


@dataclass
class Batch:
    mel: torch.Tensor  # [B, n_mels, T] of the silence-padded audio
    frames: torch.Tensor  # [B, L] encoder frames each decoder position sees (at most its clip's own)
    input_ids: torch.Tensor  # [B, L] prompt + transcript (padded with eos)
    labels: torch.Tensor  # [B, L] next tokens: transcript + eos, -100 on prompt and padding


def make_batch(clips: list[tuple[np.ndarray, list[int]]], sot: list[int], eos: int, n_mels: int,
               stale: Sequence[tuple[list[int], int, int] | None] = ()) -> Batch:
    """Clips are (audio, transcript ids). `stale[i]`, where given and not None, is clip i's token end frames, the
    block size whose stream feeds its positions and the lag, in frames (`fed_frames`); other clips' positions see
    it all."""
    longest = max(len(a) for a, _ in clips)
    mel = torch.stack([log_mel(np.pad(a, (0, longest - len(a))), n_mels) for a, _ in clips])
    width = len(sot) + max(len(ids) for _, ids in clips)
    own = [-(-mel_frames_for(len(a)) // 2) for a, _ in clips]
    frames = torch.tensor([[n] * width for n in own])
    for i, how in enumerate(stale):
        if how is not None:
            ends, block, lag = how
            frames[i] = torch.tensor(fed_frames(ends, len(sot), width, own[i], block, lag))
    input_ids = torch.full((len(clips), width), eos)
    labels = torch.full((len(clips), width), -100)
    for i, (_, ids) in enumerate(clips):
        seq = sot + ids
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(sot) - 1 : len(seq)] = torch.tensor([*ids, eos])
    return Batch(mel, frames, input_ids, labels)


def decoder_logits(model: torch.nn.Module, input_ids: torch.Tensor, states: torch.Tensor,
                   frames: torch.Tensor) -> torch.Tensor:
    """Whisper's decoder over [B, L] ids with cross-attention limited to each position's first `frames[b, p]`
    encoder states, or each row's first `frames[b]` (WhisperDecoder.forward passes no encoder mask, so its
    layers are driven here)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dec = base.model.decoder
    length, width = input_ids.shape[1], states.shape[1]
    h = dec.embed_tokens(input_ids) + dec.embed_positions.weight[:length]
    neg = torch.finfo(h.dtype).min
    causal = torch.full((length, length), neg, dtype=h.dtype, device=h.device).triu(1)[None, None]
    seen = frames.to(h.device)
    seen = seen[:, None].expand(-1, length) if seen.dim() == 1 else seen
    visible = torch.arange(width, device=h.device)[None, None, :] < seen[:, :, None]  # [B, L, frames]
    cross = torch.zeros(visible.shape, dtype=h.dtype, device=h.device).masked_fill(~visible, neg)[:, None]
    for layer in dec.layers:
        h = layer(h, attention_mask=causal, encoder_hidden_states=states, encoder_attention_mask=cross,
                  use_cache=False)
    return base.proj_out(dec.layer_norm(h))


def loss_and_logits(model: torch.nn.Module, encoder: CausalWhisperEncoder,
                    batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the transcript tokens, and the logits [B, L, vocab]."""
    device = encoder.device
    states = encoder.forward_full(batch.mel.to(device))
    logits = decoder_logits(model, batch.input_ids.to(device), states, batch.frames)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.to(device).flatten(), ignore_index=-100)
    return loss, logits


def batch_indices(step: int, n: int, batch_size: int, seed: int, lengths: list[int] | None = None) -> list[int]:
    """Clips of `step`: consecutive slices of per-epoch permutations seeded by (seed, epoch).

    With `lengths`, each epoch's permutation is cut into pools of BUCKET_POOL batches, each pool sorted by
    length before it is sliced, and the epoch's batches shuffled: a batch holds clips of similar length, so
    little of its compute goes to the silence that pads the shorter ones, and every clip is still seen once
    an epoch. The last partial batch of an epoch takes its rest from the next epoch, as without lengths."""
    if lengths is None:
        out = []
        for k in range(step * batch_size, (step + 1) * batch_size):
            epoch, pos = divmod(k, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            out.append(int(order[pos]))
        return out
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(k, n)
        out.append(_bucketed_epoch(n, batch_size, seed, epoch, tuple(lengths))[pos])
    return out


@functools.lru_cache(maxsize=4)
def _bucketed_epoch(n: int, batch_size: int, seed: int, epoch: int, lengths: tuple[int, ...]) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=gen).tolist()
    pool = batch_size * BUCKET_POOL
    batches = []
    for start in range(0, n, pool):
        ranked = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batches += [ranked[j : j + batch_size] for j in range(0, len(ranked), batch_size)]
    return [i for b in torch.randperm(len(batches), generator=gen).tolist() for i in batches[b]]


def stale_rows(step: int, n: int, share: float, seed: int) -> list[bool]:
    """Which of a step's `n` clips train on stale positions: each with probability `share`, a pure function
    of (seed, step) as the batch order is, so a resumed run draws the same."""
    if share <= 0:
        return [False] * n
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7_919)
    return (torch.rand(n, generator=gen) < share).tolist()


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Transcript ids with Whisper's leading space (its outputs start with one); none for a blank transcript
    (the teacher heard nothing yet: the target is eos at once)."""
    if not text.strip():
        return []
    return tokenizer.encode(" " + text.strip(), add_special_tokens=False)


def _save_checkpoint(out: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp / "adapter")
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step}))

    write_checkpoint(out, step, fill)


def chunk_sizes(cfg: TrainConfig) -> list[int]:
    """The block sizes of `--chunk-ms` (`300` or `100,200,300`), each a positive multiple of 20 ms."""
    try:
        sizes = [int(part) for part in str(cfg.chunk_ms).split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(ms <= 0 or ms % FRAME_MS for ms in sizes):
        raise ConfigError(f"--chunk-ms must be positive multiples of {FRAME_MS} (e.g. 300 or 100,200,300), "
                          f"got {cfg.chunk_ms}")
    return sizes


def check_config(cfg: TrainConfig) -> None:
    """Refuse numbers the run cannot use before the base model is loaded, naming the flag (peft and torch would
    fail later with their own tracebacks, or train nothing useful with a NaN learning rate)."""
    for flag, value in {"--rank": cfg.rank, "--steps": cfg.steps, "--batch-size": cfg.batch_size,
                        "--save-every": cfg.save_every}.items():
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    chunk_sizes(cfg)
    if cfg.init and not cfg.resume and not (adapter_path(cfg.init) / "adapter_config.json").is_file():
        raise ConfigError(f"--init {cfg.init}: no adapter there (a folder with adapter_config.json, as "
                          "`runtime train causal-whisper` writes in --out/adapter and --out/checkpoint-N/adapter, "
                          "or builtin:NAME)")
    if not 0.0 < cfg.lr < math.inf:
        raise ConfigError(f"--lr must be a finite number > 0, got {cfg.lr}")
    if not 0.0 <= cfg.stale_share <= 1.0:
        raise ConfigError(f"--stale-share must be between 0 and 1, got {cfg.stale_share}")
    if cfg.stale_lag_ms < 0 or cfg.stale_lag_ms % FRAME_MS:
        raise ConfigError(f"--stale-lag-ms must be a multiple of {FRAME_MS} ms >= 0, got {cfg.stale_lag_ms}")
    if cfg.stale_lag_ms and not cfg.stale_share:
        raise ConfigError("--stale-lag-ms applies to stale positions only: give --stale-share too")


def train(cfg: TrainConfig) -> tuple[torch.nn.Module, list[float]]:
    """Train (or resume) and save; returns the trained peft model and the losses of the steps run here."""
    from tqdm import tqdm

    check_config(cfg)
    sizes = chunk_sizes(cfg)
    out = Path(cfg.out).expanduser()
    ckpt = latest_checkpoint(out)
    if ckpt is not None and not cfg.resume:
        raise ConfigError(f"{out} already holds {ckpt.name}: pass --resume to continue it, or a new --out")
    out_folder(out)

    model, tokenizer, _ = load_whisper(cfg.base, dtype=cfg.dtype, device=cfg.device)
    sot, eos = transcript_prompt(tokenizer, model.config, cfg.language), int(tokenizer.eos_token_id)
    room = model.config.max_target_positions - len(sot)
    clips, keys = [], []
    for ex in load_examples(cfg.data):
        ids = encode_text(tokenizer, ex.text)
        if len(ids) >= room:
            raise ConfigError(f"transcript of {ex.path} has {len(ids)} tokens; the decoder holds {room - 1}")
        clips.append((ex.audio, ids))
        keys.append(str(ex.path.relative_to(Path(cfg.data).expanduser())))
    ends: list[list[int]] = []
    if cfg.stale_share:
        try:
            timed = [(key, audio, ids) for key, (audio, ids) in zip(keys, clips, strict=True)]
            ends = cached_token_ends(cfg.base, timed, sot, eos, out / "token_ends.json")
        except ConfigError as err:  # a base without alignment heads
            raise ConfigError(f"--stale-share needs token times: {err}") from None

    lengths = [len(audio) for audio, _ in clips]
    torch.manual_seed(cfg.seed)  # after loading: building a tiny: base on first use draws from the global RNG
    if ckpt:
        model = load_adapter(model, ckpt / "adapter", trainable=True)
    elif cfg.init:
        try:
            model = load_adapter(model, cfg.init, trainable=True)
        except ValueError as err:  # trained for another base
            raise ConfigError(f"--init {cfg.init}: {err}") from None
        # the base this run trains for, as a fresh adapter records it, not the one the init adapter was trained on
        model.peft_config["default"].base_model_name_or_path = model.get_base_model().name_or_path
    else:
        model = add_lora(model, cfg.rank)
    model.train()
    encoders = [CausalWhisperEncoder(model, block_frames=block_frames_for(ms)) for ms in sizes]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    start = 0
    log_path = out / "log.jsonl"
    if ckpt:
        start = json.loads((ckpt / "state.json").read_text())["step"]
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=cfg.device))
        restore_rng(torch.load(ckpt / "rng.pt", weights_only=False))
        truncate_log(log_path, start)
    elif log_path.exists():
        log_path.unlink()

    losses: list[float] = []
    bar = tqdm(total=cfg.steps, initial=start, desc="train causal-whisper", unit="step", file=sys.stderr,
               disable=None)
    with log_path.open("a") as log:
        for step in range(start, cfg.steps):
            indices = batch_indices(step, len(clips), cfg.batch_size, cfg.seed, lengths)
            encoder = encoders[step % len(encoders)]
            stale = [(ends[i], encoder.block_frames, cfg.stale_lag_ms // FRAME_MS) if s else None
                     for i, s in zip(indices, stale_rows(step, len(indices), cfg.stale_share, cfg.seed), strict=True)]
            batch = make_batch([clips[i] for i in indices], sot, eos, encoder.n_mels, stale)
            loss, _ = loss_and_logits(model, encoder, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            log.write(json.dumps({"step": step + 1, "loss": losses[-1], "chunk_ms": sizes[step % len(sizes)]}) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                _save_checkpoint(out, step + 1, model, opt)
    bar.close()
    model.save_pretrained(out / "adapter")
    model.eval()
    return model, losses
