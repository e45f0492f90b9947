"""The video memory's sizes (Flash-VStream's published parameters by default), apart from the memory itself: a
profile is checked against them when it loads, before torch is imported (`config.memory_sizes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MemorySizes:
    """Flash-VStream's published sizes by default (681 tokens); every part is fixed-size or capped."""

    spatial_frames: int = 1  # latest frames at full grid, FIFO
    grid: int = 8  # input resolution: grid x grid tokens per frame
    temporal_slots: int = 25  # older frames consolidated into this many slots...
    temporal_grid: int = 4  # ...each temporal_grid x temporal_grid tokens, avg-pooled from grid
    abstract_tokens: int = 25
    abstract_ratio: float = 0.2  # semantic-attention update rate
    retrieved_frames: int = 3  # full-grid frames from the buffer (default) or segment keyframes (query)
    buffer_frames: int = 300  # recent full-grid frames kept as retrieval candidates, FIFO
    segment_s: float = 10.0  # a segment spans about this much media time
    max_segments: int = 64  # beyond it the most similar adjacent closed pair merges
    kmeans_iters: int = 10
    seed: int = 0

    def budget(self) -> int:
        """Tokens of a full memory; Flash-VStream's defaults give 64 + 400 + 25 + 192 = 681."""
        full = self.grid * self.grid
        return (
            self.spatial_frames * full
            + self.temporal_slots * self.temporal_grid**2
            + self.abstract_tokens
            + self.retrieved_frames * full
        )

    def validate(self) -> None:
        """Fail at construction, in one line, rather than deep inside a write an hour into a stream."""
        for name in ("spatial_frames", "grid", "temporal_slots", "temporal_grid", "abstract_tokens", "buffer_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"MemorySizes.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("retrieved_frames", "kmeans_iters"):
            if getattr(self, name) < 0:
                raise ValueError(f"MemorySizes.{name} must be >= 0, got {getattr(self, name)}")
        if self.grid % self.temporal_grid:
            raise ValueError(
                f"MemorySizes.grid ({self.grid}) must be a multiple of temporal_grid ({self.temporal_grid})"
            )
        if not 0.0 < self.abstract_ratio <= 1.0:
            raise ValueError(f"MemorySizes.abstract_ratio must be in (0, 1], got {self.abstract_ratio}")
        if not (math.isfinite(self.segment_s) and self.segment_s > 0):
            raise ValueError(f"MemorySizes.segment_s must be a positive number of seconds, got {self.segment_s}")
        if self.max_segments < 2:
            raise ValueError(f"MemorySizes.max_segments must be >= 2 (merging needs a pair), got {self.max_segments}")
        if self.buffer_frames < self.spatial_frames + self.retrieved_frames:
            raise ValueError(
                f"MemorySizes.buffer_frames ({self.buffer_frames}) must hold spatial_frames + retrieved_frames "
                f"({self.spatial_frames + self.retrieved_frames}) or the budget can never fill"
            )
