"""Which frames are worth reading: text on a screen changes rarely, and reading a frame costs about half a
second of CPU, so a slide shown for a minute is read a few times, not sixty.

Each frame is shrunk to a small grey thumbnail (block means: cheap, and blind to sensor noise); a thumbnail
pixel has *changed* when it moved by more than `PIXEL_DELTA`, and a picture differs from another when more than
`threshold` of its pixels changed. A frame is read when it differs from the last frame read, and has settled
(it does not differ from the frame before it: a transition or a moving camera is not read halfway), and at least
`min_interval_s` of media time passed since the last read. A settled picture is read again after `refresh_s`,
for changes too small to see in a thumbnail (one word edited).
"""

from __future__ import annotations

import numpy as np

THUMB = (54, 96)  # rows, columns
PIXEL_DELTA = 0.06  # grey levels (0..1) a thumbnail pixel must move to count as changed


def thumbnail(image: np.ndarray, shape: tuple[int, int] = THUMB) -> np.ndarray:
    """Grey block means of an RGB uint8 frame, float32 in [0, 1], `shape` (smaller frames keep their size)."""
    grey = image.astype(np.float32).mean(axis=2) / 255.0
    rows = np.linspace(0, grey.shape[0], min(shape[0], grey.shape[0]) + 1).astype(int)
    cols = np.linspace(0, grey.shape[1], min(shape[1], grey.shape[1]) + 1).astype(int)
    sums = np.add.reduceat(np.add.reduceat(grey, rows[:-1], axis=0), cols[:-1], axis=1)
    return sums / np.outer(np.diff(rows), np.diff(cols))


def changed_fraction(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return 1.0
    return float((np.abs(a - b) > PIXEL_DELTA).mean())


class ChangeDetector:
    def __init__(self, *, threshold: float = 0.004, min_interval_s: float = 2.0, refresh_s: float = 30.0) -> None:
        self.threshold, self.min_interval_s, self.refresh_s = threshold, min_interval_s, refresh_s
        self._previous: np.ndarray | None = None
        self._read: np.ndarray | None = None
        self._read_at = float("-inf")
        self.offered = 0

    def due(self, time: float, image: np.ndarray) -> bool:
        """Should the frame shown at media `time` be read? (Call `read_done` once it was.)"""
        self.offered += 1
        thumb = thumbnail(image)
        previous, self._previous = self._previous, thumb
        settled = previous is not None and changed_fraction(thumb, previous) <= self.threshold
        if not settled or time - self._read_at < self.min_interval_s:
            return False
        new = self._read is None or changed_fraction(thumb, self._read) > self.threshold
        return new or time - self._read_at >= self.refresh_s

    def read_done(self, time: float) -> None:
        """The frame last offered (at media `time`) was read."""
        self._read, self._read_at = self._previous, time
