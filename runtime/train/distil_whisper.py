"""`runtime train distil-whisper`: training pairs for the causal adapters, transcribed by the full-context model.

CarelessWhisper's adapters must teach Whisper to read block-causal encoder states without losing what it knows
about human speech. Training on synthetic voices against their scripts would teach the scripts' style and the
synthesisers' voices; instead the teacher is the offline model itself (sequence-level distillation): each
example's target is what full-context Whisper (30 s padded, greedy, the decoding checked token for token
against CTranslate2) transcribes from exactly that audio, in its own casing, punctuation and numerals.

The examples are built for streaming:

- longer than a synthetic clip: 1-4 source clips joined with short pauses (up to `--max-seconds`), so the
  causal encoder sees utterances as long as people speak them;
- most of them cut at a random 20 ms encoder-frame boundary (the moment a block is emitted live), at least
  `--min-prefix-s` in (shorter prefixes are mostly silence, where the teacher hallucinates "Thank you."), and
  the teacher transcribes the prefix, less the sentence end it adds there (`at_the_cut`): the adapters learn
  what can be said from the audio heard so far, and to end (eos) at its edge instead of guessing on, which is
  where an unadapted Whisper loops; the rest are whole.

Output (`--out DIR`): `NNN/NNNNNN.flac` + `.txt` (the teacher's transcript), the layout `runtime train
causal-whisper --data DIR` reads, and `distil.jsonl` (sources, cut, duration, text per example). Example i is a
pure function of (seed, i) and the source list, so an interrupted run resumes where it stopped (examples whose
files exist are kept) and `--examples` can grow a finished set.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import soundfile

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError
from runtime.train.outputs import out_folder

if TYPE_CHECKING:
    from runtime.models.asr.whisper_buffered import WhisperBuffered

AUDIO_SUFFIXES = (".flac", ".wav", ".mp3", ".ogg", ".opus", ".m4a")
FRAME = SAMPLE_RATE // 50  # one 20 ms encoder frame
BATCH = 8  # examples transcribed together
TEACHER_TOKENS = 200  # a transcript's budget: 16 s of speech is under 100 tokens; a looping teacher is cut here


@dataclass(frozen=True)
class DistilConfig:
    base: str
    data: str
    out: str
    examples: int = 3000
    max_seconds: float = 16.0
    whole_share: float = 0.3
    min_prefix_s: float = 1.0
    seed: int = 0
    threads: int = 0
    language: str = "en"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistilConfig("", "", "")
    parser.add_argument("--base", required=True, help="the teacher: a Whisper checkpoint (builtin:whisper-tiny.en, "
                        "a CTranslate2 or transformers folder, a hub id)")
    parser.add_argument("--data", required=True, help="folder of source audio (searched recursively; transcripts "
                        "beside them are not used)")
    parser.add_argument("--out", required=True, help="output folder: NNN/NNNNNN.flac + .txt, distil.jsonl")
    parser.add_argument("--examples", type=int, default=d.examples, help="examples to write (resumes)")
    parser.add_argument("--max-seconds", type=float, default=d.max_seconds, help="longest joined example")
    parser.add_argument("--whole-share", type=float, default=d.whole_share,
                        help="share of examples kept whole (the rest are cut at a random frame)")
    parser.add_argument("--min-prefix-s", type=float, default=d.min_prefix_s, help="shortest cut prefix")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: one per core but one)")
    parser.add_argument("--language", default=d.language, help="language of a multilingual teacher")


def run(args: argparse.Namespace) -> int:
    summary = distil(DistilConfig(**{f.name: getattr(args, f.name) for f in fields(DistilConfig)}))
    print(json.dumps(summary))
    return 0


def at_the_cut(text: str) -> str:
    """The teacher's transcript of a cut prefix, less the sentence end it adds: Whisper ends every transcript
    with a period, but a cut is not the end of a sentence. Kept, it teaches the causal model that a period and
    eos follow wherever the audio stops, and live, where the audio always stops, it ends the item after its
    first sentence and never resumes."""
    return text.rstrip().rstrip(".?!,;:").rstrip()


def source_files(folder: str) -> list[Path]:
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--data {root} is not a directory")
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
    if not files:
        raise ConfigError(f"--data {root} holds no audio files ({', '.join(AUDIO_SUFFIXES)})")
    return files


def compose(index: int, sources: list[Path], cfg: DistilConfig,
            read: Callable[[Path], np.ndarray]) -> tuple[np.ndarray, dict[str, object]]:
    """Example `index`: joined source clips, maybe cut at a frame boundary; and what it is made of."""
    rng = np.random.default_rng([cfg.seed, index])
    limit = int(cfg.max_seconds * SAMPLE_RATE)
    parts: list[np.ndarray] = []
    used: list[str] = []
    size = 0
    for _ in range(int(rng.integers(1, 5))):
        source = sources[int(rng.integers(len(sources)))]
        clip = read(source)
        pause = np.zeros(int(rng.uniform(0.05, 0.8) * SAMPLE_RATE) if parts else 0, np.float32)
        if parts and size + len(pause) + len(clip) > limit:
            break
        parts += [pause, clip[:limit]]
        used.append(source.name)
        size += len(pause) + len(clip[:limit])
    audio = np.concatenate(parts).astype(np.float32)
    cut = None
    first = int(cfg.min_prefix_s * SAMPLE_RATE) // FRAME
    if rng.random() >= cfg.whole_share and len(audio) // FRAME > first + 1:
        cut = int(rng.integers(first, len(audio) // FRAME)) * FRAME + FRAME // 2  # a block's emission point
        audio = audio[:cut]
    return audio, {"sources": used, "cut_s": None if cut is None else round(cut / SAMPLE_RATE, 3)}


def fast_teacher(base: str, teacher: WhisperBuffered) -> Callable[[list[np.ndarray]], list[list[int]]] | None:
    """The same greedy transcripts, batched by CTranslate2, when it is installed and the teacher is a CTranslate2
    folder (as builtin:whisper-tiny.en is): no suppressed tokens, no blank suppression, float32, so its tokens
    are the runtime's own offline greedy tokens (tests/test_whisper_tiny_en.py checks exactly this), about ten
    times sooner on a CPU. None otherwise: the runtime's own decoding, one example at a time."""
    try:
        import ctranslate2
    except ImportError:
        return None
    import torch  # here, not at the top: `runtime train distil-whisper --help` answers without it

    from runtime.models.asr.whisper_ct2 import is_ct2_whisper_dir
    from runtime.models.loading import resolve_checkpoint

    folder = resolve_checkpoint(base, role="asr")
    if not is_ct2_whisper_dir(folder):
        return None
    engine = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32",
                                        intra_threads=max(1, torch.get_num_threads()))
    # CTranslate2 stops a Whisper decode at half its `max_length` here (measured on 4.8.5): ask for twice the
    # runtime's budget and cut to it, so both stop at the same token
    limit = 2 * (teacher.max_tokens + len(teacher.prompt_ids))

    def transcribe(batch: list[np.ndarray]) -> list[list[int]]:
        features = np.concatenate([teacher.feature_extractor(a, sampling_rate=SAMPLE_RATE, return_tensors="np")
                                   .input_features for a in batch])
        results = engine.generate(ctranslate2.StorageView.from_array(features.astype(np.float32)),
                                  [teacher.prompt_ids] * len(batch), beam_size=1, max_length=limit,
                                  suppress_blank=False, suppress_tokens=teacher.suppress)
        return [r.sequences_ids[0][: teacher.max_tokens] for r in results]

    return transcribe


