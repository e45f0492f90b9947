"""`runtime bench turns [--quick] [--json]`: turn detection as sessions run it (`pipeline/turn_taking.py`:
Silero VAD, and Smart Turn for semantic_vad) on human speech with pauses inserted mid-utterance. How often does
each rule cut the speaker off in the middle, and how long after the true end does it end the turn?

Speech: the human development clips (`--human DIR`, default `../shared/speech/dev` beside the repository:
people reading, 16 kHz mono WAV listed in manifest.jsonl); for reporting only, never to tune a threshold. Where
the folder is missing (CI) the shipped espeak demo (`runtime/io/sample.py: demo_speech()`) stands in, and the
result's `speech` says so.

Test streams. Each clip is scored once by the VAD alone; its speech windows (probability >= 0.5) give the true end
of speech (the end of the last speech window) and the places a pause may go: a point whose windows within
`MARGIN_MS` on both sides are all speech, so never at or next to the clip's own pauses (a pause right at a word's
fading end would merge with the silence after it). A seeded RNG (`SEED`, so runs repeat) picks one or two points
per stream, at least `MIN_APART_MS` apart, and each moves to the quietest 10 ms within +-150 ms (still among
allowed points), so a pause tends to fall between syllables rather than split a vowel; `FADE_MS` raised-cosine
fades on both sides keep the cut from clicking. Stream = `LEAD_MS` of silence + the clip with `pause_ms` of
silence (digital zeros) at each point + `TAIL_MS` of silence: the true end of the turn. Full run: pauses of 300,
600 and 900 ms, up to four streams per clip and length (one pause, one pause, two, two; a clip with little room
may give fewer pauses than asked, and a stream identical to an earlier one is left out); `--quick`: 600 ms only,
two streams per clip (one pause, two), at most `QUICK_CLIPS` clips.

Detectors, each on every stream: server_vad with silence_duration_ms 300, 500 (the default) and 800, and
semantic_vad at eagerness high, auto (= medium) and low. Each runs through `TurnTaking` itself, built from a
`SessionConfig(turn_detection=...)` and fed 100 ms `AudioChunk`s as a session feeds it; after each
SpeechStopped the bench resets it at the end of that chunk, as the session does when it commits the buffer.

Scoring (`score`), per stream:
- a false cut-off is a SpeechStopped whose `audio_end_sample` lies before the true end minus `TOLERANCE_MS`. It
  is charged to an inserted pause when it falls within that pause (or up to `ATTRIBUTE_MS` before its start:
  the VAD may call the fading last sound silence); otherwise to the clip's own pauses. Reported: inserted pauses
  cut (count, rate per inserted pause, and per pause length), cut-offs at the clip's own pauses, and streams
  with any false cut-off (rate per stream);
- the final stop is the first SpeechStopped at or after the true end minus the tolerance; its delay is from the
  true end to the sample at which the detector *emitted* it (the end of the chunk whose `detect` returned it,
  not its audio_end_sample), in ms: p50 and p95 over the streams that got one;
- missed: no final stop before the stream ends (the `TAIL_MS` tail).
Cost per detector: Smart Turn calls (total and per stream) and CPU seconds (process time over all its streams,
the VAD included; ONNX Runtime runs one thread). The result also names the machine and, under `code`, the
hashes of `turn_taking.py` and `turn_detector.py`: numbers compare only across the same rules.

Caveats: a few dev clips of read speech make a small sample, not a representative one, and inserted digital
silence is cleaner than a real hesitation (no breath, no room noise, no trailing "um").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.models.turns.silero_vad import SileroVAD
from runtime.models.turns.smart_turn import SmartTurn
from runtime.pipeline.turn_signals import Turns
from runtime.pipeline.turn_taking import TurnModels, TurnTaking
from runtime.session_config import SessionConfig, TurnDetection
from runtime.session_state import AnswerActivity, SessionSettings

Status = Callable[[str], None]
DEV_SPEECH = Path(__file__).resolve().parents[2].parent / "shared" / "speech" / "dev"
WINDOW = 512  # Silero's window at 16 kHz
THRESHOLD = 0.5  # what counts as speech when placing pauses and finding the true end (the API default)
LEAD_MS, TAIL_MS, CHUNK_MS = 1000, 2000, 100
TOLERANCE_MS = 100  # a stop this close before the true end is not a cut-off
ATTRIBUTE_MS = 200  # a cut-off this far before an inserted pause still belongs to it
MARGIN_MS = 250  # speech windows on each side of an inserted pause: clear of a word's fading end
MIN_APART_MS = 500  # between two inserted pauses
SEARCH_MS, FRAME_MS, FADE_MS = 150, 10, 5  # the quietest FRAME_MS within +-SEARCH_MS; fades at the cut
SEED = 0
PAUSES_MS, QUICK_PAUSES_MS = (300, 600, 900), (600,)
VARIANTS, QUICK_VARIANTS = (1, 1, 2, 2), (1, 2)  # inserted pauses per stream, one stream each
QUICK_CLIPS = 3
CONFIGS: dict[str, dict[str, Any]] = {
    "server_vad_300ms": {"type": "server_vad", "silence_duration_ms": 300},
    "server_vad_500ms": {"type": "server_vad", "silence_duration_ms": 500},
    "server_vad_800ms": {"type": "server_vad", "silence_duration_ms": 800},
    "semantic_vad_high": {"type": "semantic_vad", "eagerness": "high"},
    "semantic_vad_auto": {"type": "semantic_vad", "eagerness": "auto"},
    "semantic_vad_low": {"type": "semantic_vad", "eagerness": "low"},
}


def _samples(ms: float) -> int:
    return round(ms * SAMPLE_RATE / 1000)


def _ms(samples: float) -> float:
    return samples * 1000 / SAMPLE_RATE


@dataclass(frozen=True)
class Stream:
    """One test stream; every position is a sample index of `audio`."""

    clip: str
    audio: np.ndarray
    speech_end: int  # the true end of speech: the end of the clip's last speech window, as placed here
    pauses: tuple[tuple[int, int], ...]  # the inserted silences, [start, end)
    pause_ms: int


@dataclass(frozen=True)
class Stop:
    audio_end: int  # SpeechStopped's audio_end_sample: where the detector says the silence began
    emitted_at: int  # the end of the chunk whose detect returned it


@dataclass(frozen=True)
class Outcome:
    false_cutoffs: int  # stops before the true end, anywhere
    cut_pauses: tuple[bool, ...]  # per inserted pause: was the speaker cut off in it
    at_clip_pauses: int  # false cut-offs charged to no inserted pause: the clip's own pauses
    delay_ms: float | None  # the final stop's emission after the true end; None: missed


def speech_windows(probs: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(probs) >= THRESHOLD


def pause_points(audio: np.ndarray, probs: Sequence[float] | np.ndarray, count: int,
                 rng: np.random.Generator) -> list[int]:
    """Up to `count` sample positions inside the speech (every window within MARGIN_MS on either side is
    speech), at least MIN_APART_MS apart, each moved to the quietest FRAME_MS within SEARCH_MS of where the RNG
    put it (among such positions); sorted. Positions are on a FRAME_MS / 2 grid."""
    speech = speech_windows(probs)
    margin, frame = _samples(MARGIN_MS), _samples(FRAME_MS)
    grid = np.arange(frame, len(audio) - frame + 1, frame // 2)

    def inside(point: int) -> bool:
        first, last = (point - margin) // WINDOW, (point + margin - 1) // WINDOW
        return first >= 0 and last < len(speech) and bool(speech[first:last + 1].all())

    allowed = np.array([p for p in grid if inside(int(p))], dtype=np.int64)
    energy = {int(p): float(np.mean(audio[p - frame // 2:p + frame // 2] ** 2)) for p in allowed}
    chosen: list[int] = []
    for _ in range(count):
        candidates = allowed[[all(abs(int(p) - c) >= _samples(MIN_APART_MS) for c in chosen) for p in allowed]] \
            if chosen else allowed
        if len(candidates) == 0:
            break
        centre = int(rng.choice(candidates))
        near = candidates[np.abs(candidates - centre) <= _samples(SEARCH_MS)]
        chosen.append(int(min(near, key=lambda p: energy[int(p)])))
    return sorted(chosen)


def build_stream(clip: str, audio: np.ndarray, probs: Sequence[float] | np.ndarray, pause_ms: int, count: int,
                 rng: np.random.Generator) -> Stream | None:
    """LEAD_MS silence + the clip with `count` pauses of `pause_ms` + TAIL_MS silence; None if the clip has no
    speech or no room for a pause."""
    speech = np.flatnonzero(speech_windows(probs))
    points = pause_points(audio, probs, count, rng)
    if len(speech) == 0 or not points:
        return None
    end_in_clip = min((int(speech[-1]) + 1) * WINDOW, len(audio))
    fade = _samples(FADE_MS)
    ramp = (0.5 - 0.5 * np.cos(np.linspace(0, np.pi, fade))).astype(np.float32)
    gap = np.zeros(_samples(pause_ms), np.float32)
    parts = [np.zeros(_samples(LEAD_MS), np.float32)]
    pauses: list[tuple[int, int]] = []
    at = len(parts[0])
    for start, stop in zip([0, *points], [*points, len(audio)], strict=True):
        piece = audio[start:stop].astype(np.float32).copy()
        if start > 0:
            piece[:fade] *= ramp[:len(piece[:fade])]
        if stop < len(audio):
            piece[-fade:] *= ramp[::-1][-len(piece[-fade:]):]
        parts.append(piece)
        at += len(piece)
        if stop < len(audio):
            parts.append(gap)
            pauses.append((at, at + len(gap)))
            at += len(gap)
    parts.append(np.zeros(_samples(TAIL_MS), np.float32))
    speech_end = _samples(LEAD_MS) + end_in_clip + len(gap) * len(points)
    return Stream(clip, np.concatenate(parts), speech_end, tuple(pauses), pause_ms)


def play(turns: Turns, audio: np.ndarray, chunk_samples: int = _samples(CHUNK_MS)) -> list[Stop]:
    """Feed `audio` as a session feeds its turn detection, in chunks from sample 0, resetting it at the chunk's
    end after each stop as the session's commit does; the stops, with where each was emitted."""
    stops: list[Stop] = []
    for start in range(0, len(audio), chunk_samples):
        chunk = AudioChunk(np.ascontiguousarray(audio[start:start + chunk_samples], np.float32), start)
        for event in turns.detect(chunk):
            if not event.started:
                stops.append(Stop(event.sample, chunk.end_sample))
                turns.reset(chunk.end_sample)
    return stops


