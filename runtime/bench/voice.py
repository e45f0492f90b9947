"""`runtime bench voice [--quick] [--json]`: the voice (builtin:piper-en-us-joe-medium), as the runtime runs it
and against the `piper` command of piper-tts on the same voice and the same text, in the same run.

Synthesis speed (`synthesis`): each system speaks the same sentences (`SENTENCES`, one synthesis call each), and
its real-time factor is compute seconds over seconds of audio made (below 1 is faster than real time). Systems:
- `runtime`: what the runtime runs (`PiperVoiceModel`: piper-tts's `PiperVoice` around our own onnxruntime session,
  one intra-op thread per usable core, spinning off); `runtime_1_thread`: the same on one thread (what it ran
  until 2026-11-30); `runtime_spinning`: the same threads spinning between calls, onnxruntime's default;
- `onnxruntime_direct`: the same session called directly on espeak-ng's phoneme ids (piper-tts still phonemises),
  skipping `PiperVoice.synthesize`: is calling onnxruntime ourselves any faster than the library's wrapper?
- `piper_library_defaults`: `PiperVoice.load` as its README shows it (its own session, default options: every
  core);
- `piper_command`: the `piper` console script of piper-tts in a subprocess (its defaults), fed the sentences as
  lines on stdin and writing one wav per line (`--output-dir`); a run is timed from writing its lines to piper's
  "Wrote" log line for the last one. The process is started (Python, imports, voice load: `startup_s`) and warmed
  up with one line before any timed run, as the in-process systems are warmed up, so the race is synthesis only.
Each system runs `repeats` times, interleaved with the others so that load from elsewhere falls on all of them
alike, and its fastest run counts. VITS draws noise (noise_scale, noise_w), so two runs make slightly different
durations: the ratio compute/audio is what compares. Target: the runtime's synthesis at least as fast as the
`piper` command (its real-time factor over the command's at most 1).

First clause (`first_clause_ms`): the synthesis time of each sentence's first clause as the clause splitter cuts
it (what the voice adds to a voice-to-voice latency), p50/p95 over the sentences.

Intelligibility (`intelligibility`): the 25 sentences spoken by the runtime's voice, resampled to 16 kHz and
transcribed back by Whisper tiny.en (builtin:whisper-tiny.en through faster-whisper, greedy, int8), scored with
the project's text normalisation (`runtime/train/text_norm.py`: numbers written out, punctuation and case
dropped). Target: round-trip WER at most 5%. Sentences with any error are listed with what Whisper heard.

Output encoding (`encoding_ms_per_audio_s`): the cost of turning the voice's samples into each output format
(`audio/pcm` 24 kHz, `audio/pcmu`, `audio/pcma`), per second of audio.

Voice-to-voice latency (`voice_to_voice`): spoken questions answered aloud by the real server (`runtime serve
--profile P`, `--profile`, default: the default profile) through the official openai SDK at real-time pace with
server VAD, 1, 2 and 4 conversations at once (quick: 1 and 2, fewer turns), split into turn detection, the final
transcript, the language model's first clause and the first audio: `voice_latency.py` says how. Target: p50 at one
conversation at most 1.2 s, the VAD's 500 ms of silence included. The result names the profile and its models.

`--quick`: the synthesis race on the first `QUICK_RTF_SENTENCES` sentences, 2 repeats (full: all, 3 repeats);
intelligibility always on all 25; voice-to-voice at 1 conversation of 2 questions and 2 of 1 (full: 1, 2, 4 of 5).
The server of the voice-to-voice rows is started before the intelligibility rows, which time nothing, so that its
model load overlaps them.
Timings on a shared 2-core machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime.bench.timing import at_most, percentiles_ms
from runtime.errors import CheckpointNotFound

Status = Callable[[str], None]

# Fixed answers an assistant might speak: everyday words, a few numbers, questions. Written for this benchmark;
# they never change, so results compare across runs. American spelling (the voice is en_US, Whisper writes it) and
# no homophones the scoring would count against the voice ("its" / "it's").
SENTENCES = (
    "The meeting moved to Thursday at three in the afternoon.",
    "Please bring the slides and the budget for the second quarter.",
    "Yes, the red ball rolled from the left side to the right side.",
    "I could not find that file, but I can look again if you like.",
    "The train leaves at half past seven from platform four.",
    "She said the report would be ready by the end of the week.",
    "There are twelve people on the list, and two of them are new.",
    "Turn left at the bakery, then walk straight for two blocks.",
    "The weather tomorrow looks cold and windy, with rain in the evening.",
    "Would you like me to read the summary out loud?",
    "The first step is to open the settings and choose your language.",
    "He moved to a small town near the coast last summer.",
    "The total comes to forty five dollars and twenty cents.",
    "I think the answer is in the second chapter of the book.",
    "Sorry, I did not catch that. Could you say it again?",
    "The kitchen light is on, but the front door is locked.",
    "Our team finished the project two days ahead of schedule.",
    "The speaker on the video talked about saving energy at home.",
    "Mix the flour and the eggs, then bake it for twenty minutes.",
    "The library opens at nine and closes at six on weekdays.",
    "Remember to water the plants before you leave for the airport.",
    "The blue car parked outside belongs to our neighbor.",
    "Most of the questions were about the new phone and the battery.",
    "Good morning! Here is what happened while you were away.",
    "The last slide shows the sales numbers for each city.",
)
QUICK_RTF_SENTENCES = 8
REPEATS, QUICK_REPEATS = 3, 2
WHISPER = "whisper-tiny.en"
WER_TARGET = 5.0


def _rtf_row(audio_s: float, compute_s: float, **extra: str | int | float) -> dict[str, Any]:
    return {"audio_s": round(audio_s, 2), "compute_s": round(compute_s, 3),
            "rtf": round(compute_s / audio_s, 4) if audio_s else None, **extra}


def _timed_calls(speak: Callable[[str], int], texts: Sequence[str], rate: int) -> tuple[float, float]:
    """(audio seconds, compute seconds) of `speak` (text -> samples made) over `texts`."""
    samples, started = 0, time.perf_counter()
    for text in texts:
        samples += speak(text)
    return samples / rate, time.perf_counter() - started


def _piper_command() -> tuple[str | None, str]:
    """The `piper` console script beside this interpreter (else on PATH), or (None, why not)."""
    found = shutil.which("piper", path=str(Path(sys.executable).parent)) or shutil.which("piper")
    if found is None:
        return None, "the piper command of piper-tts is not installed (pip install -e '.[tts]', or: make install)"
    return found, ""


class PiperCommand:
    """The `piper` command kept running, fed lines on stdin, one wav each into a folder (`--output-dir`).

    Timing from outside without counting its start-up: piper logs "Wrote PATH" on stderr after each line's wav,
    so a run writes its lines and waits for as many of those; the process (Python start, imports, voice load) is
    started once, with a warm-up line, before any timed run, exactly as the in-process systems are warmed up.
    """

    def __init__(self, command: str, weights: Path, workdir: Path) -> None:
        self.out = workdir / "piper-command"
        self.out.mkdir()
        started = time.perf_counter()
        self.proc = subprocess.Popen([command, "-m", str(weights), "-c", f"{weights}.json", "-d", str(self.out)],
                                     stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        self.speak(["Hello."])
        self.startup_s = time.perf_counter() - started  # start, imports, voice load and the warm-up line

    def speak(self, texts: Sequence[str]) -> tuple[float, float]:
        """(audio seconds, wall seconds) of the command speaking `texts`."""
        assert self.proc.stdin is not None and self.proc.stderr is not None
        before = set(self.out.glob("*.wav"))
        started = time.perf_counter()
        self.proc.stdin.write("".join(f"{t}\n" for t in texts))
        self.proc.stdin.flush()
        written, tail = 0, []
        while written < len(texts):
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"piper ended ({self.proc.wait()}): {''.join(tail)[-300:]}")
            tail = [*tail[-5:], line]
            written += "Wrote" in line
        wall = time.perf_counter() - started
        audio_s = 0.0
        for path in set(self.out.glob("*.wav")) - before:
            with wave.open(str(path)) as w:
                audio_s += w.getnframes() / w.getframerate()
        return audio_s, wall

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def synthesis(texts: Sequence[str], repeats: int, status: Status) -> dict[str, Any]:
    """The race of the module docstring: each system's fastest run over `texts`."""
    import onnxruntime as ort
    from piper import PiperVoice

    from runtime.models.packaged import PACKAGED, packaged_checkpoint
    from runtime.models.tts.piper_voice import PiperVoiceModel

    ours, one = PiperVoiceModel.load(), PiperVoiceModel.load(threads=1)
    spinning = PiperVoiceModel.load(spinning=True)
    folder = packaged_checkpoint("piper-en-us-joe-medium")
    assert folder is not None
    weights = folder / PACKAGED["piper-en-us-joe-medium"].weight_file
    library = PiperVoice.load(weights, config_path=f"{weights}.json")
    rate = ours.sample_rate
    scales = np.array([ours.piper.config.noise_scale, ours.length_scale, ours.piper.config.noise_w_scale],
                      dtype=np.float32)

    def direct(text: str) -> int:
        samples = 0
        for ids in ours.phoneme_ids(text):
            audio = ours.piper.session.run(None, {"input": np.array([ids], dtype=np.int64),
                                                 "input_lengths": np.array([len(ids)], dtype=np.int64),
                                                 "scales": scales})[0].squeeze()
            audio = audio / max(float(np.abs(audio).max()), 1e-8)  # piper's normalisation, for the same work
            samples += len(np.clip(audio, -1.0, 1.0).astype(np.float32))
        return samples

    systems: dict[str, Callable[[], tuple[float, float]]] = {
        "runtime": lambda: _timed_calls(lambda t: len(ours.synthesize(t).samples), texts, rate),
        "runtime_1_thread": lambda: _timed_calls(lambda t: len(one.synthesize(t).samples), texts, rate),
        "runtime_spinning": lambda: _timed_calls(lambda t: len(spinning.synthesize(t).samples), texts, rate),
        "onnxruntime_direct": lambda: _timed_calls(direct, texts, rate),
        "piper_library_defaults": lambda: _timed_calls(
            lambda t: sum(len(c.audio_float_array) for c in library.synthesize(t)), texts, rate),
    }
    command, why = _piper_command()
    workdir = Path(tempfile.mkdtemp(prefix="bench-voice-"))
    piper: PiperCommand | None = None
    if command is not None:
        status("voice: starting the piper command")
        piper = PiperCommand(command, weights, workdir)
        systems["piper_command"] = lambda: piper.speak(texts)
    # warm-up: onnxruntime's first run of a shape allocates; espeak-ng loads its dictionary once
    for voice in (ours, one, spinning):
        voice.synthesize(texts[0])
    direct(texts[0])
    list(library.synthesize(texts[0]))
    best: dict[str, tuple[float, float]] = {}
    try:
        for r in range(repeats):
            for name, measure in systems.items():
                status(f"voice: synthesis {name}, run {r + 1}/{repeats} ({len(texts)} sentences)")
                audio_s, compute_s = measure()
                if name not in best or compute_s / audio_s < best[name][1] / best[name][0]:
                    best[name] = (audio_s, compute_s)
    finally:
        if piper is not None:
            piper.close()
        shutil.rmtree(workdir, ignore_errors=True)
    rows: dict[str, Any] = {
        "runtime": _rtf_row(*best["runtime"], threads=ours.threads, spinning=False),
        "runtime_1_thread": _rtf_row(*best["runtime_1_thread"], threads=1),
        "runtime_spinning": _rtf_row(*best["runtime_spinning"], threads=spinning.threads, spinning=True),
        "onnxruntime_direct": _rtf_row(*best["onnxruntime_direct"], threads=ours.threads, spinning=False),
        "piper_library_defaults": _rtf_row(*best["piper_library_defaults"], threads=f"default ({ort.__version__})"),
    }
    if piper is not None:
        rows["piper_command"] = _rtf_row(*best["piper_command"], startup_s=round(piper.startup_s, 2),
                                         threads=f"default ({ort.__version__})",
                                         note="lines on stdin, timed to its 'Wrote' log line for each; start-up "
                                              "and a warm-up line before")
    else:
        rows["piper_command"] = {"missing": why}
    return {"sentences": len(texts), "repeats": repeats, "fastest_run_counts": True, "systems": rows}


