"""The attention-sink KV cache (StreamingLLM) with a source and a target position group; ours, because
transformers 5 removed SinkCache.

Layout: K, V and the rotated keys are preallocated once per session as [layers, 1, kv_heads, capacity,
head_dim] with capacity = sink + window + reserve + target, and never reallocated, so memory is constant
(`nbytes()`: three K-sized buffers, plus two int64 position vectors).

    slots [0, sink)                 sinks: the first source tokens, kept forever (the system-prompt framing)
    slots [sink, sink + window)     the recent source window, contiguous and in order
    during an answer (F = source length at the question):
    slots [F, F + target)           the target group: prompt tail, committed answer, then tentative tree nodes
    slots [F + target, ... )        source tokens that arrive while an answer runs (at most `reserve`); no
                                    eviction meanwhile, so the answer's view stays intact

The target group sits right after the source it answers from, so a decode step attends over one contiguous
prefix of live slots, [0, F + answer so far): its attention costs what the live context costs, never the
empty reserve (on CPU, SDPA's time grows with the slots it is given, masked or not). The price
is paid by the rarer case: source tokens prefilled during an answer sit after the target group's whole
capacity and attend over it (masked), and `end_target` always moves them back.

Keys are stored BEFORE RoPE (`k`); `pos` holds each slot's position and attention uses keys rotated by it.
The rotated keys are kept too (`kr`, one more K-sized buffer: +50 % KV memory), with the position each slot
was rotated at (`rot_pos`): a forward rotates only its new keys and those whose `pos` no longer equals
`rot_pos`, so a decode step rotates one key per layer instead of the whole cache. Moves that keep positions
(commit's compaction, `end_target`) carry `kr`/`rot_pos` along; eviction changes the moved keys' positions,
so it marks their rotations out of date (`rot_pos` = -1) and the next forward re-rotates the window once.
Source positions equal slot indices (sinks 0..s-1, then the window in order), so they stay below
sink + window however long the stream. Target positions continue from F (group position encoding): target
and source tokens prefilled during the answer share positions but never see each other (the masks below).

Eviction shifts rather than rings: when an append would overflow sink + window, the window is moved left by
the overflow (one copy of K and V per layer, and one re-rotation of the window's keys in the next forward).
Measured on CPU with Qwen2.5-0.5B's shapes (window 2048, float32): the shift costs 13-21 ms against 0.6 s
for the 1-16-token forward that triggers it and 4.4 s for a 256-token chunk (0.3-3.4 %). In return
every group is contiguous with slot == position: masks are ranges, truncation (update mode) is a length change,
tree compaction is a copy into the next slots, and attention runs over one contiguous prefix of the buffers.
A ring saves the copy but needs wrapping per-slot positions and still a copy whenever a revision must land
in order.

Source revisions during an answer (update mode below F) cannot overwrite slots the answer sees: those slots
become "stale" (visible to the answer, hidden from the source) and the revised tokens are written after the
target group with positions continuing from the revision point; `end_target()` compacts them back and evicts overflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Attend:
    """Where one forward writes and what it attends to: new K/V go to slots [slot, slot + n); queries sit at
    `q_pos` and attend over slots [0, len(k_pos)) at positions `k_pos` under `mask` [n, len(k_pos)]."""

    slot: int
    q_pos: Tensor
    k_pos: Tensor
    mask: Tensor


class SinkKVCache:
    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, sink: int, window: int, reserve: int,
                 target: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if sink < 0 or window <= 0 or reserve <= 0 or target <= 0:
            raise ValueError("sink >= 0, window > 0, reserve > 0 and target > 0 are required")
        self.sink, self.window, self.reserve, self.target_capacity = sink, window, reserve, target
        self.capacity = sink + window + reserve + target
        shape = (layers, 1, kv_heads, self.capacity, head_dim)
        with torch.inference_mode():  # every mutation below runs in inference mode too
            # zeros, not empty: masked slots still enter the attention product, and garbage could be NaN
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
            self.kr = torch.zeros(shape, device=device, dtype=dtype)  # keys rotated at rot_pos (zeros: at 0)
            self.pos = torch.zeros(self.capacity, dtype=torch.long, device=device)
            self.rot_pos = torch.zeros(self.capacity, dtype=torch.long, device=device)
            self._slots = torch.arange(self.capacity, device=device)
        self.a = 0  # source segment A: slots [0, a), position = slot
        self.b = 0  # source segment B (answers only): slots [F + target, F + target + b), positions a, a + 1, ...
        self.frozen: int | None = None  # F: source length when the current answer began; None = no answer
        self.t0 = 0  # first target slot
        self.tc = 0  # committed target tokens
        self.parents: list[int] = []  # the tentative tree after them
        self.evicted = 0  # source tokens evicted so far

    # -- bookkeeping --------------------------------------------------------------------------------------

    @property
    def source_len(self) -> int:
        """Live source tokens (sinks + window + those added during the current answer)."""
        return self.a + self.b

    @property
    def b0(self) -> int:
        """First slot of source segment B (answers only): right after the target group's capacity."""
        assert self.frozen is not None
        return self.frozen + self.target_capacity

    @property
    def answering(self) -> bool:
        return self.frozen is not None

    @property
    def buffers(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What `Transformer.forward(cache=...)` reads and writes: K, V, rotated K and `rot_pos`."""
        return self.k, self.v, self.kr, self.rot_pos

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.kr.nbytes + self.pos.nbytes + self.rot_pos.nbytes

    def source_room(self) -> int:
        """How many source tokens one append may take now: a window outside answers (older ones are evicted),
        the free reserve during an answer (0 = wait for `end_target`)."""
        if self.frozen is None:
            return self.window
        return self.reserve - self.b

    @torch.inference_mode()
    def _move(self, src: int, dst: int, n: int, *, keep_pos: bool) -> None:
        """Copy slots [src, src+n) to [dst, dst+n), overlapping allowed; per layer to bound the temporary.
        With `keep_pos` the keys keep their positions and their rotated keys move along; otherwise the
        destination's rotations are marked out of date (`rot_pos` = -1: the next forward re-rotates them)."""
        if n <= 0 or src == dst:
            return
        for buf in (self.k, self.v, self.kr) if keep_pos else (self.k, self.v):
            for layer in buf:
                layer[:, :, dst : dst + n] = layer[:, :, src : src + n].clone()
        if keep_pos:
            self.rot_pos[dst : dst + n] = self.rot_pos[src : src + n].clone()
        else:
            self.rot_pos[dst : dst + n] = -1

    def _evict(self, count: int) -> None:
        """Drop the `count` oldest non-sink source tokens by shifting the window left (positions = slots)."""
        self._move(self.sink + count, self.sink, self.a - self.sink - count, keep_pos=False)
        self.a -= count
        self.evicted += count

    def restart_source(self, keep: int) -> None:
        """Keep only the first `keep` (at most the sinks), as if nothing had been evicted: the source is
        prefilled again from there."""
        if self.frozen is not None:
            raise RuntimeError("the source is not restarted during an answer")
        self.a, self.evicted = min(self.a, self.sink, keep), 0

    def resplit(self, sink: int) -> None:
        """Move the boundary between the sinks and the window of an empty source, the capacity unchanged (a longer
        pinned head: a tool-taking template's tools)."""
        if self.frozen is not None or self.a:
            raise RuntimeError("the sinks are resized only with an empty source and no answer")
        window = self.sink + self.window - sink
        if sink < 0 or window <= 0:
            raise ValueError(f"cannot make {sink} of {self.sink + self.window} source slots sinks")
        self.sink, self.window, self.evicted = sink, window, 0

    def skip_source(self, count: int) -> None:
        """Record `count` new source tokens as evicted without running them, emptying the window: everything in
        it and they would be evicted before the tokens after them land (`EngineSession.prefill_step`)."""
        if self.frozen is not None:
            raise RuntimeError("no source tokens are skipped during an answer")
        self._evict(self.a - self.sink)
        self.evicted += count

    # -- source group -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def append_source(self, n: int) -> Attend:
        """Room for `n` new source tokens (evicting first if needed) and their attention: each sees the live
        source up to itself, never the target."""
        if n <= 0 or n > self.source_room():
            raise ValueError(f"cannot append {n} source tokens (room {self.source_room()})")
        if self.frozen is None:
            overflow = self.a + n - (self.sink + self.window)
            if overflow > 0:
                self._evict(overflow)
            slot, p0 = self.a, self.a
            self.a += n
        else:
            slot, p0 = self.b0 + self.b, self.a + self.b
            self.b += n
        q_pos = torch.arange(p0, p0 + n, device=self.pos.device)
        self.pos[slot : slot + n] = q_pos
        hi = slot + n
        j = self._slots[:hi]
        live = j < self.a
        if self.frozen is not None:
            live |= (j >= self.b0) & (j < self.b0 + self.b)
        k_pos = self.pos[:hi]
        mask = live[None, :] & (k_pos[None, :] <= q_pos[:, None])
        return Attend(slot, q_pos, k_pos, mask)

    @torch.inference_mode()
    def truncate_source(self, keep: int) -> None:
        """Keep the first `keep` live source tokens (update mode). During an answer, tokens the answer sees are
        only hidden from the source (stale), never overwritten."""
        if not 0 <= keep <= self.source_len:
            raise ValueError(f"cannot keep {keep} of {self.source_len} source tokens")
        if keep >= self.a:
            self.b = keep - self.a
        elif self.frozen is None:
            self.a = keep
        else:
            self.a, self.b = keep, 0

    # -- target group -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def begin_target(self) -> None:
        """Freeze the source as the answer sees it and open the target group right after it."""
        if self.frozen is not None:
            raise RuntimeError("a target group is already open")
        self.frozen, self.b = self.a, 0
        self.t0 = self.frozen
        self.tc, self.parents = 0, []

    def _target_attend(self, n: int, depth: Sequence[int], ancestors: Tensor) -> Attend:
        assert self.frozen is not None
        if self.tc + n > self.target_capacity:
            raise RuntimeError(f"target group full: {self.tc} committed + {n} new > {self.target_capacity} slots")
        slot = self.t0 + self.tc
        dev = self.pos.device
        q_pos = self.frozen + self.tc + torch.as_tensor(depth, dtype=torch.long, device=dev)
        self.pos[slot : slot + n] = q_pos
        hi = slot + n
        j = self._slots[:hi]
        seen = j < slot  # the answer's source [0, F) and the committed target [F, slot): one prefix
        mask = seen[None, :].repeat(n, 1)
        mask[:, slot:hi] = ancestors
        return Attend(slot, q_pos, self.pos[:hi], mask)

    @torch.inference_mode()
    def append_target(self, n: int) -> Attend:
        """`n` committed target tokens in a row (the prompt tail); drops any tentative tree."""
        self.parents = []
        attend = self._target_attend(n, range(n), torch.ones(n, n, dtype=torch.bool).tril().to(self.k.device))
        self.tc += n
        return attend

    @torch.inference_mode()
    def score_tree(self, parents: Sequence[int]) -> Attend:
        """Tentative nodes after the committed target: node i sees the answer's source, the committed target
        and its ancestors (itself included); its position is the next position plus its depth (roots: 0).
        Replaces any earlier tree."""
        n = len(parents)
        if n == 0:
            raise ValueError("an empty tree")
        depth: list[int] = []
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}] = {p}: a parent must come before its child (or be -1)")
            depth.append(0 if p < 0 else depth[p] + 1)
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        self.parents = list(parents)
        return self._target_attend(n, depth, anc.to(self.k.device))

    @torch.inference_mode()
    def commit(self, nodes: Sequence[int]) -> None:
        """Keep one root-to-node path of the last tree, compacted into the slots right after the committed
        target; every other node is dropped (its slots are simply reused)."""
        nodes = list(nodes)
        for i, node in enumerate(nodes):
            want = -1 if i == 0 else nodes[i - 1]
            if not 0 <= node < len(self.parents) or self.parents[node] != want:
                raise ValueError(f"nodes {nodes} are not a root-to-node path of the scored tree")
        base = self.t0 + self.tc
        moved = [(base + node, base + i) for i, node in enumerate(nodes) if node != i]
        if moved:  # node i of the path sits at depth i, so a moved key keeps its position (and rotation)
            src = torch.tensor([s for s, _ in moved], device=self.k.device)
            dst = torch.tensor([d for _, d in moved], device=self.k.device)
            for buf in (self.k, self.v, self.kr):
                buf[:, :, :, dst] = buf[:, :, :, src]  # the gather copies first: overlap is safe
            for vec in (self.pos, self.rot_pos):
                vec[dst] = vec[src]
        self.tc += len(nodes)
        self.parents = []

    @torch.inference_mode()
    def end_target(self) -> None:
        """Drop the target group; move the source tokens added during the answer back in order after segment A
        (over any stale tail) and evict the oldest ones if the window overflowed meanwhile."""
        if self.frozen is None:
            return
        self._move(self.b0, self.a, self.b, keep_pos=True)  # their positions already continue from a
        self.pos[self.a : self.a + self.b] = self._slots[self.a : self.a + self.b]
        self.a, self.b = self.a + self.b, 0
        self.frozen, self.tc, self.parents = None, 0, []
        overflow = self.a - (self.sink + self.window)
        if overflow > 0:
            self._evict(overflow)