def score(stream: Stream, stops: Sequence[Stop]) -> Outcome:
    """The module docstring's accounting for one stream."""
    limit = stream.speech_end - _samples(TOLERANCE_MS)
    early = [s for s in stops if s.audio_end < limit]
    final = next((s for s in stops if s.audio_end >= limit), None)
    before = _samples(ATTRIBUTE_MS)
    def within(stop: Stop, pause: tuple[int, int]) -> bool:
        return pause[0] - before <= stop.audio_end <= pause[1]

    cut = tuple(any(within(s, pause) for s in early) for pause in stream.pauses)
    elsewhere = sum(1 for s in early if not any(within(s, pause) for pause in stream.pauses))
    delay = None if final is None else _ms(final.emitted_at - stream.speech_end)
    return Outcome(len(early), cut, elsewhere, delay)


class _CountedSmartTurn:
    """Smart Turn with a call counter, where TurnTaking expects the model."""

    def __init__(self, model: SmartTurn) -> None:
        self.model, self.calls = model, 0

    def end_of_turn_probability(self, audio: np.ndarray) -> float:
        self.calls += 1
        return float(self.model.end_of_turn_probability(audio))


def load_speech(folder: Path, quick: bool) -> tuple[list[tuple[str, np.ndarray]], str]:
    """(id, 16 kHz float32 audio) per clip, and what the speech is."""
    import soundfile

    manifest = folder / "manifest.jsonl"
    if not manifest.is_file():
        from runtime.io.sample import demo_speech

        return [("espeak_demo", demo_speech())], f"espeak demo (human clips not found at {folder})"
    clips = []
    for line in manifest.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            audio, rate = soundfile.read(folder / row["path"], dtype="float32", always_2d=False)
            if rate != SAMPLE_RATE or audio.ndim != 1:
                raise ValueError(f"{folder / row['path']}: must be mono {SAMPLE_RATE} Hz, got {rate} Hz "
                                 f"{audio.shape}")
            clips.append((str(row["id"]), audio))
    if quick:
        clips = clips[:QUICK_CLIPS]
    seconds = sum(len(a) for _, a in clips) / SAMPLE_RATE
    return clips, f"human dev clips ({folder}: {len(clips)} clips, {seconds:.1f} s)"


