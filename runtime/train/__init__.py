"""Training entry points behind `runtime train <recipe>`: each recipe module exposes `add_arguments(parser)`
and `run(args) -> int`. They import torch and the model code at import time, so a recipe module is imported
only when its subcommand is parsed or runs, never by `import runtime.train` or another command."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from types import ModuleType

# recipe name on the command line: (module in runtime.train, help, description)
RECIPES: dict[str, tuple[str, str, str]] = {
    "causal-whisper": (
        "causal_whisper", "LoRA adapters for Whisper's block-causal encoder",
        "Train LoRA adapters (q/k/v/out of encoder self-attention, decoder self- and cross-attention) so Whisper "
        "works with the block-causal encoder mask. DATA holds audio files, each with a same-named .txt transcript."),
    "distil-whisper": (
        "distil_whisper", "training pairs for causal-whisper, transcribed by the full-context teacher",
        "Join source clips into streaming-length examples, cut most at a random encoder frame, and write each "
        "with what the offline (full-context) Whisper transcribes from exactly that audio: the data "
        "`runtime train causal-whisper` distils from. DATA: any folder of audio."),
    "synth-speech": (
        "synth_speech", "(audio, text) pairs from offline speech synthesisers",
        "Synthesise English speech with espeak-ng (and flite/festival when installed), augmented, 16 kHz FLAC + "
        ".txt, with a fixed held-out set."),
    "fastconformer": (
        "fastconformer", "a small streaming FastConformer-CTC from scratch",
        "Train a cache-aware FastConformer-CTC with the streaming attention mask and causal convolutions used at "
        "inference, several look-aheads at once, CTC loss and its own unigram tokenizer. DATA: synth-speech's "
        "folder (train.jsonl, heldout.jsonl)."),
    "word-lm": (
        "word_lm", "the word n-gram a FastConformer's beam search scores words with",
        "Estimate an interpolated Kneser-Ney word n-gram from a synth-speech folder's training transcripts (never "
        "the held-out ones), with a word list beyond them, and write it as ARPA, into a checkpoint directory as "
        "lm.arpa (used by asr.decoder = \"beam\") or to a .arpa path."),
    "average": (
        "average", "one FastConformer checkpoint: the mean of several of one run",
        "Average the weights of two or more FastConformer checkpoints of one run (same architecture, features "
        "and tokenizer) into a new checkpoint directory."),
}


# recipes whose flags a lighter module defines (their config, without torch), so that `--help` answers at once
FLAGS: dict[str, str] = {"fastconformer": "fastconformer_config", "causal-whisper": "causal_whisper_config"}


def recipe(name: str) -> ModuleType:
    """The module behind `runtime train <name>`."""
    return importlib.import_module(f"runtime.train.{RECIPES[name][0]}")


def flags(name: str) -> ModuleType:
    """The module whose `add_arguments` defines `runtime train <name>`'s flags."""
    return importlib.import_module(f"runtime.train.{FLAGS.get(name, RECIPES[name][0])}")


class _RecipeParser(argparse.ArgumentParser):
    """A recipe's parser, given the recipe module's flags the first time it parses or prints its help: importing
    every recipe (torch, the model code) to build the command line would make every `runtime` command slow to
    parse, `--help` included."""

    recipe_name: str | None = None

    def _load(self) -> None:
        if self.recipe_name is not None:
            name, self.recipe_name = self.recipe_name, None
            flags(name).add_arguments(self)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subcommand per recipe, each with the recipe module's own flags (added when that recipe is named)."""
    recipes = parser.add_subparsers(dest="recipe", required=True, metavar="RECIPE", parser_class=_RecipeParser)
    for name, (_, summary, description) in RECIPES.items():
        recipes.add_parser(name, help=summary, description=description).recipe_name = name


def run(args: argparse.Namespace) -> int:
    return recipe(args.recipe).run(args)
