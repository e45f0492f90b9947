"""The `captions` rows of `runtime bench asr-quality` (issue 53): captions as a session makes them, over audio that
turn detection cuts into turns, where the ASR alone on a whole clip (`asr_systems.py`) cannot show what matters:

- `non_speech`: the generated set of `non_speech.py` (silence, room, coloured noise, tones, chords, clicks, a
  cough): the words a caption showed (stable text, unstable tail and completed transcripts; the most an item
  ever showed), which must be 0; beside it the same stream without the gate, and faster-whisper (its own
  no-speech rule, greedy) on the same clips.
- `gate_words_lost`: the speech sets through the same session path with the gate (the VAD's minimum speech and
  Whisper's no-speech probability) and without it: the words the gated captions lack, and the WER of both.
- `long_form`: human reading assembled from the development clips (each clip once, in the manifest's order,
  with reader-like pauses drawn from a seeded generator: `LEAD_S`, `PAUSE_S`, `TAIL_S`, never tuned to the
  clips), streamed as `runtime transcribe` does (Silero VAD turns at the captioner's 300 ms pauses, one ASR
  stream per turn) with the turns before as context and without, against offline Whisper tiny.en on the same
  file (one greedy pass over the whole file: it fits Whisper's 30 s) and faster-whisper's long-form decoding.
  The full run adds a synthetic long form (the held-out clips, `LONG_SYNTHETIC` of them, several voices: it
  exceeds 30 s, so its offline peer is faster-whisper's sequential 30 s windows alone), and `long_form_reading`:
  one passage (`READING`, twelve sentences whose names and phrases come back) read from start to end by each of two
  held-out synthetic voices (`READERS`), a sentence at a time with the same pauses: continuous reading of minutes,
  which the human development set does not hold, against the same peer.

Each session is an `AudioProcessor` with `TurnTaking` on a `DeviceWorker`, fed 100 ms chunks unpaced: the code a
session runs, without a transport. Compute is the wall time of the whole run (VAD, ASR and final passes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.train.text_norm import normalize, wer

if TYPE_CHECKING:
    from runtime.models.asr.base import ASRStream, StreamingASR
    from runtime.pipeline.turn_taking import TurnModels

CHUNK_MS = 100
LEAD_S, PAUSE_S, TAIL_S = 0.5, (0.4, 1.0), 1.5  # silence before, between (uniform) and after the clips
SEED = 53
LONG_SYNTHETIC = 40  # held-out clips in the full run's synthetic long form
# One passage read aloud from start to end, a sentence at a time with a reader's pauses: where the synthetic long
# form's sentences are unrelated, this one's names and phrases come back (what the turns' context is for). Written
# for this bench (no published text), never tuned to: the rows report whatever the readers make of it.
READING = (
    "Every morning the ferry leaves the old harbor at half past six.",
    "Captain Ilse Marwood checks the ropes herself before the first passengers arrive.",
    "She has crossed this water for nineteen years, and she still counts the gulls on the breakwater.",
    "The ferry carries bakers, nurses and students, and on Thursdays a man who sells bicycles.",
    "He always asks Captain Marwood about the weather on the far shore.",
    "The far shore is only four miles away, but the wind there is different.",
    "When the fog comes down, the ferry waits at the harbor until the lighthouse can be seen again.",
    "Nobody complains, because everyone knows the captain is careful.",
    "In the spring the harbor council painted the ferry blue and white.",
    "The bicycle seller said it looked like a cloud that had learned to swim.",
    "Captain Marwood laughed and wrote his words in the ship's log.",
    "Tomorrow the ferry will leave the old harbor at half past six, as it always does.",
)
READERS = ("espeak:en-us+m6", "flite:rms")  # held-out voices (synthesizers.HELDOUT_*): never in the adapter's data


@dataclass
class Captioned:
    """What a session showed for one audio: each item's completed transcript, and the most words it ever showed."""

    transcripts: list[str] = field(default_factory=list)
    words_shown: int = 0
    turns: int = 0
    compute_s: float = 0.0
    read_on: int = 0  # turns whose transcript the final pass read on from the turn before (final_pass.py)

    @property
    def text(self) -> str:
        return " ".join(t.strip() for t in self.transcripts if t.strip())


