"""`runtime train word-lm`: the word n-gram the FastConformer's beam search scores words with.

It is estimated from the training split's transcripts only (`train.jsonl` of a `runtime train synth-speech`
folder, the same texts the acoustic model learnt from), never from the held-out split: a text whose hash puts
it in the held-out split is refused, so the held-out scores of `runtime bench asr-quality` stay honest. The
model is written as `lm.arpa` into a checkpoint directory, where `asr.decoder = "beam"` finds it, or to any
`.arpa` path. The held-out texts' perplexity is reported, since it is the only LM-side number that says
how much the LM knows about sentences it never saw.

The training texts use a few thousand words, and the beam search all but forbids any other (`asr.oov_penalty`),
so a word list (`--words`, by default the ~43,000 words of WordNet's definitions shipped in
`runtime/train/assets/wordnet_words.txt`) joins the vocabulary with a small share of the probability
Kneser-Ney keeps for unseen words: a speaker's "slides" or "stays" can then be written when the acoustics
say so, while the words and word sequences of the training texts keep almost all of the mass.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from runtime.errors import ConfigError
from runtime.models.asr.word_lm import WordLM
from runtime.train.outputs import out_folder
from runtime.train.text_norm import normalize
from runtime.train.texts import WORDS_FILE, is_heldout

DEFAULT_ORDER = 3
DEFAULT_WORDS_WEIGHT = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="a `runtime train synth-speech` folder (its train.jsonl)")
    parser.add_argument("--out", required=True, help="a checkpoint directory (lm.arpa is written into it) or a "
                        ".arpa file path")
    parser.add_argument("--order", type=int, default=DEFAULT_ORDER,
                        help="n-gram order (default: %(default)s; 2 is a third of the size)")
    parser.add_argument("--words", default=str(WORDS_FILE),
                        help="a word list (one or more words a line, normalised like transcripts; '#' starts a "
                        "comment line) the LM also knows beyond the training texts' words; default: the shipped "
                        "words of WordNet's definitions; 'none' for the training words only")
    parser.add_argument("--words-weight", type=float, default=DEFAULT_WORDS_WEIGHT,
                        help="a listed word's share of the unseen-word probability, relative to a seen word's "
                        "(0 < W <= 1; default: %(default)s)")


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


def listed_words(spec: str) -> set[str]:
    """The normalised words of a `--words` file ('none': no words)."""
    if spec == "none":
        return set()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"--words {spec}: no such file (give a word list, or 'none')")
    lines = path.read_text(encoding="utf-8").splitlines()
    return {w for line in lines if not line.lstrip().startswith("#") for w in normalize(line).split()}


def heldout_perplexity(lm: WordLM, data: Path) -> float | None:
    """Per-word perplexity (</s> counted) of the held-out transcripts, when the folder has them."""
    manifest = data / "heldout.jsonl"
    if not manifest.is_file():
        return None
    sentences = [json.loads(line)["text"].split() for line in manifest.read_text().splitlines() if line.strip()]
    words = sum(len(s) + 1 for s in sentences)
    return math.exp(-sum(lm.sentence_logp(s) for s in sentences) / words) if words else None


def run(args: argparse.Namespace) -> int:
    from runtime.models.asr.fastconformer.decoding import LM_FILE  # the model package imports torch: not for --help

    if args.order < 1:
        raise ConfigError(f"--order must be >= 1, got {args.order}")
    if not 0.0 < args.words_weight <= 1.0:
        raise ConfigError(f"--words-weight must be in (0, 1], got {args.words_weight}")
    data = Path(args.data).expanduser()
    out = Path(args.out).expanduser()
    path = out if out.suffix == ".arpa" else out / LM_FILE
    if out.suffix != ".arpa" and not out.is_dir():
        raise ConfigError(f"--out {out}: no such directory (give a checkpoint directory or a .arpa path)")
    if out.suffix == ".arpa" and out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a .arpa file path or a checkpoint directory without "
                          "the .arpa suffix")
    out_folder(path.parent, "--out's folder", create=False)
    started = time.perf_counter()
    sentences = training_sentences(data)
    listed = listed_words(args.words)
    lm = WordLM.fit(sentences, order=args.order, listed=listed, listed_weight=args.words_weight)
    out_folder(path.parent, "--out's folder")  # only a .arpa path's folder is made
    lm.save_arpa(path)
    perplexity = heldout_perplexity(lm, data)
    print(json.dumps({
        "out": str(path), "order": args.order, "sentences": len(sentences), "vocabulary": len(lm.vocabulary),
        "listed_words_added": len(lm.vocabulary - {w for s in sentences for w in s}),
        "bytes": path.stat().st_size, "heldout_perplexity": round(perplexity, 1) if perplexity else None,
        "wall_s": round(time.perf_counter() - started, 1),
    }))
    return 0