def _percentile(values: list[float], q: int) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def summarise(streams: Sequence[Stream], outcomes: Sequence[Outcome], smart_turn_calls: int,
              cpu_s: float) -> dict[str, Any]:
    """One detector's row over all streams."""
    cut = [c for o in outcomes for c in o.cut_pauses]
    pauses = len(cut)
    at_pauses = sum(cut)
    by_length: dict[str, dict[str, Any]] = {}
    for length in sorted({s.pause_ms for s in streams}):
        flags = [c for s, o in zip(streams, outcomes, strict=True) if s.pause_ms == length for c in o.cut_pauses]
        by_length[str(length)] = {"pauses": len(flags), "cut": sum(flags),
                                  "rate": round(sum(flags) / len(flags), 3) if flags else None}
    delays = [o.delay_ms for o in outcomes if o.delay_ms is not None]
    cut_streams = sum(1 for o in outcomes if o.false_cutoffs)
    per_clip: dict[str, dict[str, Any]] = {}
    for clip in dict.fromkeys(s.clip for s in streams):
        mine = [o for s, o in zip(streams, outcomes, strict=True) if s.clip == clip]
        clip_delays = [o.delay_ms for o in mine if o.delay_ms is not None]
        per_clip[clip] = {"streams": len(mine), "streams_cut": sum(1 for o in mine if o.false_cutoffs),
                          "false_cutoffs": sum(o.false_cutoffs for o in mine),
                          "missed": sum(1 for o in mine if o.delay_ms is None),
                          "delay_ms_p50": _percentile(clip_delays, 50)}
    return {
        "false_cutoffs": {
            "count": at_pauses, "rate_per_inserted_pause": round(at_pauses / pauses, 3) if pauses else None,
            "by_pause_ms": by_length,
            "at_clip_pauses": sum(o.at_clip_pauses for o in outcomes),
            "total": sum(o.false_cutoffs for o in outcomes),
            "streams_cut": cut_streams, "rate_per_stream": round(cut_streams / len(outcomes), 3) if outcomes else None,
        },
        "missed": sum(1 for o in outcomes if o.delay_ms is None),
        "delay_ms": {"p50": _percentile(delays, 50), "p95": _percentile(delays, 95), "n": len(delays)},
        "smart_turn_calls": smart_turn_calls,
        "smart_turn_calls_per_stream": round(smart_turn_calls / len(streams), 2) if streams else 0.0,
        "cpu_s": round(cpu_s, 3),
        "per_clip": per_clip,
    }


