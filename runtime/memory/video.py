"""Video memory of constant size for answering questions while frames keep arriving.

Flash-VStream's STAR layout (spatial, temporal, abstract, retrieved) keeps the prompt at a fixed token budget
however long the stream runs; Think-While-Watching segments give the answerer units to write notes about; and
VideoStreaming-style selection lets a question pull the full-resolution keyframes of the segments it is about.

One writer thread feeds frames; any number of readers ask questions. A write builds new tensors and publishes
a new immutable `MemorySnapshot` by replacing one reference, so a reader never waits for the writer and never
sees half a write. Block keys name content (a frame keeps its key whichever kind shows it), so a consumer can
reuse KV computed for a block as long as its key stays in place.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.memory.snapshot import MemoryBlock, MemorySizes, MemorySnapshot, Segment
from runtime.memory.star import abstract_init, abstract_update, pool_grid, sq_distances, weighted_kmeans

NOTE_CHARS = 300  # merged notes are cut here so notes stay bounded like everything else


class _Slot(NamedTuple):
    block: MemoryBlock
    weight: int  # frames it stands for (0 for a cluster k-means left empty)
    flat: Tensor  # the centroid, [temporal_grid^2 * dim]


class _Ring:
    """The retrieval buffer: recent full frames, overwritten in place, so nothing published may view into it."""

    def __init__(self, size: int, tokens: int, dim: int, pooled: int, device: torch.device, dtype: torch.dtype):
        self.frames = torch.zeros(size, tokens, dim, device=device, dtype=dtype)
        self.pooled = torch.zeros(size, pooled, device=device, dtype=dtype)
        self.means = torch.zeros(size, dim, device=device)  # token means, float32, for keyframe choice
        self.index = torch.full((size,), -1, dtype=torch.long)  # stream frame index; -1 = empty
        self.times, self.keys, self.pos = [0.0] * size, [-1] * size, 0

    def push(self, frame: Tensor, pooled: Tensor, mean: Tensor, time: float, index: int, key: int) -> int:
        p, self.pos = self.pos, (self.pos + 1) % len(self.keys)
        self.frames[p].copy_(frame)
        self.pooled[p].copy_(pooled)
        self.means[p].copy_(mean)
        self.index[p], self.times[p], self.keys[p] = index, time, key
        return p

    def positions(self, first: int = 0) -> list[int]:
        return (self.index >= first).nonzero().flatten().tolist()


class VideoMemory:
    """Constant-size STAR memory with segments; one writer thread, any number of snapshot readers."""

    def __init__(
        self, sizes: MemorySizes, dim: int, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        sizes.validate()
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self._sizes, self._dim, self._device, self._dtype = sizes, dim, torch.device(device), dtype
        self._lock = threading.Lock()  # serialises write() against set_note(); readers never take it
        self._next_key = 0  # one counter for every kind of block, so no key is ever reused
        self._ids = itertools.count()
        self._writes = self._version = self._frames = self._consolidated = 0
        self._last: float | None = None
        self._spatial: deque[MemoryBlock] = deque()
        self._slots: list[_Slot] = []
        self._abstract: Tensor | None = None  # float32 master copy
        self._abstract_start = 0.0
        self._abstract_block: tuple[MemoryBlock, ...] = ()
        self._ring = _Ring(sizes.buffer_frames, sizes.grid**2, dim, sizes.temporal_grid**2 * dim, self._device, dtype)
        self._closed: list[Segment] = []
        self._open: Segment | None = None  # its mean and keyframe are brought up to date by _refresh_open
        self._open_first, self._open_sum, self._kf_mean = 0, torch.zeros(0), torch.zeros(0)
        self._kf_keys: dict[int, int] = {}  # segment id -> key of its keyframe's frame
        self._retrieved: tuple[MemoryBlock, ...] = ()
        self._snap = MemorySnapshot(sizes, dim)

    @property
    def sizes(self) -> MemorySizes:
        return self._sizes

    @property
    def dim(self) -> int:
        return self._dim

    def snapshot(self) -> MemorySnapshot:
        return self._snap

    def write(self, features: Tensor, times: Sequence[float]) -> list[Segment]:
        """Add frames; return the segments this write closed, as they were when closed (a merge in the same
        write may already have replaced one, and then `set_note` on it returns False)."""
        s, tokens = self._sizes, self._sizes.grid**2
        if features.ndim != 3 or tuple(features.shape[1:]) != (tokens, self._dim):
            raise ValueError(f"features must be [n, {tokens}, {self._dim}], got {tuple(features.shape)}")
        if not features.is_floating_point():
            raise ValueError(f"features must be floating point, got {features.dtype}")
        ts = [float(t) for t in times]
        if len(ts) != features.shape[0]:
            raise ValueError(f"{features.shape[0]} frames but {len(ts)} times")
        if any(not math.isfinite(t) for t in ts) or any(b < a for a, b in itertools.pairwise(ts)):
            raise ValueError("times must be finite and non-decreasing")
        with self._lock:
            if ts and self._last is not None and ts[0] < self._last:
                raise ValueError(f"times went backwards: {ts[0]} after {self._last}")
            if not ts:
                return []
            x = features.detach().to(device=self._device, dtype=self._dtype)
            xf = x.float()
            pooled, means = pool_grid(xf, s.grid, s.temporal_grid).flatten(1), xf.mean(1)
            closed: list[Segment] = []
            evicted: list[MemoryBlock] = []
            first = self._next_key
            for i, t in enumerate(ts):
                key, self._frames = self._key(), self._frames + 1
                if self._open is not None and t >= self._open.start + s.segment_s:
                    closed.append(self._close())
                p = self._ring.push(x[i], pooled[i], means[i], t, self._frames - 1, key)
                if self._open is None:
                    self._open = Segment(next(self._ids), t, t, 0, means[i], self._ring.frames[p].clone(), t, False)
                    self._open_first, self._kf_mean = self._frames - 1, means[i]
                    self._open_sum = torch.zeros_like(means[i])
                    self._kf_keys[self._open.id] = key
                self._open_sum = self._open_sum + means[i]
                self._open = replace(self._open, end=t, frames=self._open.frames + 1)
                self._spatial.append(MemoryBlock("spatial", key, t, t, x[i]))
                if len(self._spatial) > s.spatial_frames:
                    evicted.append(self._spatial.popleft())
            # Own what stays: a view would pin this whole batch, and the caller may reuse its tensor.
            self._spatial = deque(replace(b, embeds=b.embeds.clone()) if b.key >= first else b for b in self._spatial)
            self._writes, self._last = self._writes + 1, ts[-1]
            self._refresh_open()
            self._update_abstract(xf, ts)
            if evicted:
                self._consolidate(evicted)
            self._merge_segments()
            self._retrieved = self._default_retrieval()
            self._publish()
            return closed

    def set_note(self, segment_id: int, text: str, embedding: Tensor | None = None) -> bool:
        """Attach the answerer's note (and its embedding, which selection scores too) to a segment."""
        if embedding is not None:
            if embedding.shape != (self._dim,):
                raise ValueError(f"note embedding must be [{self._dim}], got {tuple(embedding.shape)}")
            embedding = embedding.detach().to(device=self._device, dtype=self._dtype).clone()
        with self._lock:
            segments = self._closed + ([self._open] if self._open is not None else [])
            at = next((i for i, seg in enumerate(segments) if seg.id == segment_id), None)
            if at is None:
                return False
            seg = replace(segments[at], note=text, note_embedding=embedding)
            if seg.closed:
                self._closed[at] = seg
            else:
                self._open = seg
            self._publish()
            return True

    # -- writer internals ---------------------------------------------------------------------------------

    def _key(self) -> int:
        self._next_key += 1
        return self._next_key - 1

    def _refresh_open(self) -> None:
        """Bring the open segment's mean up to date, and its keyframe to the frame nearest that mean.

        Candidates are its frames still buffered plus the current keyframe (which wins ties, keeping its key),
        so a segment longer than the buffer still keeps the best frame it has seen.
        """
        o = self._open
        assert o is not None
        mean = self._open_sum / o.frames
        pos = self._ring.positions(self._open_first)
        j = int(((torch.cat([self._kf_mean[None], self._ring.means[pos]]) - mean) ** 2).sum(1).argmin())
        kf, kf_time = o.keyframe, o.keyframe_time
        if j > 0 and self._ring.keys[pos[j - 1]] != self._kf_keys[o.id]:
            p = pos[j - 1]
            kf, kf_time, self._kf_mean = self._ring.frames[p].clone(), self._ring.times[p], self._ring.means[p].clone()
            self._kf_keys[o.id] = self._ring.keys[p]
        self._open = replace(o, mean=mean.to(self._dtype), keyframe=kf, keyframe_time=kf_time)

    def _close(self) -> Segment:
        self._refresh_open()
        assert self._open is not None
        seg, self._open = replace(self._open, closed=True), None
        self._closed.append(seg)
        return seg

    def _update_abstract(self, xf: Tensor, ts: list[float]) -> None:
        s = self._sizes
        if self._abstract is None:
            self._abstract = abstract_init(xf[0], s.abstract_tokens)
            self._abstract_start, xf = ts[0], xf[1:]
        self._abstract = abstract_update(self._abstract, xf, s.abstract_ratio)
        block = MemoryBlock("abstract", self._key(), self._abstract_start, ts[-1], self._abstract.to(self._dtype))
        self._abstract_block = (block,)

    def _slot(self, flat: Tensor, start: float, end: float, weight: int, spare: list[_Slot] | None = None) -> _Slot:
        """A temporal slot; one whose centroid equals a spare old slot's exactly takes over its tensor and key
        (a static scene re-clusters to the same centroids, and its cached KV should survive that)."""
        flat = flat.to(self._dtype)
        same = next((sl for sl in spare or () if torch.equal(sl.flat, flat)), None)
        if same is not None and spare is not None:
            spare.remove(same)
            return _Slot(replace(same.block, start=start, end=end), weight, same.flat)
        flat = flat.clone()
        embeds = flat.view(self._sizes.temporal_grid**2, self._dim)
        return _Slot(MemoryBlock("temporal", self._key(), start, end, embeds), weight, flat)

    def _consolidate(self, evicted: list[MemoryBlock]) -> None:
        """Fold frames leaving the spatial FIFO into the temporal slots (weighted k-means once they are full)."""
        s = self._sizes
        self._consolidated += len(evicted)
        points = pool_grid(torch.stack([b.embeds for b in evicted]).float(), s.grid, s.temporal_grid).flatten(1)
        if len(self._slots) + len(evicted) <= s.temporal_slots:
            self._slots += [self._slot(p, b.start, b.end, 1) for p, b in zip(points, evicted, strict=True)]
            return
        old = self._slots
        if old:
            points = torch.cat([torch.stack([sl.flat for sl in old]).float(), points])
        weights = [sl.weight for sl in old] + [1] * len(evicted)
        spans = [(sl.block.start, sl.block.end) for sl in old] + [(b.start, b.end) for b in evicted]
        gen = torch.Generator().manual_seed((s.seed * 1_000_003 + self._writes) % 2**63)
        result = weighted_kmeans(points, torch.tensor(weights), s.temporal_slots, iters=s.kmeans_iters, generator=gen)
        members: list[list[int]] = [[] for _ in range(s.temporal_slots)]
        for i, c in enumerate(result.assign.tolist()):
            members[c].append(i)
        kept = {mem[0] for mem in members if len(mem) == 1 and mem[0] < len(old)}
        spare = [sl for j, sl in enumerate(old) if j not in kept]  # their keys pass to an identical new centroid
        slots: list[_Slot] = []
        for c, mem in enumerate(members):
            if len(mem) == 1 and mem[0] in kept:
                slots.append(old[mem[0]])  # untouched: same tensor, same key, so cached KV stays valid
            elif not mem:  # left empty: sits on its seed point, standing for no frames
                slots.append(self._slot(result.centroids[c], *spans[int(result.init[c])], 0, spare))
            else:
                start, end = min(spans[i][0] for i in mem), max(spans[i][1] for i in mem)
                slots.append(self._slot(result.centroids[c], start, end, sum(weights[i] for i in mem), spare))
        self._slots = slots

    def _merge_segments(self) -> None:
        """Bound the segments by merging the most alike neighbours: theirs is the least informative boundary."""
        while len(self._closed) + (self._open is not None) > self._sizes.max_segments and len(self._closed) >= 2:
            means = torch.stack([seg.mean for seg in self._closed]).float()
            i = int(F.cosine_similarity(means[:-1], means[1:], dim=-1).argmax())
            a, b = self._closed[i], self._closed[i + 1]
            big, n = (a if a.frames >= b.frames else b), a.frames + b.frames
            mean = ((a.mean.float() * a.frames + b.mean.float() * b.frames) / n).to(self._dtype)
            embs = [(seg.note_embedding.float(), seg.frames) for seg in (a, b) if seg.note_embedding is not None]
            emb = (sum(e * w for e, w in embs) / sum(w for _, w in embs)).to(self._dtype) if embs else None
            note = "; ".join(seg.note for seg in (a, b) if seg.note)[:NOTE_CHARS]
            merged = Segment(next(self._ids), a.start, b.end, n, mean, big.keyframe, big.keyframe_time, True, note, emb)
            self._kf_keys[merged.id] = self._kf_keys.pop(big.id)
            del self._kf_keys[a.id if big is b else b.id]
            self._closed[i : i + 2] = [merged]

    def _default_retrieval(self) -> tuple[MemoryBlock, ...]:
        """Flash-VStream's retrieval: for each largest temporal slot, the nearest buffered frame at full grid.

        Frames in the spatial FIFO are left out (they are in the prompt at full grid already), and each slot
        takes the nearest frame not yet taken, so the budget is never spent twice on one frame.
        """
        s, ring = self._sizes, self._ring
        shown = {b.key for b in self._spatial}
        cands = [p for p in ring.positions() if ring.keys[p] not in shown]
        if not (s.retrieved_frames and self._slots and cands):
            return ()
        order = sorted(range(len(self._slots)), key=lambda i: (-self._slots[i].weight, self._slots[i].block.start, i))
        targets = [order[i % len(order)] for i in range(min(s.retrieved_frames, len(cands)))]
        dist = sq_distances(torch.stack([self._slots[i].flat for i in targets]), ring.pooled[cands])
        previous = {b.key: b for b in self._retrieved}
        blocks: list[MemoryBlock] = []
        taken: list[int] = []
        for row in dist:
            row[taken] = float("inf")
            taken.append(int(row.argmin()))
            p = cands[taken[-1]]
            key, t = ring.keys[p], ring.times[p]
            blocks.append(previous.get(key) or MemoryBlock("retrieved", key, t, t, ring.frames[p].clone()))
        return tuple(sorted(blocks, key=lambda b: (b.start, b.key)))

    def _publish(self) -> None:
        self._version += 1
        segments = (*self._closed, *([self._open] if self._open is not None else []))
        slots = sorted(self._slots, key=lambda sl: (sl.block.start, sl.block.key))
        self._snap = MemorySnapshot(
            self._sizes,
            self._dim,
            version=self._version,
            frames_seen=self._frames,
            frames_consolidated=self._consolidated,
            buffered=min(self._frames, self._sizes.buffer_frames),
            last_time=self._last,
            segments=segments,
            temporal_weights=tuple(sl.weight for sl in slots),
            _temporal=tuple(sl.block for sl in slots),
            _abstract=self._abstract_block,
            _retrieved=self._retrieved,
            _spatial=tuple(self._spatial),
            _keyframe_keys={seg.id: self._kf_keys[seg.id] for seg in segments},
        )
