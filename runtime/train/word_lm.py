"""`runtime train word-lm`: the word n-gram the FastConformer's beam search scores words with.

It is estimated from the training split's transcripts only (`train.jsonl` of a `runtime train synth-speech`
folder, the same texts the acoustic model learnt from), never from the held-out split: a text whose hash puts
it in the held-out split is refused, so the held-out scores of `runtime bench asr-quality` stay honest. The
model is written as `lm.arpa` into a checkpoint directory, where `asr.decoder = "beam"` finds it, or to any
`.arpa` path. The held-out texts' perplexity is reported, since it is the only LM-side number that says
how much the LM knows about sentences it never saw.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from runtime.errors import ConfigError
from runtime.models.asr.fastconformer.decoding import LM_FILE
from runtime.models.asr.word_lm import WordLM
from runtime.train.texts import is_heldout

DEFAULT_ORDER = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="a `runtime train synth-speech` folder (its train.jsonl)")
    parser.add_argument("--out", required=True, help="a checkpoint directory (lm.arpa is written into it) or a "
                        ".arpa file path")
    parser.add_argument("--order", type=int, default=DEFAULT_ORDER,
                        help="n-gram order (default: %(default)s; 2 is a third of the size)")


def training_sentences(data: Path) -> list[list[str]]:
    """The normalised words of each training transcript; refuses a folder whose training texts are held out."""
    manifest = data / "train.jsonl"
    if not manifest.is_file():
        raise ConfigError(f"{data} has no train.jsonl; pass a folder made by `runtime train synth-speech`")
    texts = [json.loads(line)["text"] for line in manifest.read_text().splitlines() if line.strip()]
    leaked = [t for t in texts if is_heldout(t)]
    if leaked:
        raise ConfigError(f"{manifest}: {len(leaked)} training texts belong to the held-out split "
                          f"(first: {leaked[0]!r}); an LM estimated from them would inflate held-out scores")
    if not texts:
        raise ConfigError(f"{manifest} holds no transcripts")
    return [t.split() for t in texts]


def heldout_perplexity(lm: WordLM, data: Path) -> float | None:
    """Per-word perplexity (</s> counted) of the held-out transcripts, when the folder has them."""
    manifest = data / "heldout.jsonl"
    if not manifest.is_file():
        return None
    sentences = [json.loads(line)["text"].split() for line in manifest.read_text().splitlines() if line.strip()]
    words = sum(len(s) + 1 for s in sentences)
    return math.exp(-sum(lm.sentence_logp(s) for s in sentences) / words) if words else None


def run(args: argparse.Namespace) -> int:
    if args.order < 1:
        raise ConfigError(f"--order must be >= 1, got {args.order}")
    data = Path(args.data).expanduser()
    out = Path(args.out).expanduser()
    path = out if out.suffix == ".arpa" else out / LM_FILE
    if out.suffix != ".arpa" and not out.is_dir():
        raise ConfigError(f"--out {out}: no such directory (give a checkpoint directory or a .arpa path)")
    started = time.perf_counter()
    sentences = training_sentences(data)
    lm = WordLM.fit(sentences, order=args.order)
    path.parent.mkdir(parents=True, exist_ok=True)  # only a .arpa path's folder is made
    lm.save_arpa(path)
    perplexity = heldout_perplexity(lm, data)
    print(json.dumps({
        "out": str(path), "order": args.order, "sentences": len(sentences), "vocabulary": len(lm.vocabulary),
        "bytes": path.stat().st_size, "heldout_perplexity": round(perplexity, 1) if perplexity else None,
        "wall_s": round(time.perf_counter() - started, 1),
    }))
    return 0
