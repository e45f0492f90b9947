"""One Whisper encoder layer, computed two ways that give the same states (to float rounding).

`hf_layer` runs the Hugging Face modules themselves (so peft's LoRA wrappers train through it) with an explicit
mask; `packed_layer` runs the same math on `PackedLayer` copies of the weights laid out for small-batch CPU GEMMs
(q/k/v fused, [in, out] matrices), which a stream runs in eval mode while every projection is a plain
`nn.Linear` (no adapter, or a merged one). Given a `KVCache`, both append a block's keys and values to it, so a
block attends to every earlier block without recomputing it. `CausalWhisperEncoder` (encoder.py) decides which
one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.whisper.modeling_whisper import WhisperAttention, WhisperEncoderLayer


class KVCache:
    """One layer's self-attention keys/values [heads, capacity, head_dim], allocated once for a full stream."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add k, v [heads, t, head_dim]; returns views of every cached key and value [heads, n + t, head_dim]."""
        if self.k is None or self.v is None:
            self.k = k.new_empty(k.shape[0], self.capacity, k.shape[2])
            self.v = v.new_empty(v.shape[0], self.capacity, v.shape[2])
        need = self.n + k.shape[1]
        self.k[:, self.n : need] = k
        self.v[:, self.n : need] = v
        self.n = need
        return self.k[:, :need], self.v[:, :need]

    def truncate(self, n: int) -> None:
        """Forget every key/value from position `n` on (a preview's block is taken back)."""
        self.n = min(self.n, n)


def hf_attention(
    attn: WhisperAttention, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None
) -> torch.Tensor:
    """Whisper self-attention with an explicit mask and optional K/V cache (HF's math: q scaled first)."""
    b, t, _ = x.shape
    shape = (b, t, attn.num_heads, attn.head_dim)
    q = (attn.q_proj(x) * attn.scaling).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    if cache is not None:
        k, v = (c[None] for c in cache.append(k[0], v[0]))
    p = attn.dropout if attn.training else 0.0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0)
    return attn.out_proj(out.transpose(1, 2).reshape(b, t, -1))


def hf_layer(
    layer: WhisperEncoderLayer, h: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None
) -> torch.Tensor:
    """WhisperEncoderLayer.forward with our attention (pre-norm attention and MLP, residuals, fp16 clamp)."""
    training = layer.training
    x = hf_attention(layer.self_attn, layer.self_attn_layer_norm(h), mask, cache)
    h = h + F.dropout(x, p=layer.dropout, training=training)
    x = layer.activation_fn(layer.fc1(layer.final_layer_norm(h)))
    x = layer.fc2(F.dropout(x, p=layer.activation_dropout, training=training))
    h = h + F.dropout(x, p=layer.dropout, training=training)
    if h.dtype == torch.float16:
        bound = torch.finfo(h.dtype).max - 1000
        h = torch.clamp(h, min=-bound, max=bound)
    return h


class PackedLayer(NamedTuple):
    """One layer's weights laid out for the streaming path (built by `pack_layer`, cached by
    `CausalWhisperEncoder.stream_weights`)."""

    norm1: tuple[torch.Tensor, torch.Tensor, float]  # self_attn_layer_norm weight, bias, eps
    qkv: tuple[torch.Tensor, torch.Tensor]  # [d, 3d] = [q * scaling | k | v]^T, bias (k's is zero)
    out: tuple[torch.Tensor, torch.Tensor]  # [d, d], bias
    norm2: tuple[torch.Tensor, torch.Tensor, float]
    fc1: tuple[torch.Tensor, torch.Tensor]  # [d, ffn], bias
    act: Callable[[torch.Tensor], torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]  # [ffn, d], bias


def pack_layer(layer: WhisperEncoderLayer) -> PackedLayer:
    """`layer`'s current weights as [in, out] matrices: fused q/k/v, q pre-scaled (exact for 64-dim heads)."""
    attn = layer.self_attn
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
    cpu = q.weight.device.type == "cpu"  # MKL's small-batch GEMM is much faster on [in, out] weights

    def t(w: torch.Tensor) -> torch.Tensor:
        return w.t().contiguous() if cpu else w.t()

    def bias(m: nn.Linear) -> torch.Tensor:
        return m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)

    def norm(ln: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, float]:
        return ln.weight, ln.bias, ln.eps

    w_qkv = torch.cat([q.weight * attn.scaling, k.weight, v.weight]).t().contiguous()
    b_qkv = torch.cat([bias(q) * attn.scaling, bias(k), bias(v)])
    return PackedLayer(
        norm(layer.self_attn_layer_norm), (w_qkv, b_qkv), (t(o.weight), bias(o)), norm(layer.final_layer_norm),
        (t(layer.fc1.weight), bias(layer.fc1)), layer.activation_fn, (t(layer.fc2.weight), bias(layer.fc2)),
    )  # fmt: skip


def packed_layer(
    p: PackedLayer, h: torch.Tensor, mask: torch.Tensor | None, cache: KVCache, heads: int
) -> torch.Tensor:
    """`hf_layer` in eval mode on one sequence h [t, d] with packed weights: what the stream runs."""
    t, d = h.shape
    x = F.layer_norm(h, (d,), *p.norm1)
    q, k, v = torch.addmm(p.qkv[1], x, p.qkv[0]).view(t, 3, heads, d // heads).permute(1, 2, 0, 3)
    k, v = cache.append(k, v)
    x = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=1.0)[0]  # 4-D: CPU flash
    h = h + torch.addmm(p.out[1], x.transpose(0, 1).reshape(t, d), p.out[0])
    x = p.act(torch.addmm(p.fc1[1], F.layer_norm(h, (d,), *p.norm2), p.fc1[0]))
    h = h + torch.addmm(p.fc2[1], x, p.fc2[0])
    if h.dtype == torch.float16:
        bound = torch.finfo(h.dtype).max - 1000
        h = torch.clamp(h, min=-bound, max=bound)
    return h
