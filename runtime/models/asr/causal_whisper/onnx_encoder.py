"""The encoder's layers over a block as one ONNX Runtime graph (`asr.graph_runtime`; onnx_export.py says why), in
float32, the states `encoder_layers.packed_layer`'s to float rounding; or with `asr.encoder_weights = "int8"` its
linears in 8-bit weights and activations, which take about a third less time, most on a preview's few frames
(docs/model_card_causal_whisper.md measures what they change).

`_Layers` takes a block's frames (after the convolutions and positions: `MelEncoderStream` runs those in torch), the
number of frames the layers' K/V caches hold before it, the caches themselves (the stream's `KVCache` tensors,
passed without a copy; the graph gathers the held rows) and which of the block's frames each frame sees (a call
over several blocks is block-causal). It returns the final states and the block's K/V, which the stream appends to
its caches (a preview's are truncated again, as in torch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from runtime.models.asr.causal_whisper.encoder_layers import KVCache
from runtime.models.asr.causal_whisper.onnx_decoder import NEG, merge_heads, self_attention_qkv
from runtime.models.asr.causal_whisper.onnx_export import check_float_cpu, export_graph, graph_session


class _Layers(nn.Module):
    def __init__(self, encoder: WhisperEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.heads = encoder.config.encoder_attention_heads
        self.d = encoder.config.d_model

    def forward(self, h: Tensor, start: Tensor, sees: Tensor, *caches: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # [1, T, d] activations: the exporter writes each linear as MatMul + Add
        n_layers = len(self.encoder.layers)
        past_k, past_v = caches[:n_layers], caches[n_layers:]
        h = h[None]
        held = torch.arange(start)  # the cached frames: every one is visible to the block
        heads, d = self.heads, self.d
        new_k, new_v = [], []
        for i, layer in enumerate(self.encoder.layers):
            sa = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            q, k, v = self_attention_qkv(sa, x, heads, d // heads)
            new_k.append(k)
            new_v.append(v)
            kp, vp = past_k[i].index_select(1, held), past_v[i].index_select(1, held)
            s_new = torch.where(sees, q @ k.transpose(1, 2), NEG)
            p = torch.cat([q @ kp.transpose(1, 2), s_new], -1).softmax(-1)
            a = p[..., :start] @ vp + p[..., start:] @ v
            h = h + sa.out_proj(merge_heads(a, d))
            x = layer.final_layer_norm(h)
            h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
        return self.encoder.layer_norm(h)[0], torch.stack(new_k), torch.stack(new_v)


def export_layers(encoder: WhisperEncoder, progress: Callable[[str], None] | None = None,
                  quantize: bool = False) -> Path:
    """The encoder layers of `encoder` as an ONNX file (onnx_export.export_graph: exported once, then cached)."""
    module = _Layers(encoder)
    n_layers, d = len(encoder.layers), encoder.config.d_model
    heads = module.heads
    caches = [torch.zeros(heads, 8, d // heads) for _ in range(2 * n_layers)]
    names = cache_names(n_layers)
    args = (torch.zeros(3, d), torch.tensor(2), torch.ones(3, 3, dtype=torch.bool), *caches)
    return export_graph(module, "whisper-encoder-layers", args, ["h", "start", "sees", *names],
                        ["states", "new_k", "new_v"],
                        {"h": {0: "t"}, "sees": {0: "t", 1: "t"}, **{name: {1: f"room_{name}"} for name in names}},
                        quantize=quantize, progress=progress)


def cache_names(n_layers: int) -> list[str]:
    return [f"{kind}_{i}" for kind in ("k", "v") for i in range(n_layers)]


class OnnxEncoderLayers:
    """The graph of one encoder (shared by its streams): `run` is `MelEncoderStream._run`'s layer loop."""

    def __init__(self, encoder: WhisperEncoder, threads: int = 0, progress: Callable[[str], None] | None = None,
                 quantize: bool = False) -> None:
        check_float_cpu(encoder)
        self.session = graph_session(lambda: export_layers(encoder, progress, quantize), threads)
        self.names = cache_names(len(encoder.layers))
        self.heads = encoder.config.encoder_attention_heads
        self.d_head = encoder.config.d_model // self.heads
        self._empty = np.zeros((self.heads, 1, self.d_head), np.float32)

    def run(self, h: Tensor, mask: Tensor | None, caches: list[KVCache]) -> Tensor:
        """States [t, d] of frames h [t, d] that follow the frames the caches hold (all caches hold as many);
        `mask` [t, held + t] (None: the frames see each other and every held frame). The frames' K/V are appended
        to the caches."""
        t, held = h.shape[0], caches[0].n
        sees = np.ones((t, t), bool) if mask is None else mask[:, held:].numpy()
        ks = [self._empty if c.k is None else c.k.numpy() for c in caches]
        vs = [self._empty if c.v is None else c.v.numpy() for c in caches]
        inputs = {"h": h.numpy(), "start": np.array(held, np.int64), "sees": np.ascontiguousarray(sees)}
        inputs.update(zip(self.names, [*ks, *vs], strict=True))
        states, new_k, new_v = self.session.run(None, inputs)
        for cache, k, v in zip(caches, torch.from_numpy(new_k), torch.from_numpy(new_v), strict=True):
            cache.append(k, v)
        return torch.from_numpy(states)
