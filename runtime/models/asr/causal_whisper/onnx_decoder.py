"""The decoder's step as one ONNX Runtime graph (`asr.graph_runtime = "onnxruntime"`; onnx_export.py says why).

`_Step` is Whisper's decoder layers as `decoder._Layers.forward` computes them, with the caches passed in rather
than held. `OnnxDecoder` is `decoder.IncrementalDecoder` over it: the same `Scorer`.

The caches are numpy buffers with spare room (`_Room`), passed whole with the counts that are valid; the graph
masks the rest. Passing the whole buffer means ONNX Runtime reads it where it lies: a slice would be copied on
every feed, and the cross-attention K/V of a long item is megabytes. The self-attention K/V of the fed tokens
come back as outputs and are written into the buffers, so positions are never recomputed.

The float graph (`asr.decoder_weights = "float"`) equals `IncrementalDecoder` to float rounding, and a stream over it
gives torch's updates (tests/test_causal_whisper_onnx.py); what the int8 graph changes is measured by
`runtime bench asr-quality` (the model card).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from transformers import WhisperForConditionalGeneration

from runtime.models.asr.causal_whisper.onnx_export import check_float_cpu, export_graph, graph_session

NEG = -1e30  # a masked score: exp() of it is 0 in float32, and unlike -inf a fully masked row stays finite


def split_heads(x: Tensor, heads: int, d_head: int) -> Tensor:
    """[1, T, d] -> [heads, T, head_dim]. The sizes are Python ints, so the exported graph reshapes by constants
    instead of computing shapes at run time (a dozen small operations less per layer)."""
    return x[0].reshape(-1, heads, d_head).transpose(0, 1)


def merge_heads(a: Tensor, d: int) -> Tensor:
    """[heads, T, head_dim] -> [1, T, d]."""
    return a.transpose(0, 1).reshape(1, -1, d)


def self_attention_qkv(attn: nn.Module, x: Tensor, heads: int, d_head: int) -> tuple[Tensor, Tensor, Tensor]:
    """Whisper's self-attention queries (pre-scaled, as it does), keys and values of x [1, T, d], split by head."""
    return (split_heads(attn.q_proj(x) * attn.scaling, heads, d_head), split_heads(attn.k_proj(x), heads, d_head),
            split_heads(attn.v_proj(x), heads, d_head))