def first_clauses(texts: Sequence[str]) -> dict[str, Any]:
    from runtime.models.tts.clauses import split_clauses
    from runtime.models.tts.piper_voice import PiperVoiceModel

    voice = PiperVoiceModel.load()
    voice.synthesize(texts[0])
    seconds, words = [], []
    for text in texts:
        clause = split_clauses(text)[0]
        started = time.perf_counter()
        voice.synthesize(clause)
        seconds.append(time.perf_counter() - started)
        words.append(len(clause.split()))
    return {**percentiles_ms(seconds), "words_p50": float(np.median(words)), "threads": voice.threads}


def intelligibility(texts: Sequence[str], status: Status) -> dict[str, Any]:
    from runtime.bench.asr_systems import faster_whisper
    from runtime.models.packaged import packaged_checkpoint
    from runtime.models.tts.output_audio import resample
    from runtime.models.tts.piper_voice import PiperVoiceModel
    from runtime.train.text_norm import normalize, wer

    try:
        folder = packaged_checkpoint(WHISPER)
    except CheckpointNotFound as err:
        return {"missing": str(err)}
    transcribe, why = faster_whisper(folder, "")
    if transcribe is None:
        return {"missing": why}
    voice = PiperVoiceModel.load()
    hyps, audio_s = [], 0.0
    started = time.perf_counter()
    for i, text in enumerate(texts):
        if i % 5 == 0:
            status(f"voice: intelligibility, sentence {i + 1}/{len(texts)}")
        speech = voice.synthesize(text)
        audio_s += speech.duration_s
        hyps.append(transcribe(resample(speech.samples, speech.sample_rate, 16000)).strip())
    value = round(100 * wer(list(texts), hyps), 2)
    errors = [{"said": ref, "heard": hyp} for ref, hyp in zip(texts, hyps, strict=True)
              if normalize(ref) != normalize(hyp)]
    return {"sentences": len(texts), "audio_s": round(audio_s, 1), "asr": f"builtin:{WHISPER} (faster-whisper, "
            "greedy, int8)", "wer": value, "sentences_with_errors": errors,
            "wall_s": round(time.perf_counter() - started, 1), "target": at_most(value, WER_TARGET)}


