"""`runtime bench asr`: the streaming ASR encoders, shape-true.

Measured per model (real configs, random weights) and chunk size:
- exactness: streaming encoder output vs one full-sequence forward under the same mask, over several
  chunkings (fp32),
- per-chunk compute (p50, p95) and RTF when audio arrives in chunks of that size,
- cost growth: compute per audio second at minute 10 of a continuous stream over that at second 10,
- the buffered peer (whisper_streaming: re-encode the 30 s window every 1 s step, LocalAgreement-2 on top)
  over ours, same shape: compute per audio second of the encoder path,
- algorithmic latency: how long the last sample of a block waits before its frames can exist.

The encoder path (features + encoder) is what is timed. Decoder work depends on how many tokens the
weights emit, which random weights cannot tell; `decoder_token_ms` gives its per-token cost instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

from runtime.bench.shapes import whisper_config
from runtime.bench.timing import machine, percentiles_ms, timed
from runtime.chunks import SAMPLE_RATE
from runtime.models.asr.causal_whisper.encoder import CausalWhisperEncoder, block_frames_for
from runtime.models.asr.fastconformer.cache_aware_encoder import CacheAwareEncoderStream
from runtime.models.asr.fastconformer.model import FastConformerCTC
from runtime.models.asr.fastconformer.tiny import build_fastconformer, fastconformer_114m_config
from runtime.models.asr.whisper_buffered import CACHE_ARG
from runtime.models.loading import configure_threads, torch_dtype

Status = Callable[[str], None]
PEER_STEP_S = 1.0  # whisper_streaming's minimum chunk: one re-decode per second of new audio
RESET_S = 30.0  # the causal encoder's positional table: a stream restarts every 30 s


def _noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * SAMPLE_RATE)) * 0.1).astype(np.float32)


def _split(n: int, sizes: list[int]) -> list[tuple[int, int]]:
    out, start, i = [], 0, 0
    while start < n:
        end = min(n, start + sizes[i % len(sizes)])
        out.append((start, end))
        start, i = end, i + 1
    return out


def whisper_exactness(model: WhisperForConditionalGeneration, chunk_ms: int, seconds: float) -> float:
    """Worst |stream - full| over chunkings: whole blocks, 1-block+ragged, tiny pieces (fp32 copy)."""
    enc = CausalWhisperEncoder(model, block_frames=block_frames_for(chunk_ms))
    audio = _noise(seconds, seed=1)
    with torch.inference_mode():
        full = enc.encode_audio(audio).float()
    block = chunk_ms * SAMPLE_RATE // 1000
    rng = np.random.default_rng(2)
    chunkings = [[block], [block + 37, 11, 3 * block], list(rng.integers(1, 2 * block, 64))]
    worst = 0.0
    for sizes in chunkings:
        stream = enc.open_audio()
        parts = [stream.accept(audio[a:b]) for a, b in _split(len(audio), sizes)] + [stream.flush()]
        got = torch.cat(parts).float()
        worst = max(worst, float((got - full).abs().max()))
    return worst


def whisper_stream_cost(
    enc: CausalWhisperEncoder, audio: np.ndarray, chunk_ms: int, device: str, windows: list[tuple[float, float]]
) -> dict[str, Any]:
    """Stream `audio` in chunks (restarting every RESET_S); per-chunk times and compute/s in `windows`."""
    step = chunk_ms * SAMPLE_RATE // 1000
    per_reset = int(RESET_S * SAMPLE_RATE)
    times: list[float] = []
    stream = enc.open_audio()
    fed = 0
    for start in range(0, len(audio) - step + 1, step):
        if start - fed >= per_reset:
            stream, fed = enc.open_audio(), start
        _, seconds = timed(lambda s=start, st=stream: st.accept(audio[s:s + step]), device)
        times.append(seconds)
    chunk_s = chunk_ms / 1000
    per_window = []
    for lo, hi in windows:
        idx = [i for i in range(len(times)) if lo <= i * chunk_s < hi]
        # The median chunk: robust to another process stealing the CPU for a moment on a shared machine.
        per_window.append(float(np.median([times[i] for i in idx])) / chunk_s if idx else float("nan"))
    steady = times[max(1, int(2 * chunk_s ** -1)):]  # skip the widened first block and warm-up
    return {"times": steady, "rtf": sum(times) / (len(times) * chunk_s), "compute_per_s": per_window}


def peer_step_cost(model: WhisperForConditionalGeneration, device: str, repeats: int) -> float:
    """One whisper_streaming step: features of the padded 30 s window and a full encoder forward."""
    fe = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    audio = _noise(15.0, seed=3)  # the buffer, trimmed at 15 s; Whisper pads it to 30 s regardless
    dtype = next(model.parameters()).dtype

    def step() -> torch.Tensor:
        feats = fe(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features.to(device, dtype)
        with torch.inference_mode():
            return model.model.encoder(feats).last_hidden_state

    step()
    return float(np.median([timed(step, device)[1] for _ in range(repeats)]))


def decoder_token_ms(model: WhisperForConditionalGeneration, device: str, cross_frames: int) -> float:
    """Per-token decoder cost with a KV cache, cross-attending to `cross_frames` encoder frames."""
    dtype = next(model.parameters()).dtype
    enc = torch.randn(1, cross_frames, model.config.d_model, device=device, dtype=dtype)
    ids = torch.tensor([[model.config.decoder_start_token_id]], device=device)
    with torch.inference_mode():
        out = model.model.decoder(input_ids=ids, encoder_hidden_states=enc, use_cache=True)
        past = out.past_key_values
        steps = []
        for _ in range(8):
            out, seconds = timed(lambda p=past: model.model.decoder(input_ids=ids, encoder_hidden_states=enc,
                                                                   use_cache=True, **{CACHE_ARG: p}), device)
            past = out.past_key_values
            steps.append(seconds)
    return round(float(np.median(steps[2:])) * 1000, 3)


def bench_whisper(name: str, args: argparse.Namespace, status: Status, out: dict[str, Any]) -> None:
    device, dtype = args.device, args.dtype
    quick = args.quick
    chunk_sizes = [100, 300, 1000]  # --quick too: every chunk size's row, on the small shape and 8 s of audio
    torch.manual_seed(0)
    status(f"{name}: building the real config with random weights on {device}/{dtype}")
    model = WhisperForConditionalGeneration(whisper_config(name)).to(device, torch_dtype(dtype)).eval()
    exact_model = model if dtype == "float32" else WhisperForConditionalGeneration(whisper_config(name)).eval()
    large = model.config.d_model >= 1024 and not device.startswith("cuda")
    seconds = 8.0 if quick or large else 20.0
    audio = _noise(seconds)
    for chunk_ms in chunk_sizes:
        key = f"causal-whisper/{name}@{chunk_ms}ms"
        status(f"{key}: exactness over 3 chunkings")
        out["stream_vs_full"][key] = whisper_exactness(exact_model, chunk_ms, 4.0 if quick or large else 7.0)
        status(f"{key}: streaming {seconds:g} s of audio")
        enc = CausalWhisperEncoder(model, block_frames=block_frames_for(chunk_ms))
        cost = whisper_stream_cost(enc, audio, chunk_ms, device, [])
        out["per_chunk_ms"][key] = percentiles_ms(cost["times"])
        out["rtf"][key] = round(cost["rtf"], 4)
        out["algorithmic_latency_ms"][key] = {"chunk_ms": chunk_ms, "lookahead_ms": 10,
                                              "first_block_ms": 2 * chunk_ms + 10, "total_ms": chunk_ms + 10}
    # Cost growth and the buffered peer at 300 ms chunks.
    enc = CausalWhisperEncoder(model, block_frames=block_frames_for(300))
    if not large:
        # Same phase of the 30 s reset cycle in both windows, so the ratio shows growth, not the cycle.
        late = 60.0 if quick else 600.0
        windows = [(10.0, 20.0), (late + 10.0, late + 20.0)]
        status(f"{name}: a continuous {late + 20:g} s stream for cost growth ({windows[0]} s vs {windows[1]} s)")
        cost = whisper_stream_cost(enc, _noise(late + 20.0, seed=4), 300, device, windows)
        early_s, late_s = cost["compute_per_s"]
        out["cost_growth"][name] = {"windows_s": windows, "compute_s_per_audio_s": [round(early_s, 5),
                                    round(late_s, 5)], "ratio": round(late_s / early_s, 4)}
        ours_per_s = cost["rtf"]
    else:
        ours_per_s = out["rtf"][f"causal-whisper/{name}@300ms"]
    status(f"{name}: the buffered peer (30 s window re-encoded every {PEER_STEP_S:g} s)")
    peer_per_s = peer_step_cost(model, device, repeats=2 if large or quick else 5) / PEER_STEP_S
    out["buffered_peer"][name] = {"peer_s_per_audio_s": round(peer_per_s, 5), "ours_s_per_audio_s":
                                  round(ours_per_s, 5), "ratio": round(peer_per_s / ours_per_s, 2)}
    out["decoder_token_ms"][name] = {"cross_750_frames": decoder_token_ms(model, device, 750),
                                     "cross_1500_frames": decoder_token_ms(model, device, 1500)}


def fastconformer_quick_config() -> dict[str, Any]:
    """--quick: the 114M config shrunk (4 x 256), same layer types and look-aheads."""
    cfg = fastconformer_114m_config()
    cfg["encoder"].update(n_layers=4, d_model=256, n_heads=4, subsampling_conv_channels=128)
    cfg["decoder"]["feat_in"] = 256
    return cfg


def conformer_exactness(model: FastConformerCTC, context: tuple[int, int], seconds: float) -> float:
    audio = _noise(seconds, seed=1)
    full = model.encode_offline(audio, context).float()
    chunk = (context[1] + 1) * 1280  # samples in one encoder chunk
    rng = np.random.default_rng(2)
    worst = 0.0
    for sizes in ([chunk], [chunk + 37, 11, 3 * chunk], list(rng.integers(1, 2 * chunk, 64))):
        stream = CacheAwareEncoderStream(model, context)
        parts = [stream.accept(audio[a:b]) for a, b in _split(len(audio), sizes)] + [stream.finish()]
        worst = max(worst, float((torch.cat(parts).float() - full).abs().max()))
    return worst


def conformer_stream_cost(model: FastConformerCTC, context: tuple[int, int], audio: np.ndarray, device: str,
                          windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Feed audio one encoder chunk at a time (what a live source at that look-ahead delivers)."""
    chunk_s = (context[1] + 1) * 0.08
    step = round(chunk_s * SAMPLE_RATE)
    stream = CacheAwareEncoderStream(model, context)
    times = [timed(lambda s=start: stream.accept(audio[s:s + step]), device)[1]
             for start in range(0, len(audio) - step + 1, step)]
    per_window = []
    for lo, hi in windows:
        idx = [i for i in range(len(times)) if lo <= i * chunk_s < hi]
        per_window.append(float(np.median([times[i] for i in idx])) / chunk_s if idx else float("nan"))
    return {"times": times[2:], "rtf": sum(times) / (len(times) * chunk_s), "compute_per_s": per_window,
            "chunk_ms": round(chunk_s * 1000)}


