"""The read side of the video memory: its sizes, its blocks and segments, and the immutable snapshot a
question reads (blocks in prompt order, question-aware selection). `video.py` is the one writer that
publishes these; nothing here changes after it is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


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


@dataclass(frozen=True, eq=False)
class Segment:
    """A contiguous span of the stream: the unit a question selects and the answerer writes notes about."""

    id: int
    start: float
    end: float
    frames: int
    mean: Tensor = field(repr=False)
    keyframe: Tensor = field(repr=False)
    keyframe_time: float
    closed: bool
    note: str = ""
    note_embedding: Tensor | None = field(default=None, repr=False)


@dataclass(frozen=True, eq=False)
class MemoryBlock:
    """Prompt-ready embeddings; `key` names the content, so equal keys mean reusable KV."""

    kind: str
    key: int
    start: float
    end: float
    embeds: Tensor = field(repr=False)


@dataclass(frozen=True, eq=False)
class MemorySnapshot:
    """Everything a question needs, consistent with one moment of the stream; never changes once published."""

    sizes: MemorySizes
    dim: int
    version: int = 0  # writes and notes applied
    frames_seen: int = 0
    frames_consolidated: int = 0  # frames folded into temporal slots (== sum(temporal_weights))
    buffered: int = 0  # frames in the retrieval buffer
    last_time: float | None = None  # media time of the latest frame
    segments: tuple[Segment, ...] = ()
    temporal_weights: tuple[int, ...] = ()  # aligned with the temporal blocks
    _temporal: tuple[MemoryBlock, ...] = ()
    _abstract: tuple[MemoryBlock, ...] = ()
    _retrieved: tuple[MemoryBlock, ...] = ()
    _spatial: tuple[MemoryBlock, ...] = ()
    _keyframe_keys: dict[int, int] = field(default_factory=dict)

    def blocks(self, query: Tensor | None = None) -> list[MemoryBlock]:
        """Prompt order, most stable first, so a KV prefix cache keeps as much as possible across snapshots."""
        retrieved = self._retrieved if query is None else self._query_retrieved(query)
        return [*self._temporal, *self._abstract, *retrieved, *self._spatial]

    @property
    def tokens(self) -> int:
        return sum(b.embeds.shape[0] for b in self.blocks())

    def scores(self, query: Tensor) -> list[float]:
        """A note embedding can vouch for a segment whose pixels alone look unrelated: take the better cosine."""
        if query.shape != (self.dim,):
            raise ValueError(f"query must be [{self.dim}], got {tuple(query.shape)}")
        if not self.segments:
            return []
        means = torch.stack([s.mean for s in self.segments]).float()
        q = query.to(device=means.device, dtype=torch.float32)[None, :]
        # A segment without a note scores its mean twice, so one batched max covers both cases.
        notes = torch.stack([s.mean if s.note_embedding is None else s.note_embedding for s in self.segments])
        score = torch.maximum(F.cosine_similarity(means, q, dim=-1), F.cosine_similarity(notes.float(), q, dim=-1))
        return score.tolist()

    def _ranked(self, query: Tensor) -> list[int]:
        score = self.scores(query)
        return sorted(range(len(score)), key=lambda i: (-score[i], i))

    def select(self, query: Tensor, k: int | None = None) -> list[Segment]:
        """Top-k segments for a question, in time order, so the prompt reads as the video ran."""
        k = self.sizes.retrieved_frames if k is None else k
        return [self.segments[i] for i in sorted(self._ranked(query)[:k])]

    def _query_retrieved(self, query: Tensor) -> list[MemoryBlock]:
        # A keyframe already shown as a spatial frame would spend budget on a duplicate: skip to the next best.
        shown = {b.key for b in self._spatial}
        blocks: list[MemoryBlock] = []
        for i in self._ranked(query):
            if len(blocks) >= self.sizes.retrieved_frames:
                break
            seg = self.segments[i]
            key = self._keyframe_keys[seg.id]
            if key not in shown:
                blocks.append(MemoryBlock("retrieved", key, seg.keyframe_time, seg.keyframe_time, seg.keyframe))
        return sorted(blocks, key=lambda b: (b.start, b.key))