class _Step(nn.Module):
    """One decoder feed: `ids` at positions `start`.., given the self-attention K/V of the `start` positions before
    them and the cross-attention K/V of `frames` encoder frames (each buffer [heads, room, head_dim], valid up to
    its count). Returns the log-probabilities of the last `rows` positions and the fed positions' K/V
    ([layers, heads, n, head_dim] each)."""

    def __init__(self, model: WhisperForConditionalGeneration) -> None:
        super().__init__()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = base.model.decoder
        self.proj_out = base.proj_out
        self.heads = base.config.decoder_attention_heads
        self.d = base.config.d_model

    def forward(self, ids: Tensor, start: Tensor, rows: Tensor, frames: Tensor, *caches: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        # Activations are [1, T, d]: with a batch axis the exporter writes each linear as MatMul + Add (a 2-D input
        # gives Gemm), the form ONNX Runtime's weight quantisers rewrite.
        n_layers = len(self.decoder.layers)
        self_k, self_v = caches[:n_layers], caches[n_layers : 2 * n_layers]
        cross_k, cross_v = caches[2 * n_layers : 3 * n_layers], caches[3 * n_layers :]
        n = ids.shape[0]
        dec = self.decoder
        h = (dec.embed_tokens(ids) + dec.embed_positions.weight[torch.arange(n) + start])[None]
        new = torch.arange(n)
        causal = new[None, :] <= new[:, None]  # [n, n]: a fed position sees itself and those fed before it
        past_ok = torch.arange(self_k[0].shape[1]) < start  # [room]: the valid cached positions
        cross_ok = torch.arange(cross_k[0].shape[1]) < frames
        room = self_k[0].shape[1]  # every layer's buffer has the same
        heads, d = self.heads, self.d
        new_k, new_v = [], []
        for i, layer in enumerate(dec.layers):
            sa = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            q, k, v = self_attention_qkv(sa, x, heads, d // heads)
            new_k.append(k)
            new_v.append(v)
            # scores over the cache and over the fed tokens apart: concatenating K would copy the whole cache
            s_past = torch.where(past_ok, q @ self_k[i].transpose(1, 2), NEG)
            s_new = torch.where(causal, q @ k.transpose(1, 2), NEG)
            p = torch.cat([s_past, s_new], -1).softmax(-1)
            h = h + sa.out_proj(merge_heads(p[..., :room] @ self_v[i] + p[..., room:] @ v, d))
            ca = layer.encoder_attn
            x = layer.encoder_attn_layer_norm(h)
            q = split_heads(ca.q_proj(x) * ca.scaling, heads, d // heads)
            p = torch.where(cross_ok, q @ cross_k[i].transpose(1, 2), NEG).softmax(-1)
            h = h + ca.out_proj(merge_heads(p @ cross_v[i], d))
            x = layer.final_layer_norm(h)
            h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
        last = dec.layer_norm(h[0].index_select(0, torch.arange(rows) + (n - rows)))[None]
        return self.proj_out(last)[0].float().log_softmax(-1), torch.stack(new_k), torch.stack(new_v)


def export_step(model: WhisperForConditionalGeneration, quantize: bool = True,
                progress: Callable[[str], None] | None = None) -> Path:
    """The decoder step of `model` as an ONNX file (onnx_export.export_graph: exported once, then cached)."""
    step = _Step(model)
    n_layers = len(step.decoder.layers)
    heads, d_head = step.heads, step.decoder.config.d_model // step.heads
    caches = [torch.zeros(heads, room, d_head) for room in (4,) * (2 * n_layers) + (6,) * (2 * n_layers)]
    names = cache_names(n_layers)
    args = (torch.tensor([1, 2]), torch.tensor(3), torch.tensor(1), torch.tensor(5), *caches)
    return export_graph(step, "whisper-decoder", args, ["ids", "start", "rows", "frames", *names],
                        ["logp", "new_k", "new_v"], {"ids": {0: "n"}, **{name: {1: f"room_{name}"} for name in names}},
                        quantize=quantize, progress=progress)


class _CrossKV(nn.Module):
    """Every decoder layer's cross-attention K and V of encoder frames [n, d]: [layers, heads, n, head_dim] each."""

    def __init__(self, model: WhisperForConditionalGeneration) -> None:
        super().__init__()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.layers = base.model.decoder.layers
        self.heads = base.config.decoder_attention_heads
        self.d_head = base.config.d_model // self.heads

    def forward(self, frames: Tensor) -> tuple[Tensor, Tensor]:
        x = frames[None]  # [1, n, d]: each projection a MatMul (+ Add), as the quantiser rewrites them
        attns = [layer.encoder_attn for layer in self.layers]
        return (torch.stack([split_heads(a.k_proj(x), self.heads, self.d_head) for a in attns]),
                torch.stack([split_heads(a.v_proj(x), self.heads, self.d_head) for a in attns]))


def export_cross_kv(model: WhisperForConditionalGeneration, quantize: bool = True,
                    progress: Callable[[str], None] | None = None) -> Path:
    """The cross-attention K/V projections of `model` as an ONNX file (exported once, then cached)."""
    module = _CrossKV(model)
    args = (torch.zeros(3, model.config.d_model),)
    return export_graph(module, "whisper-cross-kv", args, ["frames"], ["k", "v"], {"frames": {0: "n"}},
                        quantize=quantize, progress=progress)


def cache_names(n_layers: int) -> list[str]:
    return [f"{kind}_{i}" for kind in ("self_k", "self_v", "cross_k", "cross_v") for i in range(n_layers)]


class OnnxStep:
    """The decoder graph of one model (shared by every stream of it), and a second graph of the cross-attention
    projections the streams run on their own new frames (every layer's in one call, quantised as the step is)."""

    def __init__(self, model: WhisperForConditionalGeneration, quantize: bool = True, threads: int = 0,
                 progress: Callable[[str], None] | None = None, cross_kv: bool = True) -> None:
        """`cross_kv` False: no projection graph (the offline pass projects its frames itself, onnx_pass.py)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_float_cpu(base)
        self.session = graph_session(lambda: export_step(base, quantize, progress), threads)
        self.cross = graph_session(lambda: export_cross_kv(base, quantize, progress), threads) if cross_kv else None
        self.n_layers = len(base.model.decoder.layers)  # no torch weights kept: both graphs hold their own
        self.heads = base.config.decoder_attention_heads
        self.d_head = base.config.d_model // self.heads
        self.max_positions = base.config.max_target_positions
        self.names = cache_names(self.n_layers)

    def cross_kv(self, frames: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Cross-attention K and V of encoder frames [n, d]: [layers, heads, n, head_dim] each, float32."""
        if self.cross is None:
            raise RuntimeError("this OnnxStep was built without its cross-attention graph (cross_kv=False)")
        k, v = self.cross.run(None, {"frames": np.ascontiguousarray(frames.detach().float().numpy())})
        return k, v


class _Room:
    """Per-layer [heads, room, head_dim] float32 buffers with `size` valid rows, grown `GROW` rows at a time. Each
    layer's buffer is one contiguous array, so the graph reads it in place; it attends over the whole room (masking
    the rows past `size`), so the room stays close to the size rather than doubling, and a growth copies the valid
    rows once."""

    GROW = 64

    def __init__(self, layers: int, heads: int, d_head: int, room: int = 16) -> None:
        self.shape = (layers, heads, d_head)
        self.data = np.zeros((layers, 2, heads, room, d_head), np.float32)  # [layer, k|v, heads, room, head_dim]
        self.size = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Append K/V [layers, heads, n, head_dim] as rows size..size+n."""
        n = k.shape[2]
        if self.size + n > self.data.shape[3]:
            room = -(-(self.size + n) // self.GROW) * self.GROW
            grown = np.zeros((*self.data.shape[:3], room, self.data.shape[4]), np.float32)
            grown[:, :, :, : self.size] = self.data[:, :, :, : self.size]
            self.data = grown
        self.data[:, 0, :, self.size : self.size + n] = k
        self.data[:, 1, :, self.size : self.size + n] = v
        self.size += n

    def buffers(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each layer's K and V buffers, whole (contiguous): the graph masks the rows from `size` on."""
        layers = range(self.data.shape[0])
        return [self.data[i, 0] for i in layers], [self.data[i, 1] for i in layers]


class OnnxDecoder:
    """`decoder.IncrementalDecoder` run by an `OnnxStep`: the same `Scorer` semantics (a position keeps the
    encoder frames it was fed with; `truncate` and `drop_frames` roll back), the same log-probabilities up to the
    graph's arithmetic."""

    def __init__(self, step: OnnxStep, frames: int = 16) -> None:
        """`frames`: the encoder frames to make room for at once (more are made room for as they come)."""
        self._step = step
        shape = (step.n_layers, step.heads, step.d_head)
        self._cross = _Room(*shape, room=frames)
        self._self = _Room(*shape)

    @property
    def n_frames(self) -> int:
        return self._cross.size

    @property
    def length(self) -> int:
        return self._self.size

    def add_frames(self, frames: Tensor) -> None:
        if frames.shape[0]:
            self._cross.append(*self._step.cross_kv(frames))

    def add_kv(self, k: np.ndarray, v: np.ndarray) -> None:
        """Frames given by their cross-attention K and V [layers, heads, n, head_dim], projected once elsewhere
        (the offline pass's silence, `onnx_pass.py`)."""
        self._cross.append(k, v)

    def feed(self, ids: Sequence[int], last: int | None = None) -> Tensor:
        """Log-probs [len(ids) or last, vocab] of the token after each of `ids`; the ids join the cache."""
        if self.n_frames == 0:
            raise RuntimeError("feed before any encoder frame")
        n, start = len(ids), self.length
        if start + n > self._step.max_positions:
            raise ValueError(f"decoder position {start + n} exceeds max_target_positions {self._step.max_positions}")
        self_k, self_v = self._self.buffers()
        cross_k, cross_v = self._cross.buffers()
        inputs = {"ids": np.asarray(ids, np.int64), "start": np.array(start, np.int64),
                  "rows": np.array(last or n, np.int64), "frames": np.array(self.n_frames, np.int64)}
        inputs.update(zip(self._step.names, [*self_k, *self_v, *cross_k, *cross_v], strict=True))
        logp, new_k, new_v = self._step.session.run(None, inputs)
        self._self.append(new_k, new_v)
        return torch.from_numpy(logp)

    def truncate(self, length: int) -> None:
        self._self.size = min(self._self.size, length)

    def drop_frames(self, n_frames: int) -> None:
        self._cross.size = min(self._cross.size, n_frames)