class _NoContext:
    """A stream that ignores the turns before it (the `long_form` row without context)."""

    def __init__(self, stream: ASRStream) -> None:
        self._stream = stream

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        pass

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - the wrapped stream's own methods
        return getattr(self._stream, name)


def caption(asr: StreamingASR, turn_models: TurnModels, audio: np.ndarray, *, gate: bool = True,
            context: bool = True) -> Captioned:
    """`audio` through a session's audio path (module docstring); `gate` False: no speech gate and no final-pass
    no-speech rule; `context` False: each turn's stream without the turns before."""
    from runtime.models.asr.causal_whisper.final_pass import NO_SPEECH, OfflinePass

    final = getattr(asr, "final_pass", None)
    threshold = final.no_speech if isinstance(final, OfflinePass) else None
    if isinstance(final, OfflinePass):
        final.no_speech = NO_SPEECH if gate else float("inf")
    read_on = final.read_on if isinstance(final, OfflinePass) else 0
    try:
        began = time.perf_counter()
        out = asyncio.run(_session(asr, turn_models, audio, gate, context))
        out.compute_s = time.perf_counter() - began
        out.read_on = final.read_on - read_on if isinstance(final, OfflinePass) else 0
        return out
    finally:
        if isinstance(final, OfflinePass) and threshold is not None:
            final.no_speech = threshold


async def _session(asr: StreamingASR, turn_models: TurnModels, audio: np.ndarray, gate: bool,
                   context: bool) -> Captioned:
    from runtime.channels import BlockingChannel
    from runtime.events import Event, TranscriptionCompleted, TranscriptionDelta
    from runtime.memory.conversation import Conversation
    from runtime.pipeline.audio import AudioProcessor, BufferEnd
    from runtime.pipeline.turn_taking import TurnTaking
    from runtime.session_config import CAPTIONS, SessionConfig
    from runtime.session_state import AnswerActivity, ContextChanges, HeardClock, SessionSettings
    from runtime.worker import DeviceWorker

    out = Captioned()
    stable: dict[str, str] = {}
    most: dict[str, int] = {}

    async def emit(event: Event) -> None:
        if isinstance(event, TranscriptionDelta):
            stable[event.item_id] = stable.get(event.item_id, "") + event.delta
            shown = len((stable[event.item_id] + event.unstable).split())
            most[event.item_id] = max(most.get(event.item_id, 0), shown)
        elif isinstance(event, TranscriptionCompleted):
            out.transcripts.append(event.transcript)
            most[event.item_id] = max(most.get(event.item_id, 0), len(event.transcript.split()))

    def open_asr() -> ASRStream:
        stream = asr.open_stream()
        return stream if context else _NoContext(stream)  # type: ignore[return-value]

    settings = SessionSettings(SessionConfig(turn_detection=CAPTIONS))
    step = SAMPLE_RATE * CHUNK_MS // 1000
    channel: BlockingChannel[AudioChunk | BufferEnd] = BlockingChannel(8, "audio")
    with DeviceWorker() as worker:
        processor = AudioProcessor(channel, open_asr, worker, emit, Conversation(), HeardClock(), ContextChanges(),
                                   turns=TurnTaking(turn_models, settings, AnswerActivity()), speech_gate=gate,
                                   reads_on=settings.config.captions_only if context else None)
        task = asyncio.create_task(processor.run())
        for start in range(0, len(audio), step):
            await channel.put(AudioChunk(audio[start : start + step], start))
        channel.close()
        await task
    out.words_shown, out.turns = sum(most.values()), processor.commits
    return out


def long_form(clips: list[tuple[np.ndarray, str]], seed: int = SEED) -> tuple[np.ndarray, str]:
    """The clips read one after another with reader-like pauses (module docstring), and the joined reference."""
    rng = np.random.default_rng(seed)
    pieces = [np.zeros(round(LEAD_S * SAMPLE_RATE), np.float32)]
    for i, (audio, _) in enumerate(clips):
        if i:
            pieces.append(np.zeros(round(rng.uniform(*PAUSE_S) * SAMPLE_RATE), np.float32))
        pieces.append(audio.astype(np.float32))
    pieces.append(np.zeros(round(TAIL_S * SAMPLE_RATE), np.float32))
    return np.concatenate(pieces), " ".join(text for _, text in clips)


