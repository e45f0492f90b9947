"""What the synthetic speech says: real English sentences, number-heavy templates and random word strings.

Three kinds of text, so a small ASR learns both English word sequences and to spell words it cannot predict:

- **sentences**: the usage examples of WordNet 3.0 ("he stood on a high cliff overlooking the town"), taken
  from Debian's `wordnet-base` package and shipped in `assets/wordnet_examples.txt` (WordNet 3.0 license,
  `assets/WORDNET_LICENSE.txt`: use, copy, modify and distribute for any purpose with the notice kept).
  Only sentences whose every word is among the 5,000 most frequent words of the examples are kept, so the
  vocabulary is several thousand words a small model can learn, not the long tail of the dictionary.
- **templates**: sentences from this module's own small grammar, written for this project, full of numbers,
  times, dates, money and percentages (WordNet's examples have few), spelled with digits and symbols so the
  normaliser's number rules are exercised.
- **word strings**: 3-10 words drawn uniformly from the vocabulary, so no language model can guess them.

The held-out split is a pure function of the normalised text (a hash), so it never depends on a seed, and a
held-out text can never be drawn for training whatever the kind.

`python -m runtime.train.texts --build-assets` rebuilds the sentence asset from the installed `wordnet-base`.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from runtime.train.text_norm import normalize

ASSETS = Path(__file__).with_name("assets")
SENTENCES_FILE = ASSETS / "wordnet_examples.txt"
WORDS_FILE = ASSETS / "wordnet_words.txt"
WORDNET_DIR = Path("/usr/share/wordnet")
VOCAB_SIZE = 5000
HELDOUT_MODULUS = 20  # 1 text in 20 is held out

KINDS = ("sentence", "template", "words")
KIND_WEIGHTS = (0.6, 0.2, 0.2)


def is_heldout(text: str) -> bool:
    """Whether a text belongs to the held-out split: a fixed hash of its normalised form, seed-independent."""
    digest = hashlib.sha1(normalize(text).encode()).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_MODULUS == 0


# -- the project's own templates ----------------------------------------------------------------------------
_NAMES = ("Anna", "Ben", "Carlos", "Diana", "Ethan", "Fatima", "George", "Hannah", "Ivan", "Julia", "Kevin", "Laura",
          "Mohammed", "Nina", "Oscar", "Priya", "Quentin", "Rosa", "Samuel", "Tara", "Umar", "Victor", "Wendy", "Yusuf",
          "Zoe")
_PLACES = ("the station", "the library", "the office", "the airport", "the museum", "the park", "the market",
           "the hospital", "the school", "the harbor", "the bridge", "the hotel", "the bank", "the garden")
_THINGS = ("apples", "books", "chairs", "tickets", "boxes", "bottles", "letters", "pencils", "windows", "coins",
           "shirts", "plates", "cups", "songs", "photos", "trees", "cars", "bikes", "keys", "lamps")
_UNITS = ("meters", "kilometers", "miles", "kilograms", "pounds", "liters", "degrees", "minutes", "hours",
          "days", "weeks", "years", "seconds", "feet", "inches")
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
           "December")
_TEMPLATES = (
    "{name} bought {n} {thing} at {place}.",
    "The train leaves at {time} on {day}.",
    "Please meet me at {place} at {time}.",
    "It costs {money}, which is too much.",
    "The price went up by {pct} last year.",
    "{name} was born on {month} {ordinal}, {year}.",
    "We walked {n} {unit} before lunch.",
    "There are {big} people living in this town.",
    "Call {name} back before {time}, please.",
    "The meeting moved to {day} the {ordinal}.",
    "About {pct} of the {thing} were broken.",
    "Room {n} is on the {ordinal} floor.",
    "In {year}, {name} moved to a new city.",
    "The temperature dropped to {n} degrees overnight.",
    "{name} paid {money} for {n} {thing}.",
    "Flight {code} is delayed until {time}.",
    "The score was {n} to {m} at half time.",
    "Is it really {n} {unit} from {place}?",
    "Only {n} out of {big} tickets are left.",
    "The report says sales grew {pct} in {year}.",
    "{name} finished {ordinal} out of {m} runners.",
    "Turn left after {n} {unit} and wait at {place}.",
    "Her phone number ends in {code}.",
    "We need {n} more {thing} by {day}.",
    "The bill came to {money}, tip included.",
    "Add {n} and {m}, then divide by {k}.",
    "The {ordinal} chapter was written in {year}.",
    "It is {time} and {name} is still at {place}.",
    "The bridge is {big} {unit} long.",
    "Is {name} coming on {month} {ordinal}?",
)


def _template(rng: np.random.Generator) -> str:
    def pick(seq: tuple[str, ...] | list[str]) -> str:
        return seq[int(rng.integers(len(seq)))]

    n = int(rng.choice([rng.integers(2, 13), rng.integers(13, 100), rng.integers(100, 1000)]))
    hour, minute = int(rng.integers(1, 13)), int(rng.choice([0, 5, 10, 15, 20, 30, 45, rng.integers(0, 60)]))
    dollars = int(rng.choice([rng.integers(1, 20), rng.integers(20, 1000), rng.integers(1000, 100000)]))
    cents = int(rng.integers(1, 100)) if rng.random() < 0.3 else 0
    money = f"${dollars:,}" + (f".{cents:02d}" if cents else "")
    pct = f"{int(rng.integers(1, 100))}%" if rng.random() < 0.8 else f"{rng.integers(1, 100)}.{rng.integers(1, 10)}%"
    big = int(rng.choice([rng.integers(1000, 10000), rng.integers(10000, 1000000), rng.integers(10**6, 10**8)]))
    slots = {
        "name": pick(_NAMES), "place": pick(_PLACES), "thing": pick(_THINGS), "unit": pick(_UNITS),
        "day": pick(_DAYS), "month": pick(_MONTHS), "n": str(n), "m": str(int(rng.integers(2, 60))),
        "k": str(int(rng.integers(2, 10))), "time": f"{hour}:{minute:02d}", "money": money, "pct": pct,
        "ordinal": _ordinal_digits(int(rng.integers(1, 32))), "year": str(int(rng.integers(1900, 2040))),
        "big": f"{big:,}" if rng.random() < 0.5 else str(big), "code": f"{int(rng.integers(0, 10000)):04d}",
    }
    return pick(_TEMPLATES).format(**slots)


def _ordinal_digits(n: int) -> str:
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# -- the WordNet sentences ----------------------------------------------------------------------------------
_SENTENCE_CHARS = re.compile(r"[A-Za-z0-9 ,'?!;:-]+[.?!]?")


def _usable(sentence: str) -> bool:
    """Text a synthesiser says exactly as `normalize` writes it: no abbreviations or acronyms it might spell
    or expand ("Mr.", "U.S.", "NATO", "II"), ordinary punctuation only, 4-16 words."""
    if not _SENTENCE_CHARS.fullmatch(sentence) or not 4 <= len(sentence.split()) <= 16:
        return False
    return not any(sum(c.isupper() for c in w) > 1 for w in sentence.split())


_QUOTED = re.compile(r'"([^"]*)"')


def _glosses(wordnet_dir: Path) -> list[str]:
    """Every synset's gloss: its definition, then its quoted usage examples."""
    glosses = []
    for pos in ("noun", "verb", "adj", "adv"):
        with open(wordnet_dir / f"data.{pos}", encoding="latin-1") as f:
            for line in f:
                if line.startswith("  ") or " | " not in line:  # the license header lines start with spaces
                    continue
                glosses.append(line.split(" | ", 1)[1])
    return glosses


