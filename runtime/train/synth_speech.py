"""`runtime train synth-speech`: (audio, text) pairs spoken by offline synthesisers, for training a small ASR.

Why synthetic: the project must train its demo ASR with nothing but Debian packages and its own files. The
variety a model needs to generalise across voices comes from the synthesisers and from augmentation:

- **espeak-ng** (required): 8 English accents x its voice variants (`-v en-gb-scotland+f3`), random rate
  (`-s`), pitch (`-p`) and amplitude (`-a`);
- **flite** and **festival** (optional, used when installed): real recorded-unit voices (diphone, HTS), far
  closer to human speech than espeak's formant synthesis; random duration stretch (and pitch, for flite);
- then for every clip: speed perturbation (+-10 %, pitch and tempo together), silence trimmed to a random
  margin, a simple room reverb (exponentially decaying noise, random RT60 and wet level) on half the clips,
  white/pink/brown noise at 10-40 dB SNR on most, a random output level; 16 kHz mono 16-bit FLAC.

Output (`--out DIR`): `train/NNN/NNNNNN.flac` + `.txt` (the normalised transcript, the layout
`runtime.train.data.load_examples` reads, so `--data DIR/train` works), the same under `heldout/`, and the
manifests `train.jsonl` / `heldout.jsonl` (one `{"audio", "text", "voice", "duration", ...}` per line).

The held-out set is fixed: its voices (some espeak variants, flite's rms) are never used for training, its
texts are the ones `texts.is_heldout` assigns to it (never drawn for training), and it does not depend on
`--seed`, so every dataset generated with the same synthesisers shares it and models trained on different
seeds are scored on the same clips.

Determinism: utterance i of a split is a pure function of (seed, split, i) (text, voice, prosody, noise), so
`--jobs` and interruptions do not change the result. `--hours` is cut in index order: the training set is the
shortest prefix of utterances whose total duration reaches it. Resume: utterances already recorded in
`.progress.jsonl` whose files exist are not synthesised again.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError, MediaError
from runtime.train.text_norm import expand, normalize
from runtime.train.texts import TextSource

MIN_SECONDS, MAX_SECONDS = 1.0, 8.0
HELDOUT_SEED = 0  # the held-out set ignores --seed: one fixed set for every dataset
DEFAULT_HELDOUT = 200

ESPEAK_ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd",
                  "en-029", "en-us-nyc")
ESPEAK_EXCLUDED_VARIANTS = frozenset({"whisper", "whisperf"})  # unvoiced: nothing like the demo's speech
HELDOUT_ESPEAK_VARIANTS = frozenset({"f4", "m6", "klatt3", "Andrea", "iven2", "steph2", "max", "travis"})
FLITE_VOICES = ("kal", "kal16", "awb", "rms", "slt")  # not awb_time: it only says times of day
HELDOUT_VOICES = frozenset({"flite:rms"})
FESTIVAL_VOICE_DIRS = (Path("/usr/share/festival/voices/english"), Path("/usr/share/festival/voices/us"))
ENGINE_WEIGHTS = {"espeak": 0.6, "flite": 0.2, "festival": 0.2}
ENGINES = tuple(ENGINE_WEIGHTS)
PACKAGES = {"espeak": "espeak-ng", "flite": "flite",
            "festival": "festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts"}


@dataclass(frozen=True)
class Voice:
    engine: str
    name: str  # espeak: "en-gb+f3"; flite: "slt"; festival: "kal_diphone"

    @property
    def id(self) -> str:
        return f"{self.engine}:{self.name}"

    @property
    def heldout(self) -> bool:
        if self.engine == "espeak":
            return self.name.split("+", 1)[1] in HELDOUT_ESPEAK_VARIANTS
        return self.id in HELDOUT_VOICES


# -- finding the installed voices ---------------------------------------------------------------------------
def _run(cmd: Sequence[str], stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(cmd), input=None if stdin is None else stdin.encode(), capture_output=True,
                          timeout=timeout, check=False)


def espeak_variants() -> list[str]:
    """espeak-ng's voice variants (`espeak-ng --voices=variant`, file column `!v/NAME`), sorted, minus the
    whispering ones."""
    out = _run(["espeak-ng", "--voices=variant"]).stdout.decode(errors="replace")
    names = {m.group(1) for m in re.finditer(r"!v/(\S+(?: \S+)*)", out)}  # "Mr serious" has a space
    return sorted(names - ESPEAK_EXCLUDED_VARIANTS)


def find_voices(engines: Sequence[str] | None = None) -> list[Voice]:
    """Every usable voice of the requested engines (default: all installed; espeak-ng is required)."""
    wanted = list(engines) if engines else [e for e in ENGINES if e == "espeak" or _installed(e)]
    unknown = set(wanted) - set(ENGINES)
    if unknown:
        raise ConfigError(f"unknown synthesiser {sorted(unknown)}: known {list(ENGINES)}")
    voices: list[Voice] = []
    for engine in wanted:
        if not _installed(engine):
            raise ConfigError(f"synthesiser {engine} is not installed (Debian: apt-get install {PACKAGES[engine]})")
        if engine == "espeak":
            voices += [Voice("espeak", f"{a}+{v}") for a in ESPEAK_ACCENTS for v in espeak_variants()]
        elif engine == "flite":
            listed = _run(["flite", "-lv"]).stdout.decode(errors="replace").split()
            voices += [Voice("flite", v) for v in FLITE_VOICES if v in listed]
        else:
            voices += [Voice("festival", d.name) for root in FESTIVAL_VOICE_DIRS if root.is_dir()
                       for d in sorted(root.iterdir()) if d.is_dir()]
    return voices


def _installed(engine: str) -> bool:
    return shutil.which({"espeak": "espeak-ng", "flite": "flite", "festival": "text2wave"}[engine]) is not None


# -- synthesis ----------------------------------------------------------------------------------------------
def synthesize(voice: Voice, text: str, rng: np.random.Generator) -> tuple[np.ndarray, int, dict[str, float]]:
    """(float32 mono samples, sample rate, the prosody drawn) for `text` as said by `voice`."""
    with tempfile.TemporaryDirectory(prefix="synth-") as tmp:
        wav = Path(tmp) / "out.wav"
        if voice.engine == "espeak":
            params = {"rate": int(rng.integers(120, 211)), "pitch": int(rng.integers(20, 81)),
                      "amplitude": int(rng.integers(60, 151))}
            cmd = ["espeak-ng", "-v", voice.name, "-s", str(params["rate"]), "-p", str(params["pitch"]),
                   "-a", str(params["amplitude"]), "-w", str(wav)]
            proc = _run(cmd, stdin=text)
        elif voice.engine == "flite":
            params = {"duration_stretch": round(float(rng.uniform(0.8, 1.3)), 3),
                      "f0_scale": round(float(rng.uniform(0.85, 1.2)), 3)}
            f0 = 105.0 if voice.name in ("kal", "kal16", "awb", "rms") else 175.0
            text_file = Path(tmp) / "in.txt"
            text_file.write_text(text, encoding="utf-8")
            proc = _run(["flite", "-voice", voice.name, "--setf", f"duration_stretch={params['duration_stretch']}",
                         "--setf", f"int_f0_target_mean={f0 * params['f0_scale']:.1f}", "-f", str(text_file),
                         "-o", str(wav)])
        elif voice.engine == "festival":
            params = {"duration_stretch": round(float(rng.uniform(0.8, 1.3)), 3)}
            text_file = Path(tmp) / "in.txt"
            text_file.write_text(text, encoding="utf-8")
            proc = _run(["text2wave", "-eval", f"(voice_{voice.name})", "-eval",
                         f"(Parameter.set 'Duration_Stretch {params['duration_stretch']})", "-o", str(wav),
                         str(text_file)])
        else:
            raise ConfigError(f"unknown synthesiser {voice.engine}")
        if proc.returncode != 0 or not wav.exists():
            raise MediaError(f"{voice.id} failed on {text!r}: {proc.stderr.decode(errors='replace')[-500:]}")
        data, rate = soundfile.read(io.BytesIO(wav.read_bytes()), dtype="float32", always_2d=True)
    return data.mean(axis=1), int(rate), params


def resample(x: np.ndarray, rate_in: int, rate_out: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited resampling with libswresample (PyAV), so no aliasing is baked into the training audio."""
    import av

    if rate_in == rate_out or len(x) == 0:
        return x.astype(np.float32)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x, dtype=np.float32).reshape(1, -1), format="flt",
                                       layout="mono")
    frame.sample_rate = rate_in
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate_out)
    pieces = [f.to_ndarray().reshape(-1) for f in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def _trim(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Cut the synthesiser's own leading/trailing silence to a random 50-300 ms margin on each side."""
    peak = float(np.abs(x).max()) if len(x) else 0.0
    if peak == 0.0:
        return x
    active = np.flatnonzero(np.abs(x) > 0.02 * peak)
    margin = (rng.uniform(0.05, 0.3, size=2) * SAMPLE_RATE).astype(int)
    start, end = max(0, active[0] - margin[0]), min(len(x), active[-1] + 1 + margin[1])
    return np.concatenate([x[start:end], np.zeros(max(0, margin[1] - (len(x) - active[-1] - 1)), np.float32)])


def _fft_convolve(x: np.ndarray, h: np.ndarray) -> np.ndarray:
    n = 1 << int(np.ceil(np.log2(len(x) + len(h) - 1)))
    return np.fft.irfft(np.fft.rfft(x, n) * np.fft.rfft(h, n), n)[: len(x)].astype(np.float32)


def reverb(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, float]]:
    """A simple room: the dry path plus a late tail of exponentially decaying noise (RT60 0.15-0.7 s, 2-15 ms
    pre-delay) at a random wet level; crude next to a measured room response, but it smears phones in time the
    way rooms do, which is what the model must learn to ignore."""
    rt60, wet, predelay = float(rng.uniform(0.15, 0.7)), float(rng.uniform(0.1, 0.6)), float(rng.uniform(0.002, 0.015))
    n = int(rt60 * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    tail = rng.standard_normal(n) * np.exp(-6.908 * t / rt60)  # -60 dB at rt60
    tail[: int(predelay * SAMPLE_RATE)] = 0.0
    tail *= wet / max(1e-9, float(np.sqrt(np.sum(tail**2))))
    return x + _fft_convolve(x, tail.astype(np.float32)), {"rt60": round(rt60, 3), "wet": round(wet, 3)}


def noise(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
    """White, pink or brown noise (1/f^0, 1/f, 1/f^2 power) at 10-40 dB SNR against the speech's active level."""
    color = ("white", "pink", "brown")[int(rng.integers(3))]
    snr = float(rng.uniform(10, 40))
    spectrum = np.fft.rfft(rng.standard_normal(len(x)))
    f = np.maximum(np.fft.rfftfreq(len(x), 1 / SAMPLE_RATE), 20.0)
    spectrum /= f ** ({"white": 0.0, "pink": 0.5, "brown": 1.0}[color])  # amplitude ~ f^-(alpha/2)
    n = np.fft.irfft(spectrum, len(x))
    peak = float(np.abs(x).max())
    active = x[np.abs(x) > 0.05 * peak] if peak > 0 else x
    speech_rms = float(np.sqrt(np.mean(active**2))) if len(active) else 0.0
    n *= speech_rms / max(1e-9, float(np.sqrt(np.mean(n**2)))) / 10 ** (snr / 20)
    return (x + n).astype(np.float32), {"noise": color, "snr_db": round(snr, 1)}


def render(voice: Voice, text: str, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
    """The finished clip: synthesis, speed perturbation to 16 kHz, trimming, padding to 1 s, reverb, noise,
    level."""
    raw, rate, params = synthesize(voice, expand(text), rng)
    speed = float(rng.uniform(0.9, 1.1))
    x = _trim(resample(raw, round(rate * speed)), rng)  # read at rate*speed: faster and higher when speed > 1
    if float(np.abs(x).max() if len(x) else 0.0) < 1e-4:
        raise MediaError(f"{voice.id} produced silence for {text!r}")
    short = int(MIN_SECONDS * SAMPLE_RATE) - len(x)
    if short > 0:
        lead = int(rng.integers(short + 1))
        x = np.concatenate([np.zeros(lead, np.float32), x, np.zeros(short - lead, np.float32)])
    info: dict[str, Any] = {**params, "speed": round(speed, 3)}
    if rng.random() < 0.5:
        x, room = reverb(x, rng)
        info.update(room)
    if rng.random() < 0.8:
        x, noisy = noise(x, rng)
        info.update(noisy)
    level = float(rng.uniform(0.1, 0.9))
    x = x * (level / max(1e-9, float(np.abs(x).max())))
    info["peak"] = round(level, 3)
    return np.clip(x, -1.0, 1.0).astype(np.float32), info


# -- one utterance ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    split: str  # "train" | "heldout"
    index: int
    seed: int
    out: str
    voices: tuple[Voice, ...]  # this split's voices


_TEXTS: TextSource | None = None


def _texts() -> TextSource:
    global _TEXTS
    if _TEXTS is None:
        _TEXTS = TextSource.load()
    return _TEXTS


def relative_audio_path(split: str, index: int) -> str:
    return f"{split}/{index // 1000:03d}/{index:06d}.flac"


def make_utterance(task: Task) -> dict[str, Any]:
    """Synthesise, augment and write utterance `task.index` of its split; return its manifest entry. Texts that
    come out longer than 8 s are redrawn (from the same stream, so still deterministic) with fewer words."""
    heldout = task.split == "heldout"
    rng = np.random.default_rng([HELDOUT_SEED if heldout else task.seed, int(heldout), task.index])
    by_engine: dict[str, list[Voice]] = {}
    for v in task.voices:
        by_engine.setdefault(v.engine, []).append(v)
    engines = sorted(by_engine, key=ENGINES.index)
    weights = np.array([ENGINE_WEIGHTS[e] for e in engines])
    max_words = 16
    for _attempt in range(8):
        engine = engines[int(rng.choice(len(engines), p=weights / weights.sum()))]
        voice = by_engine[engine][int(rng.integers(len(by_engine[engine])))]
        kind, text = _texts().draw(rng, heldout, max_words=max_words)
        audio, info = render(voice, text, rng)
        if len(audio) <= MAX_SECONDS * SAMPLE_RATE:
            break
        max_words = max(3, max_words - 3)
    else:
        raise MediaError(f"utterance {task.split}/{task.index}: every attempt was longer than {MAX_SECONDS:g} s")
    rel = relative_audio_path(task.split, task.index)
    path = Path(task.out) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    norm = normalize(text)
    tmp = path.with_name(path.stem + ".tmp.flac")
    soundfile.write(str(tmp), audio, SAMPLE_RATE, subtype="PCM_16", format="FLAC")
    os.replace(tmp, path)
    path.with_suffix(".txt").write_text(norm + "\n", encoding="utf-8")
    return {"audio": rel, "text": norm, "voice": voice.id, "duration": round(len(audio) / SAMPLE_RATE, 3),
            "engine": voice.engine, "kind": kind, "written": text, "index": task.index, **info}


# -- the dataset --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    out: str
    hours: float = 2.0
    heldout: int = DEFAULT_HELDOUT
    seed: int = 0
    jobs: int = 0  # 0: one per CPU core
    engines: tuple[str, ...] = ()  # (): every installed one
    quiet: bool = False


def _progress_entries(out: Path, fingerprint: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """Entries of a previous run into the same folder whose files still exist (resume); a folder made with other
    settings is refused rather than mixed."""
    config = out / ".config.json"
    if config.exists():
        previous = json.loads(config.read_text())
        if previous != fingerprint:
            raise ConfigError(f"{out} was generated with other settings ({previous}); use a new --out folder")
    out.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(fingerprint, indent=1) + "\n")
    done: dict[tuple[str, int], dict[str, Any]] = {}
    progress = out / ".progress.jsonl"
    if progress.exists():
        for line in progress.read_text(encoding="utf-8").splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interruption
                continue
            audio = out / e["audio"]
            if audio.exists() and audio.with_suffix(".txt").exists():
                done[(e["split"], e["index"])] = e
    return done


def _results(tasks: list[Task], done: dict[tuple[str, int], dict[str, Any]], pool: Any) -> Iterator[dict[str, Any]]:
    """Entries in task order: from the previous run when recorded, else synthesised (in the pool if any)."""
    todo = [t for t in tasks if (t.split, t.index) not in done]
    made = iter(pool.imap(make_utterance, todo) if pool is not None else map(make_utterance, todo))
    for t in tasks:
        yield done[(t.split, t.index)] if (t.split, t.index) in done else {"split": t.split, **next(made)}


def generate(settings: Settings) -> dict[str, Any]:
    """Write the dataset described by `settings`; return a summary (counts, hours, voices, vocabulary)."""
    from tqdm import tqdm

    started = time.monotonic()
    out = Path(settings.out).expanduser()
    voices = find_voices(settings.engines or None)
    split_voices = {"train": tuple(v for v in voices if not v.heldout),
                    "heldout": tuple(v for v in voices if v.heldout)}
    if not split_voices["heldout"]:
        raise ConfigError("no held-out voice installed: espeak-ng's variants are needed")
    fingerprint = {"seed": settings.seed, "voices": [v.id for v in voices]}
    done = _progress_entries(out, fingerprint)
    jobs = settings.jobs or os.cpu_count() or 1
    # fork where there is one: spawn would re-import the `runtime` CLI (and torch) in every worker, seconds each
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(jobs) if jobs > 1 else None
    manifests: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": []}
    try:
        with open(out / ".progress.jsonl", "a", encoding="utf-8") as progress:
            def record(entry: dict[str, Any]) -> None:
                if (entry["split"], entry["index"]) not in done:
                    progress.write(json.dumps(entry) + "\n")
                    progress.flush()

            heldout_tasks = [Task("heldout", i, settings.seed, str(out), split_voices["heldout"])
                             for i in range(settings.heldout)]
            bar = tqdm(total=settings.heldout, unit="utt", desc="heldout", disable=settings.quiet, file=sys.stderr)
            for entry in _results(heldout_tasks, done, pool):
                record(entry)
                manifests["heldout"].append(entry)
                bar.update(1)
            bar.close()

            target = settings.hours * 3600
            total, index, batch = 0.0, 0, max(16, 4 * jobs)
            bar = tqdm(total=round(target), unit="s", desc="train (s of audio)", disable=settings.quiet,
                       file=sys.stderr)
            while total < target:
                tasks = [Task("train", i, settings.seed, str(out), split_voices["train"])
                         for i in range(index, index + batch)]
                index += batch
                for entry in _results(tasks, done, pool):
                    record(entry)
                    if total < target:
                        manifests["train"].append(entry)
                        shown = min(int(total), bar.total)
                        total += entry["duration"]
                        bar.update(min(int(total), bar.total) - shown)
            bar.close()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for split, entries in manifests.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps({k: v for k, v in e.items() if k != "split"}) + "\n")
        _remove_unlisted(out / split, {out / e["audio"] for e in entries})
    texts = _texts()
    summary = {
        "train": {"utterances": len(manifests["train"]),
                  "hours": round(sum(e["duration"] for e in manifests["train"]) / 3600, 3)},
        "heldout": {"utterances": len(manifests["heldout"]),
                    "hours": round(sum(e["duration"] for e in manifests["heldout"]) / 3600, 3)},
        "voices": {split: len(v) for split, v in split_voices.items()},
        "engines": sorted({v.engine for v in voices}, key=ENGINES.index),
        "vocabulary": len(texts.vocabulary),
        "sentences": {"train": len(texts.split_sentences[False]), "heldout": len(texts.split_sentences[True])},
        "seed": settings.seed,
        "wall_s": round(time.monotonic() - started, 1),
    }
    info = {**summary, "settings": asdict(settings),
            "voice_ids": {split: [v.id for v in vs] for split, vs in split_voices.items()}}
    (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    return summary


def _remove_unlisted(folder: Path, keep: set[Path]) -> None:
    """Drop clips past the `--hours` cut (or from a longer earlier run), so the folder holds exactly the
    manifest and `load_examples(folder)` reads the same set."""
    if not folder.is_dir():
        return
    for p in folder.rglob("*"):
        if p.is_file() and re.fullmatch(r"\d{6}(\.tmp)?\.(flac|txt)", p.name) and \
                p.with_name(p.name.split(".")[0] + ".flac") not in keep:
            p.unlink()


# -- CLI ----------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings("")
    parser.add_argument("--out", required=True, help="output folder: train/, heldout/, train.jsonl, heldout.jsonl")
    parser.add_argument("--hours", type=float, default=d.hours, help="hours of training audio (default: %(default)s)")
    parser.add_argument("--heldout", type=int, default=d.heldout,
                        help="held-out utterances (default: %(default)s; fixed: independent of --seed)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the training set (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=d.jobs, help="worker processes (default: one per CPU core)")
    parser.add_argument("--engines", default="", help="comma-separated synthesisers among espeak,flite,festival "
                        "(default: every installed one)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if args.hours <= 0 or args.heldout < 0:
        raise ConfigError("--hours must be > 0 and --heldout >= 0")
    summary = generate(Settings(args.out, args.hours, args.heldout, args.seed, args.jobs, engines, args.quiet))
    print(json.dumps(summary))
    return 0
