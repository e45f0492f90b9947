"""`runtime bench asr-quality`: word and character error rates of trained ASR, streamed as users get it.

Unlike the shape-true benchmarks this one needs trained weights (by default the shipped `builtin:demo-fastconformer`,
else `--model REF`): error rates of random weights mean nothing, so a `tiny:` model is refused. It scores:

- the fixed held-out set of `runtime train synth-speech` (voices and sentences never trained on; generated into
  the cache on first use, which needs espeak-ng, flite and festival as installed for training; or `--data DIR`),
  streamed through the runtime's own ASR stream in 100 ms chunks at each look-ahead the model offers;
- the same audio offline with full context (every frame sees the whole utterance), the ceiling the streaming
  numbers are held to;
- the demo sample (`runtime/io/assets/demo_speech.flac`) against its script;

each with both CTC decoders (`asr.decoder`): greedy, and the beam search scored with the checkpoint's word LM
(`lm.arpa`, from `runtime train word-lm`; a plain beam when the checkpoint has none). The demo profile uses
the beam. `word_wait_s` says how long a word shown while streaming waited to be final (median, 90th
percentile and longest, in seconds of audio). `by_engine` splits the held-out scores at the smallest look-ahead
and offline by synthesiser (the manifest's `engine`): the set mixes held-out espeak-ng variants with flite's
held-out voice, and the two fail very differently, so one mean hides where the error is.

Beside it, `systems` (issue 22, `asr_systems.py`) scores Whisper tiny.en offline (the ceiling), our causal
tiny.en at each `--chunks` size, the buffered LocalAgreement-2 peer, faster-whisper (the speed peer) and this
FastConformer on the held-out set and on human speech (`--human DIR`, default `../shared/speech/dev`): WER, CER,
compute per audio second and word latency per (system, set), and the issue's `targets` from those rows.
`--systems` picks a subset (without `fastconformer` the report above is skipped).

`captions` (issue 53, `asr_captions.py`) runs the two-pass causal stream as a session does, Silero VAD cutting
turns: the words captioned over the generated non-speech set (target 0) beside the ungated stream and
faster-whisper, the words the speech gate loses on the speech sets, and long-form human reading assembled from the
development clips with and without the turns' context, against offline Whisper and faster-whisper on the same file
(target: streamed WER within 1.25x offline). `--systems` without `captions` skips it.

How much audio: the full run scores the first `FULL_UTTERANCES` clips of the fixed held-out set (of its 200; a
`--data` folder is scored whole), `--quick` fewer (`QUICK_UTTERANCES` here, `asr_systems.QUICK_UTTERANCES` for the
systems), so that the full run stays within 20 minutes on 2 cores and the quick one within 3 (issue 50): 200 clips
through the 17 systems took about an hour. The first 40 mix both synthesisers (27 espeak-ng, 13 flite clips).

Texts are compared after `runtime.train.text_norm.normalize` (numbers spelled out, punctuation dropped), the
form the model was trained to write. Targets (issue 7): held-out WER <= 15 % and CER <= 5 % at the smallest
look-ahead, streaming within 1 point of offline, the demo sample's WER <= 10 %.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import soundfile
import torch

from runtime.bench.timing import at_most, machine
from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.models.asr.base import StreamingASR
    from runtime.models.asr.fastconformer.asr import FastConformerASR
    from runtime.models.asr.fastconformer.model import FastConformerCTC

DEFAULT_MODEL = "builtin:demo-fastconformer"
CHUNK_MS = 100
FULL_CONTEXT = (1 << 20, 1 << 20)  # one chunk spanning any utterance: every frame attends to every frame
QUICK_UTTERANCES = 6  # --quick: the first 6 held-out utterances (the report at every look-ahead, both decoders)
FULL_UTTERANCES = 40  # the full run: the first 40 clips of the fixed held-out set (module doc)


def heldout_set(data: str | None, status: Callable[[str], None]) -> tuple[Path, list[dict[str, Any]]]:
    """(folder, manifest rows) of the held-out set: `data`, or the fixed set generated once into the cache."""
    if data:
        folder = Path(data).expanduser()
    else:
        from runtime.io.sample import default_cache_dir
        from runtime.train.synth_speech import Settings, generate

        folder = default_cache_dir() / "synth-heldout"
        if not (folder / "heldout.jsonl").is_file():
            status(f"generating the fixed held-out set into {folder} (once) ...")
            generate(Settings(str(folder), hours=0.01, quiet=True))
    manifest = folder / "heldout.jsonl"
    if not manifest.is_file():
        raise ConfigError(f"{folder} has no heldout.jsonl; pass --data with a folder made by "
                          "`runtime train synth-speech`")
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    if not rows:  # error rates over nothing would read 0 % and meet every target
        raise ConfigError(f"{manifest} lists no utterances; nothing to score")
    return folder, rows


def stream_transcript(asr: StreamingASR, audio: np.ndarray, waits: list[float] | None = None) -> str:
    """What a user sees: the audio in 100 ms chunks through the runtime's ASR stream, completed items joined.

    `waits`, when given, gets `word_waits` of this audio."""
    stream = asr.open_stream()
    step = SAMPLE_RATE * CHUNK_MS // 1000
    timed = []
    for start in range(0, len(audio), step):
        heard = min(start + step, len(audio)) / SAMPLE_RATE
        timed += [(heard, u) for u in stream.accept(AudioChunk(audio[start : start + step], start))]
    timed += [(len(audio) / SAMPLE_RATE, u) for u in stream.finish()]
    stream.close()
    if waits is not None:
        waits += word_waits(timed)
    items = [u.transcript for _, u in timed if u.completed]
    return " ".join(t.strip() for t in items if t.strip())


def word_waits(timed: list[tuple[float, Any]]) -> list[float]:
    """Seconds of audio each word was on screen before it was final: from the update that first showed its
    item that many words (stable text and unstable tail) to the one that made it stable. Greedy decoding's are
    all 0; the beam's are what `asr.commit_after_s` bounds (a caption reader that prints only stable text,
    as the CLI does off a terminal, sees each word that much later)."""
    stable: dict[str, str] = {}
    shown_at: dict[str, list[float]] = {}
    final: dict[str, int] = {}
    waits = []
    for heard, update in timed:
        text = update.transcript if update.completed else stable.get(update.item_id, "") + update.delta
        stable[update.item_id] = text
        n_stable = len(text.split())
        shown = shown_at.setdefault(update.item_id, [])
        n_shown = max(n_stable, len((text + " " + update.unstable).split()))
        shown += [heard] * (n_shown - len(shown))
        done = final.get(update.item_id, 0)
        waits += [heard - shown[i] for i in range(done, n_stable)]
        final[update.item_id] = max(done, n_stable)
    return waits


def _wait_summary(waits: list[float]) -> dict[str, float]:
    if not waits:
        return {"median": 0.0, "p90": 0.0, "max": 0.0}
    return {"median": round(float(np.median(waits)), 2), "p90": round(float(np.percentile(waits, 90)), 2),
            "max": round(max(waits), 2)}


def offline_logprobs(model: FastConformerCTC, audio: np.ndarray, context: tuple[int, int]) -> np.ndarray:
    """CTC log-probabilities [T, V] of a whole signal in one forward."""
    with torch.inference_mode():
        return model.decoder(model.encode_offline(audio, context).unsqueeze(0))[0].float().cpu().numpy()


def offline_text(asr: FastConformerASR, logprobs: np.ndarray) -> str:
    """The decoder of `asr` (greedy or beam) over a whole utterance's frames, as one item."""
    text = asr.item_text()
    for label, row in zip(logprobs.argmax(-1).tolist(), logprobs, strict=True):
        text.push(label, row)
    return text.finish()


