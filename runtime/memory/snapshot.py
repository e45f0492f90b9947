"""The read side of the video memory: its blocks and segments (its sizes: `sizes.py`), and the immutable snapshot
a question reads (blocks in prompt order, question-aware selection). `video.py` is the one writer that
publishes these; nothing here changes after it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.memory.sizes import MemorySizes


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