def reading(voice_id: str, seed: int = SEED) -> tuple[np.ndarray, str]:
    """`READING` read by one voice (`engine:name`), every sentence with the same prosody drawn once (one reader, one
    pace), joined like `long_form` with a reader's pauses; raises RuntimeError when the synthesiser is missing."""
    from runtime.train.synthesizers import Voice, resample, synthesize

    engine, name = voice_id.split(":", 1)
    voice = Voice(engine, name)
    said = []
    for sentence in READING:
        audio, rate, _ = synthesize(voice, sentence, np.random.default_rng(seed))
        said.append((resample(audio, rate, SAMPLE_RATE), sentence))
    return long_form(said, seed)


def _words(text: str) -> int:
    return len(normalize(text).split())


def heard(ref: str, hyp: str) -> int:
    """Reference words the hypothesis has, in order (the longest common subsequence of the normalised words): what
    a gate that drops words can lose, where a dropped "you" over silence is no loss."""
    a, b = normalize(ref).split(), normalize(hyp).split()
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def non_speech_rows(asr: StreamingASR, turn_models: TurnModels, quick: bool,
                    faster: Callable[[np.ndarray], str] | None, faster_reason: str) -> dict[str, Any]:
    """Words shown on each non-speech clip by the gated session path, the same path without the gate, and
    faster-whisper."""
    from runtime.bench.non_speech import non_speech_set

    clips = non_speech_set(quick)
    gated = {name: caption(asr, turn_models, audio) for name, audio in clips}
    ungated = {name: caption(asr, turn_models, audio, gate=False) for name, audio in clips}
    row: dict[str, Any] = {
        "clips": len(clips), "audio_s": round(sum(len(a) for _, a in clips) / SAMPLE_RATE, 1),
        "words": sum(c.words_shown for c in gated.values()),
        "by_clip": {name: {"words": c.words_shown, "text": c.text} for name, c in gated.items()},
        "without_gate": {"words": sum(c.words_shown for c in ungated.values()),
                         "by_clip": {name: c.text for name, c in ungated.items()}},
    }
    if faster is None:
        row["faster_whisper"] = {"words": None, "reason": faster_reason}
    else:
        texts = {name: faster(audio) for name, audio in clips}
        row["faster_whisper"] = {"words": sum(len(t.split()) for t in texts.values()),
                                 "by_clip": {n: t for n, t in texts.items() if t.strip()}}
    row["target_words"] = {"value": row["words"], "target": "== 0", "met": row["words"] == 0}
    return row


def gate_rows(asr: StreamingASR, turn_models: TurnModels, sets: list[tuple[str, list[np.ndarray], list[str]]],
              gated_runs: dict[str, list[Captioned]] | None = None) -> dict[str, Any]:
    """Per speech set, gated and ungated: `words_lost`, the reference words the ungated captions have and the gated
    ones lack (`heard`); `words_removed`, every word the gate took (a "you" over a pause included); both WERs.
    `gated_runs`: a set's gated captions already made (the long form's)."""
    rows: dict[str, Any] = {}
    for name, audios, refs in sets:
        if not audios:
            continue
        gated = (gated_runs or {}).get(name) or [caption(asr, turn_models, a) for a in audios]
        ungated = [caption(asr, turn_models, a, gate=False) for a in audios]
        pairs = list(zip(refs, gated, ungated, strict=True))
        rows[name] = {"utterances": len(audios), "reference_words": sum(_words(r) for r in refs),
                      "words_lost": sum(max(0, heard(r, u.text) - heard(r, g.text)) for r, g, u in pairs),
                      "words_removed": sum(max(0, _words(u.text) - _words(g.text)) for _, g, u in pairs),
                      "clips_emptied": sum(bool(_words(u.text)) and not _words(g.text) for _, g, u in pairs),
                      "wer_gated": round(100 * wer(refs, [g.text for g in gated]), 2),
                      "wer_ungated": round(100 * wer(refs, [u.text for u in ungated]), 2)}
    return rows