def run(args: argparse.Namespace, status: Callable[[str], None]) -> dict[str, Any]:
    from runtime.bench.asr_systems import QUICK_UTTERANCES as SYSTEMS_QUICK
    from runtime.bench.asr_systems import WHISPER, EvalSet, build, human_set, selection
    from runtime.models.loading import configure_threads

    ref = getattr(args, "model", None) or DEFAULT_MODEL
    if ref.startswith("tiny:"):
        raise ConfigError(f"{ref} has random weights: its error rates mean nothing; score a trained checkpoint")
    kinds, chunks = selection(args)
    threads = configure_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    folder, rows = heldout_set(getattr(args, "data", None), status)
    if not getattr(args, "data", None):
        rows = rows[:FULL_UTTERANCES]
    started = time.perf_counter()
    # repeats: the runs of each clip a system's compute is the fastest of (`--repeats`)
    result: dict[str, Any] = {"bench": "asr-quality", "quick": bool(args.quick), "repeats": getattr(args, "repeats", 1)}
    if "fastconformer" in kinds:
        result.update(fastconformer_part(args, ref, folder, rows, dtype, status))
    result["data"] = str(folder)
    keep = rows[:SYSTEMS_QUICK] if args.quick else rows
    synthetic = EvalSet("synthetic", [_read(folder / row["audio"]) for row in keep], [row["text"] for row in keep])
    sets = [synthetic, human_set(args, _read)]
    shared: dict[str, Any] = {}  # the Whisper models the systems loaded, which the captions reuse
    result.update(build(args, sets, kinds, chunks, fc_ref=ref, device=args.device, dtype=dtype, status=status,
                        shared=shared))
    if "captions" in kinds:
        from runtime.bench.asr_captions import captions_part

        whisper = getattr(args, "whisper", None) or WHISPER
        result["captions"] = captions_part(args, sets, whisper, args.device, dtype, status, shared)
    if "multilingual" in kinds:  # Whisper base on espeak-ng German, Spanish and French, with its peers
        from runtime.bench.asr_multilingual import multilingual_part

        result["multilingual"] = multilingual_part(args, args.device, dtype, status)
    return {**result, "units": "percent, after text_norm.normalize", "machine": machine(args.device, dtype, threads),
            "wall_s": round(time.perf_counter() - started, 1)}