def bench_fastconformer(args: argparse.Namespace, status: Status, out: dict[str, Any]) -> None:
    name = "fastconformer-quick" if args.quick else "fastconformer-114m"
    status(f"{name}: building the real config with random weights on {args.device}/{args.dtype}")
    config = fastconformer_quick_config() if args.quick else fastconformer_114m_config()
    exact_model, _ = build_fastconformer(config, seed=0)  # fp32 on CPU: exactness is an fp32 property
    model = exact_model
    if args.device != "cpu" or args.dtype != "float32":
        model, _ = build_fastconformer(config, seed=0)
        model = model.to_runtime(args.device, torch_dtype(args.dtype))
    seconds = 8.0 if args.quick else 20.0
    audio = _noise(seconds)
    for context in model.cfg.att_context_sizes:
        key = f"fastconformer/{name}@lookahead{model.cfg.lookahead_ms(context)}ms"
        status(f"{key}: exactness over 3 chunkings, then {seconds:g} s streamed")
        out["stream_vs_full"][key] = conformer_exactness(exact_model, context, 4.0)
        cost = conformer_stream_cost(model, context, audio, args.device, [])
        out["per_chunk_ms"][key] = {**percentiles_ms(cost["times"]), "chunk_ms": cost["chunk_ms"]}
        out["rtf"][key] = round(cost["rtf"], 4)
        out["algorithmic_latency_ms"][key] = {"chunk_ms": cost["chunk_ms"], "lookahead_ms":
                                              model.cfg.lookahead_ms(context), "features_ms": 12.5,
                                              "total_ms": cost["chunk_ms"] + 12.5}
    late = 60.0 if args.quick else 600.0
    windows = [(10.0, 20.0), (late + 10.0, late + 20.0)]
    context = model.cfg.att_context_sizes[0]
    status(f"{name}: a continuous {late + 20:g} s stream for cost growth ({windows[0]} s vs {windows[1]} s)")
    cost = conformer_stream_cost(model, context, _noise(late + 20.0, seed=4), args.device, windows)
    early_s, late_s = cost["compute_per_s"]
    out["cost_growth"][name] = {"windows_s": windows, "compute_s_per_audio_s": [round(early_s, 5),
                                round(late_s, 5)], "ratio": round(late_s / early_s, 4)}


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    threads = configure_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cudnn.allow_tf32 = False  # TF32 convs would break fp32 exactness
        torch.backends.cuda.matmul.allow_tf32 = False
    out: dict[str, Any] = {k: {} for k in ("stream_vs_full", "per_chunk_ms", "rtf", "cost_growth",
                                           "buffered_peer", "decoder_token_ms", "algorithmic_latency_ms")}
    whisper_names = ["whisper-quick"] if args.quick else ["whisper-base", "whisper-large-v3"]
    for name in whisper_names:
        bench_whisper(name, args, status, out)
    bench_fastconformer(args, status, out)
    growth = [v["ratio"] for v in out["cost_growth"].values()]
    peers = [v["ratio"] for v in out["buffered_peer"].values()]
    return {
        "bench": "asr",
        "quick": args.quick,
        "machine": machine(args.device, args.dtype, threads),
        "measured": "features + encoder per chunk (decoder work depends on weights: see decoder_token_ms)",
        "stream_vs_full_max_abs_diff": max(out["stream_vs_full"].values()),
        "cost_growth_ratio": max(growth) if growth else None,
        "buffered_baseline_compute_ratio": min(peers) if peers else None,
        **out,
    }