def encoding(texts: Sequence[str]) -> dict[str, Any]:
    from runtime.io.audio_formats import PCM, PCMA, PCMU, AudioFormat
    from runtime.models.tts.output_audio import AudioEncoder
    from runtime.models.tts.piper_voice import PiperVoiceModel

    voice = PiperVoiceModel.load()
    speech = voice.synthesize(" ".join(texts[:3]))
    out: dict[str, Any] = {}
    for fmt in (AudioFormat(PCM, 24000), AudioFormat(PCMU, 8000), AudioFormat(PCMA, 8000)):
        encoder = AudioEncoder(fmt, speech.sample_rate)
        step = speech.sample_rate // 5  # 200 ms pieces, as clauses arrive in parts
        started = time.perf_counter()
        for at in range(0, len(speech.samples), step):
            encoder.encode(speech.samples[at:at + step])
        encoder.flush()
        out[fmt.type] = round(1000 * (time.perf_counter() - started) / speech.duration_s, 3)
    return out


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
    from importlib.metadata import PackageNotFoundError, version

    try:
        piper: str | None = version("piper-tts")
    except PackageNotFoundError:
        piper = None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "platform": platform.platform(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "piper_tts": piper}


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    from runtime.bench import voice_latency
    from runtime.models.tts import DEFAULT_VOICE, check_voice
    from runtime.profile_files import DEFAULT_PROFILE, load_profile

    quick = bool(getattr(args, "quick", False))
    check_voice(DEFAULT_VOICE)  # one line naming the install command, before anything runs
    profile = getattr(args, "profile", None) or DEFAULT_PROFILE
    load_profile(profile)  # an unknown profile is one line before anything runs
    race = SENTENCES[:QUICK_RTF_SENTENCES] if quick else SENTENCES
    result: dict[str, Any] = {"voice": DEFAULT_VOICE, "quick": quick, "profile": profile}
    result["synthesis"] = synthesis(race, QUICK_REPEATS if quick else REPEATS, status)
    rows = result["synthesis"]["systems"]
    ours, peer = rows["runtime"].get("rtf"), rows["piper_command"].get("rtf")
    ratio = round(ours / peer, 3) if ours is not None and peer else None
    status("voice: first clauses")
    result["first_clause_ms"] = first_clauses(SENTENCES)
    result["encoding_ms_per_audio_s"] = encoding(SENTENCES)
    # the server loads while intelligibility runs: it times nothing, and the quick run keeps its 3 minutes
    status("voice-to-voice: starting the server; it loads during the intelligibility rows")
    server = voice_latency.start_server(profile, quick, trace=getattr(args, "trace_jobs", None))
    try:
        result["intelligibility"] = intelligibility(SENTENCES, status)
    except BaseException:
        server.stop()
        raise
    result["voice_to_voice"] = voice_latency.run(args, status, profile, server)
    result["targets"] = {
        "synthesis_rtf_over_piper_command": {**at_most(ratio, 1.0), "runtime_rtf": ours, "piper_command_rtf": peer},
        "round_trip_wer_percent": result["intelligibility"].get("target", {**at_most(None, WER_TARGET)}),
        "voice_to_voice_p50_s": result["voice_to_voice"]["target_p50_s_at_1"],
        "server_rss_mb_per_extra_conversation": result["voice_to_voice"]["target_rss_mb_per_extra_conversation"],
    }
    result["machine"] = _machine()
    return result