def build_streams(clips: Sequence[tuple[str, np.ndarray]], vad: SileroVAD, pauses_ms: Sequence[int],
                  variants: Sequence[int]) -> tuple[list[Stream], list[str]]:
    """Every (clip, pause length, variant) stream, seeded per stream; and the clips that had no room. A clip with
    little room may give fewer pauses than asked, or the same places twice: a repeated stream is left out."""
    streams, skipped = [], []
    for clip, audio in clips:
        probs = vad.open_stream().accept(audio.astype(np.float32))
        made = 0
        for pause_ms in pauses_ms:
            seen: set[tuple[tuple[int, int], ...]] = set()
            for index, count in enumerate(variants):
                rng = np.random.default_rng([SEED, zlib.crc32(clip.encode()), pause_ms, index])
                stream = build_stream(clip, audio, probs, pause_ms, count, rng)
                if stream is not None and stream.pauses not in seen:
                    seen.add(stream.pauses)
                    streams.append(stream)
                    made += 1
        if not made:
            skipped.append(clip)
    return streams, skipped


def run_config(name: str, streams: Sequence[Stream], vad: SileroVAD, smart_turn: SmartTurn) -> dict[str, Any]:
    """One detector on every stream, through TurnTaking as a session builds it."""
    counted = _CountedSmartTurn(smart_turn)
    models = TurnModels(vad, cast(SmartTurn, counted))
    settings = SessionSettings(SessionConfig(turn_detection=TurnDetection(**CONFIGS[name])))
    outcomes = []
    started = time.process_time()
    for stream in streams:
        outcomes.append(score(stream, play(TurnTaking(models, settings, AnswerActivity()), stream.audio)))
    cpu_s = time.process_time() - started
    return {**CONFIGS[name], **summarise(streams, outcomes, counted.calls, cpu_s)}