def fastconformer_part(args: argparse.Namespace, ref: str, folder: Path, rows: list[dict[str, Any]], dtype: str,
                       status: Callable[[str], None]) -> dict[str, Any]:
    """The FastConformer's own report (issue 7): greedy and beam, streamed at each look-ahead and offline."""
    from runtime.io.sample import demo_script, demo_speech
    from runtime.models.asr.fastconformer.asr import FastConformerASR, find_checkpoint, load_any
    from runtime.models.asr.fastconformer.decoding import LM_FILE
    from runtime.models.loading import cache_dir, load_progress, torch_dtype
    from runtime.train.text_norm import cer, normalize, wer

    if args.quick:
        rows = rows[:QUICK_UTTERANCES]
    audios = [_read(folder / row["audio"]) for row in rows]
    refs = [row["text"] for row in rows]
    with load_progress(status, "asr", ref, args.device, dtype):  # no look-ahead yet: each is scored below
        checkpoint = find_checkpoint(ref, status)
        if checkpoint.resolve().is_relative_to((cache_dir() / "tiny").resolve()):
            raise ConfigError(f"{ref} is a random-weight tiny model (built into {cache_dir() / 'tiny'}): its "
                              "error rates mean nothing; score a trained checkpoint")
        model, tokenizer = load_any(checkpoint)
        model.to_runtime(args.device, torch_dtype(dtype))
    lookaheads = chosen_lookaheads(sorted(model.cfg.lookahead_ms(c) for c in model.cfg.att_context_sizes),
                                   getattr(args, "lookaheads_ms", None), ref)
    status(f"offline, full context: {len(rows)} utterances ...")
    logprobs = [offline_logprobs(model, a, FULL_CONTEXT) for a in audios]
    speech, script = demo_speech(), demo_script()
    results: dict[str, Any] = {}
    for decoder in ("greedy", "beam"):
        cfg = ASRConfig(backend="fastconformer", model=ref, decoder=decoder)
        first = FastConformerASR(model, tokenizer, replace(cfg, lookahead_ms=lookaheads[0]), name=ref,
                                 checkpoint=checkpoint)
        offline = [offline_text(first, lp) for lp in logprobs]
        part: dict[str, Any] = {"offline_full_context": _scores(refs, offline, wer, cer)}
        if first.beam is not None:
            own_lm = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / LM_FILE
            part["word_lm"] = str(own_lm) if first.beam.lm is not None else None
            part["options"] = asdict(first.beam.options)
        streaming: dict[str, Any] = {}
        demo: dict[str, Any] = {}
        for ms in lookaheads:
            asr = FastConformerASR(model, tokenizer, replace(cfg, lookahead_ms=ms), name=ref, checkpoint=checkpoint)
            status(f"{decoder}, streaming at look-ahead {ms} ms: {len(rows)} utterances ...")
            waits: list[float] = []
            hyps = [stream_transcript(asr, a, waits) for a in audios]
            streaming[str(ms)] = {**_scores(refs, hyps, wer, cer), "word_wait_s": _wait_summary(waits)}
            demo_waits: list[float] = []
            demo_hyp = stream_transcript(asr, speech, demo_waits)
            demo[str(ms)] = {"wer": round(100 * wer([script], [demo_hyp]), 2), "transcript": normalize(demo_hyp),
                             "word_wait_s": _wait_summary(demo_waits)}
            if ms == lookaheads[0]:
                part["by_engine"] = {f"streaming_{ms}_ms": by_engine(rows, refs, hyps, wer, cer),
                                     "offline_full_context": by_engine(rows, refs, offline, wer, cer)}
        smallest = str(lookaheads[0])
        gap = streaming[smallest]["wer"] - part["offline_full_context"]["wer"]
        part.update(
            streaming=streaming,
            demo_sample_by_lookahead_ms=demo,
            targets={
                "heldout_wer_at_smallest_lookahead": at_most(streaming[smallest]["wer"], 15.0),
                "heldout_cer_at_smallest_lookahead": at_most(streaming[smallest]["cer"], 5.0),
                "streaming_minus_offline_wer_points": at_most(round(gap, 2), 1.0),
                "demo_sample_wer": at_most(demo[smallest]["wer"], 10.0),
            },
        )
        results[decoder] = part
    results["demo_script"] = normalize(script)
    return {"model": ref, "utterances": len(rows), "heldout_hours": round(sum(len(a) for a in audios) / SAMPLE_RATE
            / 3600, 3), "lookaheads_ms": lookaheads, "chunk_ms": CHUNK_MS, **results}