def long_form_row(asr: StreamingASR, turn_models: TurnModels, audio: np.ndarray, ref: str,
                  offline: Callable[[np.ndarray], str] | None, faster: Callable[[np.ndarray], str] | None,
                  faster_reason: str, runs: list[Captioned] | None = None) -> dict[str, Any]:
    """Streamed WER with and without the turns' context, and the offline peers' on the same file; `runs` gets the
    streamed captions with context."""
    with_context = caption(asr, turn_models, audio)
    if runs is not None:
        runs.append(with_context)
    without = caption(asr, turn_models, audio, context=False)
    row: dict[str, Any] = {"audio_s": round(len(audio) / SAMPLE_RATE, 2), "reference": normalize(ref)}
    for key, run in (("streamed_with_context", with_context), ("streamed_without_context", without)):
        row[key] = {"wer": round(100 * wer([ref], [run.text]), 2), "turns": run.turns, "turns_read_on": run.read_on,
                    "compute_s_per_audio_s": round(run.compute_s / (len(audio) / SAMPLE_RATE), 4),
                    "transcript": normalize(run.text)}
    if offline is not None:
        text = offline(audio)
        row["whisper_offline"] = {"wer": round(100 * wer([ref], [text]), 2), "transcript": normalize(text)}
    if faster is not None:
        text = faster(audio)
        row["faster_whisper_long_form"] = {"wer": round(100 * wer([ref], [text]), 2), "transcript": normalize(text)}
    else:
        row["faster_whisper_long_form"] = {"wer": None, "reason": faster_reason}
    peer = row.get("whisper_offline") or row["faster_whisper_long_form"]
    ratio = None
    if peer.get("wer") is not None:
        streamed, base = row["streamed_with_context"]["wer"], peer["wer"]
        ratio = round(streamed / base, 3) if base > 0 else (1.0 if streamed == 0 else None)
    row["target_within_1.25x_offline"] = {"value": ratio, "target": "<= 1.25", "met": ratio is not None and
                                          ratio <= 1.25, "peer": "whisper_offline" if "whisper_offline" in row
                                          else "faster_whisper_long_form"}
    return row


QUICK_GATE_CLIPS = 4  # --quick: the synthetic clips the gate's words lost are counted on


def reading_rows(asr: StreamingASR, turn_models: TurnModels, faster_long: Callable[[np.ndarray], str] | None,
                 reason: str, status: Callable[[str], None]) -> dict[str, Any]:
    """`long_form_row` for `READING` in each of `READERS` (over Whisper's 30 s: the offline peer is faster-whisper's
    sequential windows with previous text, the long-form decoding Whisper was made for)."""
    rows: dict[str, Any] = {}
    for voice in READERS:
        status(f"captions: a passage read by {voice}, with and without the turns' context ...")
        try:
            audio, text = reading(voice)
        except (RuntimeError, OSError) as err:  # the synthesiser is not installed (docs/synthetic_speech.md)
            rows[voice] = {"reason": f"{type(err).__name__}: {err}"}
            continue
        rows[voice] = long_form_row(asr, turn_models, audio, text, None, faster_long, reason)
    return rows


