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
`.progress.jsonl` whose files exist are not synthesised again. The voices, synthesis and augmentation are in
`synthesizers.py`; this module turns them into a dataset.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import multiprocessing.pool
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError, MediaError
from runtime.stop_signals import worker_process_defaults
from runtime.train.outputs import out_folder
from runtime.train.synthesizers import ENGINE_WEIGHTS, ENGINES, MAX_SECONDS, Voice, find_voices, render
from runtime.train.text_norm import normalize
from runtime.train.texts import TextSource

HELDOUT_SEED = 0  # the held-out set ignores --seed: one fixed set for every dataset
DEFAULT_HELDOUT = 200

# -- one utterance ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    split: str  # "train" | "heldout"
    index: int
    seed: int
    out: str
    voices: tuple[Voice, ...]  # this split's voices
    formant_shift: float = 0.0  # see synthesizers.render; never for the held-out set


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
        audio, info = render(voice, text, rng, task.formant_shift)
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
    formant_shift: float = 0.0  # 0: off (the default, and what every dataset before the option was made with)


def _progress_entries(out: Path, fingerprint: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """Entries of a previous run into the same folder whose files still exist (resume); a folder made with other
    settings is refused rather than mixed."""
    config = out / ".config.json"
    if config.exists():
        previous = json.loads(config.read_text())
        if previous != fingerprint:
            raise ConfigError(f"{out} was generated with other settings: {settings_difference(previous, fingerprint)}"
                              "; use a new --out folder or the same settings")
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


def _short(value: object, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def settings_difference(previous: dict[str, Any], current: dict[str, Any]) -> str:
    """The keys whose values differ, each as "key OLD (this run: NEW)", values shortened: the voice list alone
    runs to hundreds of ids, so a list is described by its length and first differing item, never dumped."""
    parts = []
    for key in sorted(set(previous) | set(current)):
        old, new = previous.get(key), current.get(key)
        if old == new:
            continue
        if isinstance(old, list) and isinstance(new, list):
            i = next(i for i in range(max(len(old), len(new))) if old[i:i + 1] != new[i:i + 1])
            was, now = (_short(v[i]) if i < len(v) else "none" for v in (old, new))
            parts.append(f"{key}: {len(old)} items (this run: {len(new)}), item {i + 1} {was} (this run: {now})")
        else:
            was, now = (_short(d[key]) if key in d else "unset" for d in (previous, current))
            parts.append(f"{key} {was} (this run: {now})")
    return ", ".join(parts)


def _results(tasks: list[Task], done: dict[tuple[str, int], dict[str, Any]],
             pool: multiprocessing.pool.Pool | None) -> Iterator[dict[str, Any]]:
    """Entries in task order: from the previous run when recorded, else synthesised (in the pool if any)."""
    todo = [t for t in tasks if (t.split, t.index) not in done]
    made = iter(pool.imap(make_utterance, todo) if pool is not None else map(make_utterance, todo))
    for t in tasks:
        yield done[(t.split, t.index)] if (t.split, t.index) in done else {"split": t.split, **next(made)}


def generate(settings: Settings) -> dict[str, Any]:
    """Write the dataset described by `settings`; return a summary (counts, hours, voices, vocabulary)."""
    from tqdm import tqdm

    started = time.monotonic()
    out = out_folder(Path(settings.out).expanduser())
    voices = find_voices(settings.engines or None)
    split_voices = {"train": tuple(v for v in voices if not v.heldout),
                    "heldout": tuple(v for v in voices if v.heldout)}
    if not split_voices["heldout"]:
        raise ConfigError("no held-out voice installed: espeak-ng's variants are needed")
    fingerprint: dict[str, Any] = {"seed": settings.seed, "voices": [v.id for v in voices]}
    if settings.formant_shift:  # only when used, so folders made before the option still resume
        fingerprint["formant_shift"] = settings.formant_shift
    done = _progress_entries(out, fingerprint)
    jobs = settings.jobs or os.cpu_count() or 1
    # fork where there is one: spawn would re-import the `runtime` CLI (and torch) in every worker, seconds each
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(method).Pool(jobs, initializer=worker_process_defaults) if jobs > 1 else None
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
                tasks = [Task("train", i, settings.seed, str(out), split_voices["train"], settings.formant_shift)
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
    parser.add_argument("--formant-shift", type=float, default=d.formant_shift, metavar="F",
                        help="move each flite training clip's formants by a factor in [1/(1+F), 1+F], pitch and "
                        "tempo kept: new speakers from flite's few voices (default: 0, off; never the held-out set)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if not 0 < args.hours < math.inf:
        raise ConfigError(f"--hours must be a finite number > 0, got {args.hours}")
    if args.heldout < 0 or args.jobs < 0:
        raise ConfigError(f"--heldout and --jobs must be at least 0 (--jobs 0: one per CPU core), got --heldout "
                          f"{args.heldout} --jobs {args.jobs}")
    if not 0 <= args.formant_shift <= 0.5:
        raise ConfigError(f"--formant-shift must be in [0, 0.5] (a factor of at most 1.5), got {args.formant_shift}")
    summary = generate(Settings(args.out, args.hours, args.heldout, args.seed, args.jobs, engines, args.quiet,
                                args.formant_shift))
    print(json.dumps(summary))
    return 0
