"""Typed media chunks: what sources push into a session.

Audio is float32 mono at 16 kHz and carries its position as a sample index, so media time is exact
however the stream is cut; seconds are derived, never accumulated. Video frames are RGB uint8 arrays with
their media time in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16_000


@dataclass(frozen=True)
class AudioChunk:
    """`samples` float32 mono at SAMPLE_RATE, starting at sample index `start_sample` of the stream."""

    samples: np.ndarray
    start_sample: int

    def __post_init__(self) -> None:
        if self.samples.dtype != np.float32 or self.samples.ndim != 1:
            raise ValueError(f"audio must be 1-D float32, got {self.samples.dtype} {self.samples.shape}")
        if self.start_sample < 0:
            raise ValueError(f"start_sample must be >= 0, got {self.start_sample}")

    @property
    def end_sample(self) -> int:
        return self.start_sample + len(self.samples)

    @property
    def start(self) -> float:
        """Media time of the first sample, in seconds."""
        return self.start_sample / SAMPLE_RATE

    @property
    def end(self) -> float:
        """Media time just after the last sample, in seconds."""
        return self.end_sample / SAMPLE_RATE

    @property
    def duration(self) -> float:
        return len(self.samples) / SAMPLE_RATE


@dataclass(frozen=True)
class VideoFrame:
    """`image` RGB uint8 [height, width, 3] shown at media time `time` seconds."""

    image: np.ndarray
    time: float

    def __post_init__(self) -> None:
        if self.image.dtype != np.uint8 or self.image.ndim != 3 or self.image.shape[2] != 3:
            raise ValueError(f"frame must be uint8 [H, W, 3], got {self.image.dtype} {self.image.shape}")
        if self.time < 0:
            raise ValueError(f"frame time must be >= 0, got {self.time}")

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    @property
    def width(self) -> int:
        return int(self.image.shape[1])
