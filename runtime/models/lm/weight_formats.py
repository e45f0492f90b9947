"""Weight formats of the engine's linear layers (`lm.weights`): fp32, bf16, int8, int4 and native.

Decoding one token reads every weight once, so on a CPU its speed is set by the bytes a weight takes and the
kernel that reads them. fp32 and bf16 are the model's dtype (oneDNN matmuls; bf16 halves the bytes on
AVX-512 BF16). int8, int4 and native are weight-only: activations are bfloat16 (the kernels' fast path), and torch's
CPU kernels multiply by the quantised weights directly:

- int8: `aten._weight_int8pack_mm`, one symmetric scale per output row (quantised from the float weights);
- int4: `aten._weight_int4pack_mm_for_cpu`, one scale and zero per 32 inputs of a row. Its dequantisation is
  w = (q - 8) * scale + zero with q in 0..15, which is exactly a GGUF Q4_1 block (w = q * d + m, so scale = d
  and zero = m + 8 d) and a Q4_0 one (m = -8 d): a GGUF file's 4-bit blocks are taken as they are, and any
  other weight (the Q8_0 embeddings a tied head reads, a safetensors checkpoint) is quantised by its block's
  minimum and maximum, as Q4_1 does.

- native: each projection in the layout nearest its own storage in a GGUF file: 4-bit blocks (Q4_0, Q4_1, Q4_K)
  as int4, exactly; anything finer (Q5_0, Q6_K, Q8_0, float) as int8. Quantising a 5- or 6-bit weight to 4 bits
  loses what the file kept: on Qwen2.5-Coder-0.5B (mostly Q5_0) int4 moved the logits from llama.cpp's by a mean
  KL of 0.08 and int8 by 0.004 (docs/llm.md). A fused projection is int4 only when all its parts are 4-bit.

Only the projections and the head change; embeddings, norms and the KV cache stay in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

from runtime.errors import ConfigError
from runtime.models.lm.gguf_checkpoint import Q4Blocks, Q8Blocks
from runtime.models.lm.kernel_linears import ROWS_AT_ONCE, Q4Linear, Q8Linear, kernel_layer, packed_embedding

WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int8", "int4", "native")
QUANTIZED = ("int8", "int4", "native")  # weight-only formats: bf16 activations around torch's int8/int4 kernels
GROUP = 32
T = TypeVar("T", Q4Blocks, Q8Blocks)
BlockSource = Callable[[str], Q4Blocks | None]  # a weight's own 4-bit blocks by checkpoint name, if it has them
Block8Source = Callable[[str], Q8Blocks | None]  # its own 8-bit groups (Q8_0, Q5_0), if it has them


def format_dtype(weights: str, dtype: torch.dtype) -> torch.dtype:
    """The model's dtype under weight format `weights` (auto keeps the run's `dtype`). The quantised formats compute
    in bfloat16 around their weight-only matmuls: torch's CPU kernels take bf16 activations on their fast path
    (the head of SmolLM2-135M in int4: 0.8 ms with bf16 activations, 41 ms with float32 ones)."""
    if weights not in WEIGHT_FORMATS:
        raise ConfigError(f"lm.weights {weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "fp32":
        return torch.float32
    if weights == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if weights in QUANTIZED else dtype


class Int8Linear(nn.Module):
    def __init__(self, weight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # int8 [out, in]
        self.register_buffer("scales", scales)  # [out], the activations' dtype
        self.register_buffer("bias", bias)  # a buffer: saved with the packed weights (`packed_weights`)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def quantize(cls, w: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Int8Linear:
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales.to(dtype), bias)

    def dequantized(self) -> Tensor:
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, bias: Tensor | None, in_features: int,
                 group: int = GROUP) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # uint8 [out, in / 2], the CPU kernel's layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, out, 2]
        self.register_buffer("bias", bias)
        self.group, self.in_features, self.out_features = group, in_features, packed.shape[0]

    @classmethod
    def from_blocks(cls, b: Q4Blocks, bias: Tensor | None, dtype: torch.dtype) -> Int4Linear:
        if b.q.shape[0] % 16:
            raise ConfigError(f"int4 weights need output sizes divisible by 16 (torch's CPU kernel); a layer of "
                              f"this model has {b.q.shape[0]}: use lm.weights = int8 or bf16")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(b.q.to(torch.int32).contiguous(), 1)
        sz = torch.stack([b.scale, b.low + 8 * b.scale], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(packed, sz, bias, b.q.shape[1], b.group)

    @classmethod
    def quantize(cls, w: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Int4Linear:
        return cls.from_blocks(q4_blocks_of(w), bias, dtype)

    def dequantized(self) -> Tensor:
        """The float weight [out, in] the kernel computes with (for tests and quality reports)."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return self.forward(eye).float().T

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.packed, self.group,
                                                       self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def empty_like_state(model: nn.Module, state: dict[str, Tensor], dtype: torch.dtype) -> None:
    """Give `model` (built on the meta device) int8 and int4 layers wherever `state` (a quantised model's own
    `state_dict`, as `packed_weights` saves it) holds their buffers, so that `load_state_dict(state, assign=True)`
    puts every tensor in place: `.packed` marks an int4 layer, an int8 `.weight` an int8 one, `.q4` / `.q8` one on
    the runtime's kernels (`kernel_linears`), and embeddings there too (`PackedEmbedding`, their rows in `dtype`,
    the activations')."""
    for name in [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if (table := packed_embedding(state, name, getattr(parent, attr), dtype)) is not None:
            setattr(parent, attr, table)
    for name in [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = state.get(f"{name}.bias")
        new: nn.Module | None
        if (new := kernel_layer(state, name, getattr(parent, attr))) is not None:
            pass
        elif f"{name}.packed" in state:
            packed, sz = state[f"{name}.packed"], state[f"{name}.scales_and_zeros"]
            k = packed.shape[1] * 2
            new = Int4Linear(packed, sz, bias, k, k // sz.shape[0])
        elif state.get(f"{name}.weight", torch.empty(0)).dtype == torch.int8:
            new = Int8Linear(state[f"{name}.weight"], state[f"{name}.scales"], bias)
        else:
            continue
        setattr(parent, attr, new)


def q4_blocks_of(w: Tensor, group: int = GROUP) -> Q4Blocks:
    """Quantise a float weight [out, in] by blocks of `group` inputs, Q4_1-style (minimum and step per block)."""
    out, k = w.shape
    if k % group:
        raise ConfigError(f"int4 weights need input sizes divisible by {group}; this layer has {k}")
    q = torch.empty(out, k, dtype=torch.int32)
    scale, low = torch.empty(out, k // group), torch.empty(out, k // group)
    for start in range(0, out, ROWS_AT_ONCE):  # float temporaries of a few rows, not of a whole vocabulary
        rows = slice(start, start + ROWS_AT_ONCE)
        blocks = w[rows].float().reshape(-1, k // group, group)
        lo, high = blocks.amin(-1), blocks.amax(-1)
        sc = ((high - lo) / 15).clamp(min=1e-12)
        scale[rows], low[rows] = sc, lo
        q[rows] = torch.round((blocks - lo[..., None]) / sc[..., None]).clamp(0, 15).to(torch.int32).reshape(-1, k)
    return Q4Blocks(q, scale, low, group)


def fused_blocks(parts: list[Q4Blocks | None]) -> Q4Blocks | None:
    """The blocks of a fused projection (parts stacked along the output rows), when every part has them."""
    if not parts or any(p is None for p in parts):
        return None
    ok = [p for p in parts if p is not None]
    return Q4Blocks(torch.cat([p.q for p in ok]), torch.cat([p.scale for p in ok]),
                    torch.cat([p.low for p in ok]), ok[0].group)


def fused_blocks8(parts: list[Q8Blocks | None]) -> Q8Blocks | None:
    """`fused_blocks` for 8-bit groups."""
    if not parts or any(p is None for p in parts):
        return None
    ok = [p for p in parts if p is not None]
    return Q8Blocks(torch.cat([p.q for p in ok]), torch.cat([p.scale for p in ok]))


def quantize_linears(model: nn.Module, fmt: str, *, blocks: BlockSource | None = None,
                     blocks8: Block8Source | None = None, fused: dict[str, tuple[str, ...]] | None = None,
                     kernels: bool = False) -> int:
    """Replace every `nn.Linear` of `model` by its int8, int4 or native form, in place; returns how many.

    `blocks` / `blocks8` give a weight's own 4-bit blocks / 8-bit groups by its checkpoint name
    (`model.layers.0.self_attn.q_proj.weight`); `fused` maps our fused module suffixes to the checkpoint modules they
    were built from. `kernels`: on the runtime's kernels (`kernel_linears`: groups of 32, 8-bit ones too) instead
    of torch's."""
    if fmt not in QUANTIZED:
        raise ValueError(f"quantize_linears takes {', '.join(QUANTIZED)}, not {fmt!r}")
    if next(model.parameters()).device.type != "cpu":
        raise ConfigError(f"lm.weights = {fmt} runs on CPU kernels; on a GPU use fp32 or bf16")
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin: nn.Linear = getattr(parent, attr)
        w, bias = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
        dtype = w.dtype if w.dtype != torch.float64 else torch.float32
        new: nn.Module
        own = None if fmt == "int8" else _own_blocks(name, blocks, fused or {}, fused_blocks)
        if kernels:
            new = _kernel_layer(fmt, own, _own_blocks(name, blocks8, fused or {}, fused_blocks8), w, bias)
        elif own is not None:
            new = Int4Linear.from_blocks(own, bias, dtype)
        elif fmt == "int4":
            new = Int4Linear.quantize(w, bias, dtype)
        else:  # int8, or a native weight stored finer than 4 bits
            new = Int8Linear.quantize(w, bias, dtype)
        setattr(parent, attr, new)
    return len(names)


def _kernel_layer(fmt: str, own4: Q4Blocks | None, own8: Q8Blocks | None, w: Tensor,
                  bias: Tensor | None) -> nn.Module:
    """A layer on the runtime's kernels: int4 4-bit (the file's blocks, else quantised), int8 8-bit (the file's
    groups, else quantised), native 4-bit where the file is, else 8-bit. Biases keep their dtype."""
    if own4 is not None:
        return Q4Linear.from_blocks(own4, bias)
    if fmt == "int4":
        return Q4Linear.from_blocks(q4_blocks_of(w), bias)
    return Q8Linear.from_blocks(own8, bias) if own8 is not None else Q8Linear.quantize(w, bias)


def _own_blocks(name: str, blocks: Callable[[str], T | None] | None, fused: dict[str, tuple[str, ...]],
                fuse: Callable[[list[T | None]], T | None]) -> T | None:
    if blocks is None:
        return None
    for suffix, parts in fused.items():
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            return fuse([blocks(f"{stem}{part}.weight") for part in parts])
    return blocks(f"{name}.weight")
