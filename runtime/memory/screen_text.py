"""What has been on screen, as text: each read of a frame (lines with boxes and confidences) merged into
*screens*, stable on-screen text with the media-time span it was shown.

A read continues the current screen when it holds at least two thirds of the screen's lines again (the same
slide read again, or a slide building up bullet by bullet); matching lines keep their first sighting and take
the better-read text, new ones join in reading order. Otherwise the current screen closes and a new one opens;
a read with no text closes it (a scene without text). Lines below `min_confidence` are left out. The screens
kept are bounded (`max_screens`, oldest dropped); what the language model's context holds of them, within a
token budget, is the screen notes' business (`screen_notes.py`).
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass, field

from runtime.models.ocr.reader import TextLine

SAME_LINE = 0.8  # difflib ratio of two reads of one line (OCR varies by a character or a space)
SAME_SCREEN = 2 / 3  # of the current screen's lines read again: the same screen


@dataclass
class ScreenLine:
    text: str
    box: tuple[float, float, float, float]
    confidence: float
    first_seen: float
    last_seen: float


@dataclass
class Screen:
    screen_id: str
    start: float
    end: float
    lines: list[ScreenLine] = field(default_factory=list)
    closed: bool = False

    @property
    def text(self) -> str:
        return " | ".join(line.text for line in self.lines)


def _key(text: str) -> str:
    return "".join(text.lower().split())


def _match(line: TextLine, lines: list[ScreenLine]) -> ScreenLine | None:
    best, score = None, SAME_LINE
    for candidate in lines:
        ratio = difflib.SequenceMatcher(None, _key(line.text), _key(candidate.text)).ratio()
        if ratio >= score:
            best, score = candidate, ratio
    return best


class ScreenText:
    def __init__(self, *, min_confidence: float = 0.6, max_screens: int = 64) -> None:
        self.min_confidence, self.max_screens = min_confidence, max_screens
        self.screens: list[Screen] = []
        self._ids = itertools.count()

    @property
    def current(self) -> Screen | None:
        return self.screens[-1] if self.screens and not self.screens[-1].closed else None

    def add(self, time: float, lines: list[TextLine]) -> Screen | None:
        """Merge one read at media `time`; returns the screen it opened or changed (None: nothing new)."""
        kept = [line for line in lines if line.confidence >= self.min_confidence and line.text.strip()]
        screen = self.current
        if screen is not None:
            matches = [_match(line, screen.lines) for line in kept]
            if len({id(m) for m in matches if m is not None}) >= SAME_SCREEN * len(screen.lines):
                return self._continue(screen, time, kept, matches)
            screen.closed = True
            screen.end = time
        if not kept:
            return None
        screen = Screen(f"screen_{next(self._ids)}", time, time,
                        [ScreenLine(t.text, t.box, t.confidence, time, time) for t in kept])
        self.screens.append(screen)
        del self.screens[: -self.max_screens]
        return screen

    def _continue(self, screen: Screen, time: float, kept: list[TextLine],
                  matches: list[ScreenLine | None]) -> Screen | None:
        screen.end = time
        changed = False
        for line, match in zip(kept, matches, strict=True):
            if match is None:
                screen.lines.append(ScreenLine(line.text, line.box, line.confidence, time, time))
                changed = True
                continue
            match.last_seen = time
            if line.confidence > match.confidence and line.text != match.text:
                match.text, match.box, match.confidence = line.text, line.box, line.confidence
                changed = True
        screen.lines.sort(key=lambda s: (round(s.box[1], 2), s.box[0]))
        return screen if changed else None

    def at(self, time: float) -> Screen | None:
        """The screen shown at media `time` (the last one that started at or before it and had not closed)."""
        for screen in reversed(self.screens):
            if screen.start <= time and (not screen.closed or time < screen.end):
                return screen
        return None