def distil(cfg: DistilConfig) -> dict[str, object]:
    """Write the examples that are missing; returns a summary."""
    from tqdm import tqdm
    from transformers import WhisperFeatureExtractor

    from runtime.config import ASRConfig
    from runtime.models.asr.whisper_buffered import WhisperBuffered
    from runtime.models.asr.whisper_checkpoint import load_whisper
    from runtime.models.loading import configure_threads
    from runtime.train.data import load_audio

    if cfg.examples < 1 or cfg.max_seconds <= 0 or cfg.max_seconds > 30 or not 0 <= cfg.whole_share <= 1:
        raise ConfigError("--examples must be >= 1, --max-seconds in (0, 30] and --whole-share in [0, 1]")
    sources = source_files(cfg.data)
    out = out_folder(Path(cfg.out).expanduser())
    configure_threads(cfg.threads)
    model, tokenizer, path = load_whisper(cfg.base)
    teacher = WhisperBuffered(model, tokenizer, WhisperFeatureExtractor.from_pretrained(path),
                              ASRConfig(backend="whisper-buffered", model=cfg.base, language=cfg.language,
                                        max_new_tokens=min(TEACHER_TOKENS, model.config.max_target_positions // 2 - 4)),
                              name=cfg.base)
    cache: dict[Path, np.ndarray] = {}

    def read(p: Path) -> np.ndarray:
        if p not in cache:
            cache[p] = load_audio(p)
        return cache[p]

    manifest = out / "distil.jsonl"
    rows = {}
    if manifest.is_file():
        for line in manifest.read_text().splitlines():
            row = json.loads(line)
            if (out / row["audio"]).is_file():
                rows[row["index"]] = row
    transcribe = fast_teacher(cfg.base, teacher) or (lambda batch: [teacher.hypothesis(a) for a in batch])
    todo = [i for i in range(cfg.examples) if i not in rows]
    bar = tqdm(total=cfg.examples, initial=cfg.examples - len(todo), desc="distil-whisper", unit="example",
               file=sys.stderr, disable=None)
    with manifest.open("a") as log:
        for start in range(0, len(todo), BATCH):
            batch = todo[start : start + BATCH]
            made = [compose(i, sources, cfg, read) for i in batch]
            for i, (audio, info), ids in zip(batch, made, transcribe([a for a, _ in made]), strict=True):
                text = teacher.text(ids).strip()
                if info["cut_s"] is not None:
                    text = at_the_cut(text)
                rel = f"{i // 1000:03d}/{i:06d}.flac"
                (out / rel).parent.mkdir(exist_ok=True)
                soundfile.write(out / rel, audio, SAMPLE_RATE, subtype="PCM_16")
                (out / rel).with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
                rows[i] = {"index": i, "audio": rel, "text": text, "duration": round(len(audio) / SAMPLE_RATE, 3),
                           **info}
                log.write(json.dumps(rows[i]) + "\n")
            log.flush()
            bar.update(len(batch))
    bar.close()
    kept = [rows[i] for i in range(cfg.examples)]
    return {"out": str(out), "examples": len(kept), "hours": round(sum(r["duration"] for r in kept) / 3600, 3),
            "cut": sum(r["cut_s"] is not None for r in kept), "empty": sum(not r["text"] for r in kept),
            "teacher": cfg.base, "sources": len(sources)}
