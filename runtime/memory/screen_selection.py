"""Which earlier screens a question points at: by the words they share, and by time words relative to another
screen ("the slide before the budget", "the next one after hiring", "the first slide").

Lexical and deterministic on purpose: a question about a slide nearly always repeats its words (a name, a number,
a title), OCR gives those words exactly, and a rule that can be read is one a test can pin down. A shared word
counts less the more screens hold it (1 / the number of screens with it), so "plan" on every slide does not
outvote "Lisbon" on one. Words about the medium itself ("slide", "screen", "shown") and function words are left
out. The first time word in the question sets the relation; the content words after it name the anchor screen.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Literal, Protocol

Relation = Literal["before", "after", "first", "last"]

RELATIONS: dict[str, Relation] = {
    "before": "before", "previous": "before", "preceding": "before", "prior": "before",
    "after": "after", "next": "after", "following": "after",
    "first": "first", "opening": "first",
    "last": "last", "latest": "last", "final": "last",
}
_STOP_WORDS = """
a an the and or but if of to in on at by for from with about into over under as is are was were be been being
do does did done has have had having it its this that these those there here then than so such not no yes
what which who whom whose when where why how much many any some all each every other more most very just
i you he she we they me him her us them my your his our their can could would should will shall may might must
tell say said says saying mention mentioned show shows shown showed slide slides screen screens page pages
title titled called name named read reads text line lines up one again also only still now
"""
STOP = frozenset(_STOP_WORDS.split())
_WORD = re.compile(r"[a-z0-9]+(?:[.,:][0-9]+)*")


class Selectable(Protocol):
    """A screen as selection sees it: its whole text."""

    @property
    def full(self) -> str: ...


def words(text: str) -> list[str]:
    """Lower-case words and numbers ("4.2", "12:30" whole), a plural's "s" cut, function words left out."""
    out = []
    for word in _WORD.findall(text.lower()):
        if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")) and word not in STOP:
            # not "previous", "status", nor "does"
            word = word[:-1]
        out.append(word)
    return out


def content(text: str) -> list[str]:
    return [w for w in words(text) if w not in STOP and w not in RELATIONS]


def relation(question: str) -> tuple[Relation | None, list[str]]:
    """The question's time word and, for "before"/"after", the content words after it (the anchor's words).
    "First"/"last" count only without one ("the first slide after X" is the one after X)."""
    said = words(question)
    for i, word in enumerate(said):
        if RELATIONS.get(word) in ("before", "after"):
            return RELATIONS[word], [w for w in said[i + 1 :] if w not in STOP and w not in RELATIONS]
    return next(((RELATIONS[w], []) for w in said if w in RELATIONS), (None, []))


def overlap(asked: Sequence[str], screens: Sequence[Selectable]) -> list[float]:
    """Per screen: the sum over the asked words it holds of 1 / (screens holding that word)."""
    held = [set(content(s.full)) for s in screens]
    df = Counter(w for h in held for w in h)
    unique = set(asked)
    return [sum(1.0 / df[w] for w in unique & h) for h in held]


def pick(question: str, screens: Sequence[Selectable]) -> list[int]:
    """Indices into `screens` (in time order) of those the question points at, most pointed-at first: the
    screen its time word names, then those sharing its words, at least half as much as the best one (ties: the
    newer first)."""
    picked: list[int] = []
    kind, anchor_words = relation(question)
    target = _target(kind, anchor_words, screens) if kind is not None else None
    if target is not None and 0 <= target < len(screens):
        picked.append(target)
    # the anchor's own words point at the anchor, not at what the question asks about
    asked = [w for w in content(question) if not picked or w not in anchor_words]
    scores = overlap(asked, screens)
    best = max(scores, default=0.0)  # a word on every screen alone does not pick them all
    ranked = sorted((i for i, s in enumerate(scores) if s > 0 and s >= best / 2), key=lambda i: (-scores[i], -i))
    picked += [i for i in ranked if i not in picked]
    return picked


def _target(kind: Relation, anchor_words: list[str], screens: Sequence[Selectable]) -> int | None:
    """The screen a time word names: first or last; before or after the anchor (the screen its words match
    best, the newer on a tie); "before" without an anchor is the one before the newest. An anchor whose words
    no screen holds names nothing."""
    if kind == "first":
        return 0
    if kind == "last":
        return len(screens) - 1
    if not anchor_words:
        return len(screens) - 2 if kind == "before" else None
    scores = overlap(anchor_words, screens)
    anchor = max(range(len(screens)), key=lambda i: (scores[i], i), default=None)
    if anchor is None or scores[anchor] <= 0:
        return None
    return anchor - 1 if kind == "before" else anchor + 1