def build_wordnet_examples(wordnet_dir: Path = WORDNET_DIR, vocab_size: int = VOCAB_SIZE) -> list[str]:
    """WordNet's quoted usage examples, filtered by `_usable`, restricted to sentences whose every normalised
    word is among the `vocab_size` most frequent words of all usable examples; deduplicated, sorted."""
    examples = [s.strip() for gloss in _glosses(wordnet_dir) for s in _QUOTED.findall(gloss)]
    usable = [s for s in examples if _usable(s)]
    counts = Counter(w for s in usable for w in normalize(s).split())
    vocab = {w for w, _ in counts.most_common(vocab_size)}
    kept: dict[str, str] = {}
    for s in usable:
        norm = normalize(s)
        if norm and all(w in vocab for w in norm.split()):
            kept.setdefault(norm, s)
    return sorted(kept.values(), key=lambda s: (normalize(s), s))


def build_wordnet_words(wordnet_dir: Path = WORDNET_DIR, min_count: int = 1) -> list[str]:
    """The words WordNet's definitions (not its usage examples) use at least `min_count` times, normalised
    as transcripts are, single letters left out: a general English vocabulary of some 40,000 words, with the
    inflected forms a definition uses ("slides", "stays"), for a word LM to list beyond its training texts.
    The examples are left out so that a development set made of examples can measure how often this list
    covers words it was not built from."""
    counts = Counter(w for gloss in _glosses(wordnet_dir) for w in normalize(_QUOTED.sub(" ", gloss)).split())
    return sorted(w for w, c in counts.items() if c >= min_count and len(w) > 1 and w.strip("'") == w)