def captions_part(args: Any, sets: list[Any], ref: str, device: str, dtype: str,  # noqa: ANN401 - argparse
                  status: Callable[[str], None], shared: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `captions` report: non-speech, the gate's words lost and long form (module docstring), each with its
    peers, for the two-pass causal stream at 300 ms as the whisper-tiny-en profile runs it (`--whisper`,
    `--adapter` and `--graph-runtime` as for the systems). `shared`: models `asr_systems.build` loaded (reused)."""
    from dataclasses import replace

    from runtime.bench.asr_systems import OFFLINE_TOKENS, faster_whisper, stream_adapter, stream_reads_on
    from runtime.config import ASRConfig
    from runtime.errors import CheckpointNotFound
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
    from runtime.models.asr.causal_whisper.final_pass import OfflinePass
    from runtime.models.asr.registry import load_asr
    from runtime.models.asr.whisper_buffered import WhisperBuffered
    from runtime.models.asr.whisper_ct2 import is_ct2_whisper_dir
    from runtime.models.loading import resolve_checkpoint
    from runtime.models.turns.silero_vad import SileroVAD
    from runtime.pipeline.turn_taking import TurnModels
    from runtime.profile_files import load_profile

    try:
        turn_models = TurnModels(SileroVAD.load())
    except CheckpointNotFound as err:
        return {"reason": f"no voice activity detector: {err}"}
    shared = shared or {}
    profile = load_profile("whisper-tiny-en").asr
    read_on = stream_reads_on(ref, profile.final_pass_read_on)
    cfg = replace(profile, model=ref, chunk_ms=300, preview_ms=0, final_pass="offline",
                  adapter=stream_adapter(args, ref, profile.adapter), final_pass_read_on=read_on,
                  graph_runtime=getattr(args, "graph_runtime", None) or profile.graph_runtime)
    if "causal" in shared and "pass" in shared:  # the systems' stream and offline pass, as the two-pass rows run
        first, (second, search) = shared["causal"], shared["pass"]
        cfg = replace(first.cfg, chunk_ms=300, preview_ms=0, final_pass="offline", final_pass_read_on=read_on)
        asr = CausalWhisperASR(first.model, first.tokenizer, cfg, name=first.name,
                               final_pass=OfflinePass(second, search, read_on=read_on), onnx_step=first.onnx_step,
                               encoder_graph=first.encoder_graph)
    else:
        asr = load_asr(cfg, device=device, dtype=dtype, progress=status)
    path = resolve_checkpoint(ref, role="asr")
    ct2 = path if is_ct2_whisper_dir(path) else None
    why = f"{ref} is not a CTranslate2 folder: faster-whisper cannot load it"
    faster, reason = faster_whisper(ct2, why)
    faster_long, _ = faster_whisper(ct2, why, long_form=True)
    offline = shared.get("offline")
    if offline is None:
        buffered = load_asr(ASRConfig(backend="whisper-buffered", model=ref), device=device, dtype=dtype)
        offline = WhisperBuffered(buffered.model, buffered.tokenizer, buffered.feature_extractor,
                                  replace(buffered.cfg, max_new_tokens=OFFLINE_TOKENS), name=ref)
    quick = bool(args.quick)
    by_name = {s.name: s for s in sets if not s.reason}
    out: dict[str, Any] = {"stream": f"{ref}, 300 ms blocks and the offline final pass as the whisper-tiny-en "
                           f"profile runs them, adapter {cfg.adapter or 'none'}; Silero VAD turns at the "
                           f"captioner's 300 ms pauses, {CHUNK_MS} ms chunks"}
    status("captions: the non-speech set ...")
    out["non_speech"] = non_speech_rows(asr, turn_models, quick, faster, reason)
    gate_sets: list[tuple[str, list[np.ndarray], list[str]]] = []
    gated: dict[str, list[Captioned]] = {}
    human = by_name.get("human")
    if human is None:
        out["long_form_human"] = {"reason": "no human set (pass --human DIR)"}
    else:
        status("captions: long-form human reading, with and without the turns' context ...")
        audio, text = long_form(list(zip(human.audios, human.refs, strict=True)))
        whole = (lambda a: offline.text(offline.hypothesis(a))) if len(audio) <= 30 * SAMPLE_RATE else None
        gated["human_long_form"] = []
        out["long_form_human"] = long_form_row(asr, turn_models, audio, text, whole, faster_long, reason,
                                               runs=gated["human_long_form"])
        gate_sets.append(("human_long_form", [audio], [text]))
        if not quick:
            gate_sets.append(("human", human.audios, human.refs))
    synthetic = by_name.get("synthetic")
    if synthetic is not None:
        keep = QUICK_GATE_CLIPS if quick else len(synthetic.audios)
        gate_sets.append(("synthetic", synthetic.audios[:keep], synthetic.refs[:keep]))
        if not quick:
            status(f"captions: long-form synthetic speech ({LONG_SYNTHETIC} held-out clips) ...")
            audio, text = long_form(list(zip(synthetic.audios, synthetic.refs, strict=True))[:LONG_SYNTHETIC])
            out["long_form_synthetic"] = long_form_row(asr, turn_models, audio, text, None, faster_long, reason)
    if not quick:
        out["long_form_reading"] = reading_rows(asr, turn_models, faster_long, reason, status)
    status("captions: the words the gate loses on speech ...")
    out["gate_words_lost"] = gate_rows(asr, turn_models, gate_sets, gated)
    return out
