"""The `systems` table of `runtime bench asr-quality` (issue 22): one row per (system, set), every system scored
on the same clips with the same text normalisation and the same clock, and the issue's targets computed from
the rows of the same run.

Systems (`--systems`, default all): `whisper-offline` (tiny.en greedy over the whole clip, padded to 30 s: the
ceiling), `causal-whisper-<ms>ms` (the block-causal stream at each `--chunks` size, `--adapter` merged),
`causal-whisper-<ms>ms+decoder` / `+offline` (kind `two-pass`: the same stream, each committed clip decoded once
more by its own decoder over all its frames / by the offline ceiling's model: `asr.final_pass`; the causal rows
run the stream as the `whisper-tiny-en` profile does (its token budget, look-back, loop rule, resets, decoders'
weights and `refresh_ms`, which `--refresh-ms` overrides), the offline pass in its dtype and window too),
`whisper-buffered-1s` (LocalAgreement-2 re-decoding every 1 s), `faster-whisper-int8` (CTranslate2 int8 on the
same tiny.en folder, offline, one greedy pass, 2 threads: the speed peer; a row with a `reason` when the package
is missing) and `fastconformer` (the shipped model under the demo profile's ASR settings). Sets: `synthetic`
(the held-out set; `--quick` keeps its first QUICK_UTTERANCES) and `human` (`--human DIR`, default
`../shared/speech/dev` beside the repository: people reading, for development only); a missing set gives rows
with a `reason`.

Each row: `wer`/`cer` (percent, pooled over the clips, after `text_norm.normalize`), `compute_s_per_audio_s`
(wall seconds inside the system's calls / audio seconds; torch on `--threads` threads, faster-whisper on 2;
each system first warmed up on one second of audio, untimed; with `--repeats N` each clip runs N times and its
fastest run counts, so that another process's load on the machine, which only ever adds time, moves the ratios
between systems less) and, for the streaming systems, `word_latency_s`
(`word_latency.py` says exactly what it measures; offline systems: null with a reason). Targets compare WER on
the human set and compute pooled over every clip of both sets.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from runtime.bench.timing import at_most
from runtime.chunks import SAMPLE_RATE
from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.profile_files import load_profile
from runtime.train.text_norm import cer, wer

T = TypeVar("T")

if TYPE_CHECKING:
    from runtime.models.asr.base import StreamingASR

WHISPER = "builtin:whisper-tiny.en"
KINDS = ("offline", "causal", "two-pass", "previewed", "buffered", "faster-whisper", "fastconformer", "captions",
         "multilingual")
FINAL_PASSES = ("decoder", "offline")
CHUNKS = (100, 200, 300)
OFFLINE, BUFFERED = "whisper-offline", "whisper-buffered-1s"
FASTER, FASTCONFORMER = "faster-whisper-int8", "fastconformer"
QUICK_UTTERANCES = 4  # --quick: every system on the first 4 held-out clips and the whole human set (the targets')
FW_THREADS = 2
OFFLINE_TOKENS = 224  # openai-whisper's sample length: half the decoder's 448 positions


def stream_adapter(args: argparse.Namespace, ref: str, profile_adapter: str) -> str:
    """The adapter the causal stream of `ref` runs with: `--adapter` (`none`: the bare block-causal Whisper), else
    the whisper-tiny-en profile's (`profile_adapter`) when `ref` is the profile's Whisper, or the whisper-base
    profile's when it is that one's, as a session runs it; any other Whisper has no adapter trained for it."""
    asked = getattr(args, "adapter", None)
    if asked is not None:
        return "" if asked.strip().lower() in ("", "none") else asked
    if ref == WHISPER:
        return profile_adapter
    base = load_profile("whisper-base").asr
    return base.adapter if ref == base.model else ""


def stream_reads_on(ref: str, profile_reads_on: bool) -> bool:
    """Whether the captions of `ref` read on from the turn before (`asr.final_pass_read_on`): the whisper-tiny-en
    profile's (`profile_reads_on`), or the whisper-base profile's when `ref` is that one's Whisper, as a session runs
    it."""
    base = load_profile("whisper-base").asr
    return base.final_pass_read_on if ref == base.model else profile_reads_on


def causal_id(ms: int, final_pass: str = "", preview: int = 0) -> str:
    return f"causal-whisper-{ms}ms" + (f"-preview{preview}ms" if preview else "") + (
        f"+{final_pass}" if final_pass else "")


def target_key(ms: int, final_pass: str = "", preview: int = 0) -> str:
    return f"causal_{ms}ms" + (f"_preview{preview}ms" if preview else "") + (f"+{final_pass}" if final_pass else "")


def variants(kinds: list[str], chunks: list[int], preview: int) -> list[tuple[int, str, int]]:
    """(chunk ms, final pass, preview ms) of every causal row the kinds ask for: `causal` the stream alone,
    `two-pass` with each final pass, `previewed` the stream alone and with the offline pass, previewed every
    `preview` ms, for each chunk size that `preview` divides and is smaller than."""
    out = [(ms, "", 0) for ms in chunks] if "causal" in kinds else []
    out += [(ms, p, 0) for p in FINAL_PASSES for ms in chunks] if "two-pass" in kinds else []
    if "previewed" in kinds and preview > 0:
        out += [(ms, p, preview) for p in ("", "offline") for ms in chunks if ms > preview and ms % preview == 0]
    return out


@dataclass
class EvalSet:
    name: str
    audios: list[np.ndarray]
    refs: list[str]
    reason: str = ""  # why the set is absent


def selection(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """(system kinds, causal chunk sizes) from `--systems`/`--chunks`; a Whisper with random weights is refused."""
    kinds = [k.strip() for k in (getattr(args, "systems", None) or ",".join(KINDS)).split(",") if k.strip()]
    if unknown := [k for k in kinds if k not in KINDS]:
        raise ConfigError(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    try:
        chunks = [int(c) for c in (getattr(args, "chunks", None) or ",".join(map(str, CHUNKS))).split(",")]
    except ValueError:
        raise ConfigError(f"--chunks: expected sizes in ms like 100,200,300, got {args.chunks!r}") from None
    if any(c <= 0 or c % 20 for c in chunks):
        raise ConfigError(f"--chunks: each must be a positive multiple of 20 ms, got {chunks}")
    preview = getattr(args, "preview_ms", 0) or 0
    if "previewed" in kinds and (preview <= 0 or preview % 20 or not variants(["previewed"], chunks, preview)):
        raise ConfigError(f"--preview-ms: a positive multiple of 20 ms that divides a --chunks size and is smaller, "
                          f"got {preview} for chunks {chunks}")
    from runtime.models.loading import cache_dir, resolve_checkpoint

    ref = getattr(args, "whisper", None) or WHISPER  # every run loads it: the offline transcripts time the words
    if ref.startswith("tiny:") or resolve_checkpoint(ref, role="asr").resolve().is_relative_to(
            (cache_dir() / "tiny").resolve()):
        raise ConfigError(f"--whisper {ref} has random weights: its error rates mean nothing; score a trained "
                          "checkpoint")
    return kinds, chunks


def human_set(args: argparse.Namespace, read: Callable[[Path], np.ndarray]) -> EvalSet:
    """`--human DIR`, else `../shared/speech/dev` beside the repository: manifest.jsonl of {id, path, text}."""
    repo = Path(__file__).resolve().parents[2]
    folder = Path(getattr(args, "human", None) or repo.parent / "shared/speech/dev").expanduser()
    manifest = folder / "manifest.jsonl"
    if not manifest.is_file():
        return EvalSet("human", [], [], f"{manifest} not found (pass --human DIR with a manifest.jsonl)")
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    if not rows:
        return EvalSet("human", [], [], f"{manifest} lists no clips")
    return EvalSet("human", [read(folder / r["path"]) for r in rows], [r["text"] for r in rows])


def _row(s: EvalSet, hyps: list[str], compute: float) -> dict[str, Any]:
    audio_s = sum(len(a) for a in s.audios) / SAMPLE_RATE
    return {"utterances": len(s.audios), "audio_s": round(audio_s, 2), "wer": round(100 * wer(s.refs, hyps), 2),
            "cer": round(100 * cer(s.refs, hyps), 2), "compute_s": round(compute, 3),
            "compute_s_per_audio_s": round(compute / audio_s, 4)}


def fastest(run: Callable[[], tuple[T, float]], repeats: int = 1) -> tuple[T, float]:
    """The one of `repeats` runs (result, seconds) that took the fewest seconds."""
    return min((run() for _ in range(max(1, repeats))), key=lambda r: r[1])


def timed_map(fn: Callable[[np.ndarray], T], audios: list[np.ndarray], repeats: int = 1) -> tuple[list[T], float]:
    """(fn(audio) for each audio, seconds spent inside fn: each audio's fastest of `repeats` runs)."""
    def timed(audio: np.ndarray) -> tuple[T, float]:
        began = time.perf_counter()
        out = fn(audio)
        return out, time.perf_counter() - began

    outs, compute = [], 0.0
    for audio in audios:
        out, spent = fastest(partial(timed, audio), repeats)
        outs.append(out)
        compute += spent
    return outs, compute


def offline_row(s: EvalSet, hyps: list[str], compute: float) -> dict[str, Any]:
    return {**_row(s, hyps, compute), "word_latency_s": None,
            "word_latency_reason": "offline: the transcript exists only once the whole clip is heard"}


def streaming_row(s: EvalSet, asr: StreamingASR, ends: list[list[tuple[str, float]]], *, whole_words: bool = False,
                  repeats: int = 1) -> dict[str, Any]:
    from runtime.bench.word_latency import latencies, summary, timed_stream, transcript, word_times

    hyps, compute = [], 0.0
    lat: dict[str, list[float]] = {"shown": [], "final": [], "shown_media": [], "final_media": []}
    for audio, clip_ends in zip(s.audios, ends, strict=True):
        timed, spent = fastest(partial(timed_stream, asr, audio), repeats)
        compute += spent
        hyps.append(transcript(timed))
        for key, values in latencies(clip_ends, word_times(timed, whole_words=whole_words)).items():
            lat[key] += values
    return {**_row(s, hyps, compute), "word_latency_s": summary(lat)}


def build(args: argparse.Namespace, sets: list[EvalSet], kinds: list[str], chunks: list[int], *, fc_ref: str,
          device: str, dtype: str, status: Callable[[str], None], shared: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    """{"systems": {system: {set: row}}, "system_settings", "sets", "targets"}. `shared` gets the models loaded
    here for other reports to reuse: `offline` (the ceiling's decoder), and where built `causal` (the stream's
    model), `pass` (the offline final pass: decoder and graph search)."""
    shared = {} if shared is None else shared
    from runtime.bench.word_latency import Aligner, timed_stream
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR, offline_decoder
    from runtime.models.asr.causal_whisper.final_pass import DecoderPass, FinalPass, OfflinePass
    from runtime.models.asr.causal_whisper.graph_choice import pass_graph
    from runtime.models.asr.registry import load_asr
    from runtime.models.asr.whisper_buffered import WhisperBuffered
    from runtime.models.asr.whisper_checkpoint import whisper_path
    from runtime.models.asr.whisper_ct2 import is_ct2_whisper_dir
    from runtime.models.loading import resolve_checkpoint, resolve_dtype

    present = [s for s in sets if not s.reason]
    repeats = getattr(args, "repeats", 1)
    warm = present[0].audios[0][:SAMPLE_RATE] if present else np.zeros(SAMPLE_RATE, np.float32)
    ref = getattr(args, "whisper", None) or WHISPER
    table: dict[str, dict[str, Any]] = {}
    settings: dict[str, str] = {}

    def each(system: str, row: Callable[[EvalSet], dict[str, Any]]) -> None:
        table[system] = {}
        for s in sets:
            if not s.reason:
                status(f"{system} on {s.name}: {len(s.audios)} clips ...")
            table[system][s.name] = {"utterances": 0, "reason": s.reason} if s.reason else row(s)

    def streamed(system: str, asr: StreamingASR, *, whole_words: bool = False) -> None:
        timed_stream(asr, warm)
        each(system, lambda s: streaming_row(s, asr, ends[s.name], whole_words=whole_words, repeats=repeats))

    buffered = load_asr(ASRConfig(backend="whisper-buffered", model=ref, step_s=1.0), device=device, dtype=dtype,
                        progress=status)
    offline = WhisperBuffered(buffered.model, buffered.tokenizer, buffered.feature_extractor,
                              replace(buffered.cfg, max_new_tokens=OFFLINE_TOKENS), name=ref)
    offline.hypothesis(warm)
    shared["offline"] = offline
    status(f"offline {ref} on {', '.join(s.name for s in present) or 'no set'} ...")
    reference = {s.name: timed_map(offline.hypothesis, s.audios, repeats) for s in present}
    settings[OFFLINE] = f"{ref}, greedy over the whole clip (padded to 30 s, cut there), <= {OFFLINE_TOKENS} tokens"
    if "offline" in kinds:
        each(OFFLINE, lambda s: offline_row(s, [offline.text(i) for i in reference[s.name][0]],
                                            reference[s.name][1]))
    ends: dict[str, list[list[tuple[str, float]]]] = {}
    if {"causal", "two-pass", "previewed", "buffered", "fastconformer"} & set(kinds):
        status("word end times: aligning the offline transcripts ...")
        aligner = Aligner(offline, whisper_path(ref))
        ends = {s.name: [aligner.word_ends(a, ids) for a, ids in zip(s.audios, reference[s.name][0], strict=True)]
                for s in present}
    preview = getattr(args, "preview_ms", 0) or 0
    rows = variants(kinds, chunks, preview)
    if rows:  # causal, two-pass, previewed
        # as the whisper-tiny-en profile runs them: its stream's settings (token budget, look-back, loop rule,
        # resets, re-feeds), its decoders' weights, its offline pass's dtype and window; the Whisper and adapter given
        profile = load_profile("whisper-tiny-en").asr
        profile = replace(profile, graph_runtime=getattr(args, "graph_runtime", None) or profile.graph_runtime)
        refresh = getattr(args, "refresh_ms", None)
        cfg = replace(profile, model=ref, chunk_ms=chunks[0], adapter=stream_adapter(args, ref, profile.adapter),
                      preview_ms=0, final_pass="none", refresh_ms=profile.refresh_ms if refresh is None else refresh)
        first = load_asr(cfg, device=device, dtype=dtype, progress=status)
        shared["causal"] = first
        passes: dict[str, FinalPass | None] = {"": None}
        search = None
        head = f", head {profile.head_weights}" if profile.head_weights else ""
        head += f", decoder {profile.decoder_weights}" if profile.decoder_weights != "float" else ""
        if first.onnx_step is not None:  # the graph quantises the head with the layers (asr.graph_runtime)
            head = (", the stream's layers as ONNX Runtime graphs"
                    + (", encoder 8-bit" if profile.encoder_weights == "int8" else "")
                    + (", decoder and head 8-bit" if profile.decoder_weights == "int8" else ""))
        if any(p for _, p, _ in rows):
            pass_dtype = resolve_dtype(profile.final_pass_dtype, device) or dtype
            window = profile.final_pass_window_s
            beams = getattr(args, "final_pass_beam", None)
            beams = profile.final_pass_beam if beams is None else beams
            second = offline_decoder(copy.deepcopy(offline.model), offline.tokenizer, whisper_path(ref),
                                     replace(offline.cfg, max_new_tokens=OFFLINE_TOKENS, head_weights=
                                             profile.head_weights, decoder_weights=profile.decoder_weights,
                                             final_pass_window_s=window, final_pass_beam=beams), device,
                                     pass_dtype)
            # the pass's greedy search on a graph of the checkpoint's decoder where the stream runs graphs
            search = (pass_graph(copy.deepcopy(offline.model), second, cfg, device, status)
                      if first.onnx_step and beams == 1 else None)
            passes.update({"decoder": DecoderPass(), "offline": OfflinePass(second, search)})
            shared["pass"] = (second, search)
        for ms, name, every in rows:
            each_cfg = replace(cfg, chunk_ms=ms, final_pass=name or "none", preview_ms=every)
            final = OfflinePass(second, search) if name == "offline" else passes[name]  # its own count of loops
            asr = CausalWhisperASR(first.model, first.tokenizer, each_cfg, name=first.name, final_pass=final,
                                   onnx_step=first.onnx_step, encoder_graph=first.encoder_graph)
            settings[causal_id(ms, name, every)] = (
                f"{ref}, block-causal, {ms} ms chunks, look-back {cfg.lookback_tokens} tokens, adapter "
                f"{cfg.adapter or 'none'}{head}, {cfg.max_new_tokens} tokens an item"
                + (f", stale positions re-fed after {cfg.refresh_ms} ms" if cfg.refresh_ms else "")
                + (f", previewed every {every} ms" if every else "")
                + (f", final pass {name} at the end of each clip" if name else "")
                + (f" ({pass_dtype}, {window:g} s windows, "
                   f"{'greedy' if beams == 1 else f'{beams} beams'}"
                   f"{' on an ONNX Runtime graph' if search and beams == 1 else ''}, a loop decoded again with beams)"
                   if name == "offline" else ""))
            streamed(causal_id(ms, name, every), asr)
            if isinstance(final, OfflinePass):  # counted over every set and repeat, the warm-up clip included
                settings[causal_id(ms, name, every)] += (
                    f"; items that looped: {final.retried} decoded again with beams, {final.kept_stream} kept the "
                    "stream's text" + (f" (over the {repeats} runs of each clip)" if repeats > 1 else ""))
    if "buffered" in kinds:
        settings[BUFFERED] = (f"{ref}, LocalAgreement-2, re-decoded every {buffered.cfg.step_s:g} s, items of "
                              f"{buffered.cfg.segment_s:g} s")
        streamed(BUFFERED, buffered)
    if "faster-whisper" in kinds:
        path = resolve_checkpoint(ref, role="asr")
        fw, why = faster_whisper(path if is_ct2_whisper_dir(path) else None,
                                 f"{ref} is not a CTranslate2 folder: faster-whisper cannot load it")
        settings[FASTER] = f"faster-whisper on {path}: int8, cpu_threads={FW_THREADS}, beam 1, offline"
        if fw is None:
            table[FASTER] = {s.name: {"utterances": 0, "reason": s.reason or why} for s in sets}
        else:
            fw(warm)
            each(FASTER, lambda s: offline_row(s, *timed_map(fw, s.audios, repeats)))
    if "fastconformer" in kinds:
        cfg = replace(load_profile("fastconformer").asr, model=fc_ref)
        settings[FASTCONFORMER] = f"{fc_ref}, look-ahead {cfg.lookahead_ms} ms, {cfg.decoder} decoder (its profile)"
        streamed(FASTCONFORMER, load_asr(cfg, device=device, dtype=dtype, progress=status),
                 whole_words=cfg.decoder == "beam")
    return {"systems": table, "system_settings": settings, "targets": targets(table, chunks, preview),
            "sets": {s.name: {"reason": s.reason} if s.reason else
                     {"utterances": len(s.audios), "audio_s": round(sum(map(len, s.audios)) / SAMPLE_RATE, 2)}
                     for s in sets}}


def targets(table: dict[str, dict[str, Any]], chunks: list[int], preview: int = 0) -> dict[str, Any]:
    """The issue's targets, each `at_most` with the figures it was computed from (missing ones are not met). A
    previewed row is held to the latency of its preview cadence (what a user sees every `preview` ms) and to the
    stricter of its chunk's and its cadence's WER bounds (its text is its chunk's stream's)."""
    def get(system: str, key: str) -> float | None:
        return table.get(system, {}).get("human", {}).get(key)

    def pooled(system: str) -> float | None:
        rows = [r for r in table.get(system, {}).values() if r.get("compute_s") is not None]
        audio = sum(r["audio_s"] for r in rows)
        return round(sum(r["compute_s"] for r in rows) / audio, 4) if audio else None

    def ratio(a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return None
        return round(a / b, 3) if b > 0 else (1.0 if a == 0 else None)

    out: dict[str, Any] = {}
    offline = get(OFFLINE, "wer")
    rows = [(ms, p, 0) for p in ("", *FINAL_PASSES) for ms in chunks if p == "" or causal_id(ms, p) in table]
    rows += [(ms, p, preview) for p in ("", "offline") for ms in chunks if preview and causal_id(ms, p, preview)
             in table]
    bounds = {300: 1.25, 100: 1.5}  # as WER <= bound x offline WER: defined when offline is 0 %
    bounded = [(ms, p, 0) for p in ("", *FINAL_PASSES) for ms in bounds if p == "" or causal_id(ms, p) in table]
    for ms, p, v in bounded + [r for r in rows if r[2] in bounds]:
        bound = min(bounds[v or ms], bounds.get(ms, bounds[v or ms]))
        wer_ = get(causal_id(ms, p, v), "wer")
        limit = None if offline is None else round(bound * offline, 2)
        out[f"{target_key(ms, p, v)}_human_wer_within_{bound:g}x_offline"] = {
            "value": wer_, "target": None if limit is None else f"<= {limit:g}",
            "met": wer_ is not None and limit is not None and wer_ <= limit, "offline_wer": offline,
            "ratio": ratio(wer_, offline)}
    buffered_wer, buffered_cost, fw_cost = get(BUFFERED, "wer"), pooled(BUFFERED), pooled(FASTER)
    for ms, p, v in rows:
        system, key = causal_id(ms, p, v), target_key(ms, p, v)
        wer_, cost = get(system, "wer"), pooled(system)
        gap = None if wer_ is None or buffered_wer is None else round(wer_ - buffered_wer, 2)
        words = table.get(system, {}).get("human", {}).get("word_latency_s") or {}
        latency = (words.get("shown") or {}).get("median")
        out[f"{key}_human_wer_minus_buffered_points"] = {**at_most(gap, 0.0), "causal_wer": wer_,
                                                         "buffered_wer": buffered_wer}
        out[f"{key}_compute_over_buffered"] = {**at_most(ratio(cost, buffered_cost), 0.2), "causal": cost,
                                               "buffered": buffered_cost}
        out[f"{key}_human_median_word_latency_s"] = {**at_most(latency, round(((v or ms) + 300) / 1000, 3)),
                                                     "words_timed": words.get("words_timed", 0)}
        out[f"{key}_compute_over_faster_whisper"] = {**at_most(ratio(cost, fw_cost), 3.0), "causal": cost,
                                                     "faster_whisper": fw_cost}
    return out


def faster_whisper(ct2: Path | None, reason: str, *, long_form: bool = False
                   ) -> tuple[Callable[[np.ndarray], str] | None, str]:
    """faster-whisper's offline greedy transcriber for the CTranslate2 folder `ct2`, or (None, why not). `long_form`:
    each 30 s window conditioned on the text before it (its default for files longer than a window)."""
    try:
        from faster_whisper import WhisperModel
    except ImportError:
        return None, "faster_whisper is not installed (pip install faster-whisper)"
    if ct2 is None:
        return None, reason
    model = WhisperModel(str(ct2), device="cpu", compute_type="int8", cpu_threads=FW_THREADS)

    def transcribe(audio: np.ndarray) -> str:  # one greedy pass: no temperature fallback, no timestamps, no VAD
        segments, _ = model.transcribe(audio, beam_size=1, temperature=0.0, without_timestamps=not long_form,
                                       condition_on_previous_text=long_form)
        return "".join(seg.text for seg in segments)

    return transcribe, ""