def _machine() -> dict[str, Any]:
    import onnxruntime

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "onnx_threads": 1}


def _code() -> dict[str, str]:
    """The turn-detection sources measured (sha256, 12 hex): numbers compare only across the same rules."""
    import hashlib

    from runtime.pipeline import turn_detector, turn_taking

    return {Path(m.__file__ or "").name: hashlib.sha256(Path(m.__file__ or "").read_bytes()).hexdigest()[:12]
            for m in (turn_taking, turn_detector)}


def table(result: dict[str, Any]) -> str:
    """The result's rows, for a reader."""
    lines = [f"speech: {result['speech']}; {result['streams']} streams, {result['inserted_pauses']} inserted "
             f"pauses of {'/'.join(map(str, result['pause_ms']))} ms",
             f"{'config':<20}{'cut pauses':>14}{'at clip pauses':>16}{'streams cut':>13}{'missed':>8}"
             f"{'delay p50':>11}{'p95':>8}{'ST calls':>10}{'cpu s':>8}"]
    for name, row in result["configs"].items():
        cut = row["false_cutoffs"]
        rate = cut["rate_per_inserted_pause"]
        lines.append(f"{name:<20}{cut['count']:>5} ({'-' if rate is None else f'{rate:.0%}':>5}) "
                     f"{cut['at_clip_pauses']:>16}{cut['streams_cut']:>13}{row['missed']:>8}"
                     f"{_fmt(row['delay_ms']['p50']):>11}{_fmt(row['delay_ms']['p95']):>8}"
                     f"{row['smart_turn_calls']:>10}{row['cpu_s']:>8.2f}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    folder = Path(getattr(args, "human", None) or DEV_SPEECH).expanduser()
    vad, smart_turn = SileroVAD.load(), SmartTurn.load()
    clips, speech = load_speech(folder, quick)
    pauses_ms = QUICK_PAUSES_MS if quick else PAUSES_MS
    streams, skipped = build_streams(clips, vad, pauses_ms, QUICK_VARIANTS if quick else VARIANTS)
    status(f"turns: {speech}; {len(streams)} streams")
    result: dict[str, Any] = {
        "speech": speech, "clips": len(clips), "clips_without_room": skipped, "streams": len(streams),
        "inserted_pauses": sum(len(s.pauses) for s in streams), "pause_ms": list(pauses_ms),
        "audio_s": round(sum(len(s.audio) for s in streams) / SAMPLE_RATE, 1),
        "method": {"lead_ms": LEAD_MS, "tail_ms": TAIL_MS, "chunk_ms": CHUNK_MS, "tolerance_ms": TOLERANCE_MS,
                   "attribute_ms": ATTRIBUTE_MS, "margin_ms": MARGIN_MS, "seed": SEED},
        "configs": {},
    }
    for name in CONFIGS:
        status(f"turns: {name}")
        result["configs"][name] = run_config(name, streams, vad, smart_turn)
    result["machine"] = _machine()
    result["code"] = _code()
    if not getattr(args, "json", False) and not getattr(args, "quiet", False):
        print(table(result), file=sys.stderr)
    return result