@dataclass
class TextSource:
    """Draws texts for one split. Each draw is a pure function of the generator passed in, so an utterance's
    text depends only on its own (seed, index) stream, not on the order workers run in."""

    sentences: list[str]

    @classmethod
    def load(cls, path: Path = SENTENCES_FILE) -> TextSource:
        """The shipped sentence asset (comment lines starting with `#` skipped)."""
        lines = path.read_text(encoding="utf-8").splitlines()
        return cls([s for s in (line.strip() for line in lines) if s and not s.startswith("#")])

    @cached_property
    def split_sentences(self) -> dict[bool, list[str]]:
        out: dict[bool, list[str]] = {False: [], True: []}
        for s in self.sentences:
            out[is_heldout(s)].append(s)
        return out

    @cached_property
    def vocabulary(self) -> list[str]:
        """Every normalised word of the sentences, sorted: the words of the random word strings."""
        return sorted({w for s in self.sentences for w in normalize(s).split()})

    def draw(self, rng: np.random.Generator, heldout: bool, max_words: int = 16) -> tuple[str, str]:
        """(kind, text) for the split; text is as written (digits, punctuation), to be `expand`ed for speech."""
        kind = KINDS[int(rng.choice(len(KINDS), p=KIND_WEIGHTS))]
        for _ in range(1000):
            if kind == "sentence":
                pool = self.split_sentences[heldout]
                text = pool[int(rng.integers(len(pool)))]
            elif kind == "template":
                text = _template(rng)
            else:
                n = int(rng.integers(3, 11))
                text = " ".join(self.vocabulary[int(i)] for i in rng.integers(len(self.vocabulary), size=n))
            if is_heldout(text) == heldout and len(normalize(text).split()) <= max_words:
                return kind, text
        raise RuntimeError("no text of the requested split found")  # 1000 misses at 1/20 odds: impossible


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.train.texts --build-assets`: rewrite the sentence and word assets from `wordnet-base`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-assets", action="store_true",
                   help="rebuild assets/wordnet_examples.txt and assets/wordnet_words.txt")
    p.add_argument("--wordnet", default=str(WORDNET_DIR), help="WordNet dict folder (Debian: wordnet-base)")
    args = p.parse_args(argv)
    if not args.build_assets:
        src = TextSource.load()
        print(f"{len(src.sentences)} sentences ({len(src.split_sentences[True])} held out), "
              f"{len(src.vocabulary)} words")
        return 0
    notice = ("# WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved. License: see "
              "WORDNET_LICENSE.txt.\n")
    sentences = build_wordnet_examples(Path(args.wordnet))
    SENTENCES_FILE.write_text("# Usage examples from WordNet 3.0 (Debian package wordnet-base), filtered by "
                              "runtime.train.texts.\n" + notice + "\n".join(sentences) + "\n", encoding="utf-8")
    print(f"wrote {len(sentences)} sentences to {SENTENCES_FILE}")
    words = build_wordnet_words(Path(args.wordnet))
    WORDS_FILE.write_text("# The words of the definitions of WordNet 3.0 (Debian package "
                          "wordnet-base), normalised by runtime.train.texts.\n" + notice + "\n".join(words) + "\n",
                          encoding="utf-8")
    print(f"wrote {len(words)} words to {WORDS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
