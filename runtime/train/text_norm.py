"""The one text normaliser shared by training data, training targets and scoring.

A transcript and a hypothesis can only be compared fairly if both went through the same rules, and a model
can only learn to write numbers one way if its targets always spell them one way. So every text in the
synthetic data, every training target and both sides of WER/CER go through `normalize`:

- numbers become words (`15,000` -> "fifteen thousand", `3.5` -> "three point five", `21st` -> "twenty
  first", `1984` -> "nineteen eighty four", `5:30` -> "five thirty", `$12.50` -> "twelve dollars and fifty
  cents", `40%` -> "forty percent", `-3` -> "minus three");
- `&` -> "and"; accents are folded to ASCII; everything is lowercased;
- punctuation is stripped (hyphens and slashes split words), apostrophes survive only inside words
  ("don't", "children's"), and whitespace collapses to single spaces.

`expand` is the first half (numbers and symbols to words, case and punctuation kept): it is what the speech
synthesisers are given, so what they say is exactly what `normalize` writes down.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                  "nine": "ninth", "twelve": "twelfth"}


def number_to_words(n: int) -> str:
    """Cardinal, American style without "and": 1215 -> "one thousand two hundred fifteen"."""
    if n < 0:
        return "minus " + number_to_words(-n)
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("" if ones == 0 else " " + _ONES[ones])
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + ("" if rest == 0 else " " + number_to_words(rest))
    for scale, name in _SCALES:
        if n >= scale:
            if n >= scale * 1000 and scale == 10**12:
                return " ".join(number_to_words(int(d)) for d in str(n))  # beyond trillions: digit by digit
            high, rest = divmod(n, scale)
            return number_to_words(high) + " " + name + ("" if rest == 0 else " " + number_to_words(rest))
    raise AssertionError(n)


def ordinal_to_words(n: int) -> str:
    """21 -> "twenty first", 100 -> "one hundredth"."""
    words = number_to_words(n).split()
    last = words[-1]
    if last in _ORDINAL_WORDS:
        words[-1] = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return " ".join(words)


def year_to_words(n: int) -> str:
    """How years are said: 1984 -> "nineteen eighty four", 1900 -> "nineteen hundred", 2024 -> "twenty twenty
    four", 1905 -> "nineteen oh five"; 2000-2009 stay cardinals ("two thousand five")."""
    if 2000 <= n <= 2009 or not 1100 <= n <= 2099:
        return number_to_words(n)
    high, low = divmod(n, 100)
    if low == 0:
        return number_to_words(high) + " hundred"
    return number_to_words(high) + " " + (("oh " + _ONES[low]) if low < 10 else number_to_words(low))


def _digits(s: str) -> str:
    return " ".join(_ONES[int(d)] for d in s)


def _decimal(whole: str, frac: str) -> str:
    return number_to_words(int(whole.replace(",", "") or "0")) + " point " + _digits(frac)


def _money(m: re.Match[str]) -> str:
    whole, cents, scale = m.group(1).replace(",", ""), m.group(2), m.group(3)
    if scale:  # $3.5 million -> three point five million dollars
        amount = _decimal(whole, cents) if cents else number_to_words(int(whole))
        return f"{amount} {scale.lower()} dollars"
    dollars = int(whole)
    out = number_to_words(dollars) + (" dollar" if dollars == 1 else " dollars")
    if cents:
        c = int((cents + "0")[:2])
        if c:
            out += " and " + number_to_words(c) + (" cent" if c == 1 else " cents")
    return out


def _time(m: re.Match[str]) -> str:
    hour, minute = int(m.group(1)), int(m.group(2))
    if minute == 0:
        return number_to_words(hour) + " o'clock"
    if minute < 10:
        return number_to_words(hour) + " oh " + _ONES[minute]
    return number_to_words(hour) + " " + number_to_words(minute)


def _plain_number(m: re.Match[str]) -> str:
    sign, whole, frac = m.group(1), m.group(2), m.group(3)
    if frac is not None:
        out = _decimal(whole, frac)
    elif "," not in whole and len(whole) == 4:
        out = year_to_words(int(whole))
    elif "," not in whole and len(whole) > 1 and whole.startswith("0"):
        out = _digits(whole)  # codes, "007": digit by digit
    else:
        out = number_to_words(int(whole.replace(",", "")))
    return ("minus " if sign else "") + out


_MONEY = re.compile(r"\$\s?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:\s+(million|billion|thousand|trillion)\b)?",
                    re.IGNORECASE)
_TIME = re.compile(r"\b(\d{1,2}):(\d{2})\b")
_ORDINAL = re.compile(r"\b(\d+)(st|nd|rd|th)\b", re.IGNORECASE)
_PERCENT = re.compile(r"(\d)\s?%")
_NUMBER = re.compile(r"(?<![\w.])(-)?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})


def expand(text: str) -> str:
    """Numbers and symbols to words, keeping case and punctuation: what a speech synthesiser is given."""
    text = unicodedata.normalize("NFKD", text.translate(_APOSTROPHES))
    text = "".join(c for c in text if not unicodedata.combining(c)).encode("ascii", "ignore").decode()
    text = _MONEY.sub(_money, text)
    text = _TIME.sub(_time, text)
    text = _ORDINAL.sub(lambda m: ordinal_to_words(int(m.group(1))), text)
    text = _PERCENT.sub(r"\1 percent", text)
    text = _NUMBER.sub(_plain_number, text)
    text = re.sub(r"(?<=[A-Za-z])(?=\d)|(?<=\d)(?=[A-Za-z])", " ", text)  # "4x4" -> "4 x 4" before digits go
    text = re.sub(r"\d+", lambda m: _digits(m.group(0)), text)  # any digits left: one by one
    return text.replace("&", " and ").replace("+", " plus ").replace("=", " equals ")


def normalize(text: str) -> str:
    """The training target and scoring form: `expand`, lowercase, punctuation stripped, whitespace collapsed."""
    text = expand(text).lower()
    text = re.sub(r"[^a-z' ]+", " ", text)  # hyphens, slashes, periods...: word breaks
    text = re.sub(r"(?<![a-z])'|'(?![a-z])", " ", text)  # apostrophes only inside words
    return " ".join(text.split())


def _edits(ref: Sequence[str], hyp: Sequence[str]) -> int:
    """Levenshtein distance (substitutions, insertions, deletions) between two token sequences."""
    if len(ref) < len(hyp):
        ref, hyp = hyp, ref
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i]
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1]


def wer(refs: Sequence[str], hyps: Sequence[str]) -> float:
    """Corpus word error rate: total word edits over total reference words, both sides `normalize`d."""
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    pairs = [(normalize(r).split(), normalize(h).split()) for r, h in zip(refs, hyps, strict=True)]
    return sum(_edits(r, h) for r, h in pairs) / max(1, sum(len(r) for r, _ in pairs))


def cer(refs: Sequence[str], hyps: Sequence[str]) -> float:
    """Corpus character error rate over the `normalize`d texts (spaces count as characters)."""
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    pairs = [(normalize(r), normalize(h)) for r, h in zip(refs, hyps, strict=True)]
    return sum(_edits(r, h) for r, h in pairs) / max(1, sum(len(r) for r, _ in pairs))