def chosen_lookaheads(trained: list[int], asked: str | None, ref: str) -> list[int]:
    """The look-aheads (ms) of `trained` that `--lookaheads-ms` names (None: all of them), in ascending order."""
    if asked is None:
        return trained
    try:
        picked = sorted({int(x) for x in asked.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--lookaheads-ms: expected look-aheads in ms like 0,240, got {asked!r}") from None
    if not picked or set(picked) - set(trained):
        raise ConfigError(f"--lookaheads-ms {asked}: {ref} streams at {', '.join(map(str, trained))} ms only")
    return picked


def by_engine(rows: list[dict[str, Any]], refs: list[str], hyps: list[str], wer: Callable,
              cer: Callable) -> dict[str, dict[str, float]]:
    """{engine: {"utterances", "wer", "cer"}} over the rows of each synthesiser (`"unknown"` when a manifest row
    names none), each rate pooled over its own rows as the overall one is."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(str(row.get("engine", "unknown")), []).append(i)
    return {name: {"utterances": len(idx), **_scores([refs[i] for i in idx], [hyps[i] for i in idx], wer, cer)}
            for name, idx in sorted(groups.items())}


def _read(path: Path) -> np.ndarray:
    audio, rate = soundfile.read(path, dtype="float32")
    if rate != SAMPLE_RATE or audio.ndim != 1:
        raise ConfigError(f"{path}: expected 16 kHz mono audio, got {rate} Hz with shape {audio.shape}")
    return audio


def _scores(refs: list[str], hyps: list[str], wer: Callable, cer: Callable) -> dict[str, float]:
    return {"wer": round(100 * wer(refs, hyps), 2), "cer": round(100 * cer(refs, hyps), 2)}
