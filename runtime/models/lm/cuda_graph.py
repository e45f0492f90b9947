"""The one-token decode step in fixed form, recorded once per session as a CUDA graph and replayed.

Boundary: this module is the engine's CUDA-only part. Nothing imports it at module level; the engine imports
it lazily (`EngineSession._decode_graph`) only when `lm.cuda_graphs` is on and the session's cache lives on a
CUDA device, so CPU runs never touch `torch.cuda`. Everything here may assume CUDA except the eager fixed-form
step (`graph=False`), which runs on any device and is what the CPU tests compare with `EngineSession.score`.

Why: on a GPU, decoding one token of a 0.5B-7B model is bound by kernel launches, not arithmetic: every layer
launches a dozen small kernels from Python. A CUDA graph records the step's kernels once and replays them
with one launch. A graph needs every shape, address and branch fixed, which `Transformer.forward` is not: it
attends over slots [0, hi) with hi growing each step, writes K/V through a Python slice and asks the host
which keys need re-rotating. `Transformer.forward_fixed` is the same step in fixed form:

- the token, its position and its slot are device tensors, written in place before each replay;
- attention spans all `capacity` slots of the session's preallocated cache (`kv_cache.SinkKVCache`, never
  reallocated, so its addresses are fixed), the mask hiding the slots past the live ones;
- new K, V and rotated K go in with `index_copy_` at the slot tensor;
- RoPE cos/sin are rows of a table over positions [0, capacity), built once (target positions stay below
  sink + window + target, source ones below sink + window + reserve).

Re-rotating keys that moved (eviction) stays outside the graph: `run` first calls `Transformer.rerotate`,
which does nothing during an answer, since nothing moves then.

The engine uses it for one-token scores on CUDA when `lm.cuda_graphs` is on (the default); `graph=False`
runs the same fixed-form step eagerly, on any device, which is how the CPU tests hold it to `score()`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.models.lm.kv_cache import Attend, SinkKVCache
from runtime.models.lm.transformer import Transformer

WARMUP_RUNS = 2  # eager runs on a side stream before capture, as torch.cuda.graph's docs ask


class DecodeGraph:
    """One session's fixed-form decode step: static input buffers, and the recorded graph once captured."""

    def __init__(self, model: Transformer, cache: SinkKVCache, *, graph: bool) -> None:
        if graph and cache.k.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, not {cache.k.device}")
        self.model, self.cache, self.graph = model, cache, graph
        device = cache.k.device
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.q_pos = torch.zeros(1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, cache.capacity, dtype=torch.bool, device=device)
        self.cos, self.sin = model.rope(torch.arange(cache.capacity, device=device))
        self._recorded: torch.cuda.CUDAGraph | None = None
        self._logits: Tensor | None = None
        self.replays = 0

    def _step(self) -> Tensor:
        rope_q = self.cos.index_select(0, self.q_pos)[:, None], self.sin.index_select(0, self.q_pos)[:, None]
        return self.model.forward_fixed(self.token, rope_q, self.mask, self.cache.buffers, self.slot)

    @torch.inference_mode()
    def run(self, token: int, attend: Attend) -> Tensor:
        """Logits [1, vocab] of `token` placed as `attend` says (one slot, from `SinkKVCache.score_tree`)."""
        if attend.q_pos.shape[0] != 1:
            raise ValueError(f"the fixed step takes one token, not {attend.q_pos.shape[0]}")
        self.model.rerotate(self.cache.buffers, attend.q_pos, attend.k_pos, attend.slot)
        live = attend.mask.shape[-1]
        self.token.fill_(token)
        self.q_pos.copy_(attend.q_pos)
        self.slot.fill_(attend.slot)
        self.mask[:, :live] = attend.mask
        self.mask[:, live:] = False
        if not self.graph:
            return self._step()
        if self._recorded is None:
            self._capture()
        else:
            assert self._recorded is not None
            self._recorded.replay()
        self.replays += 1
        assert self._logits is not None
        return self._logits.clone()  # the next replay overwrites the static output

    def _capture(self) -> None:
        """Warm up on a side stream, then record `_step` (the warm-up already computed this step's values)."""
        side = torch.cuda.Stream(device=self.cache.k.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._logits = self._step()
        torch.cuda.current_stream().wait_stream(side)
        recorded = torch.cuda.CUDAGraph()
        with torch.cuda.graph(recorded):
            self._logits = self._step()
        self._recorded = recorded
        recorded.replay()  # capture records without running: run it once for this step's output
