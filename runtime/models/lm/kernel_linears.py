"""Linear layers on the runtime's own CPU kernels (`cpu_kernels`): 4-bit and 8-bit weights in groups of 32.

Why beside torch's (`weight_formats.Int4Linear`, `Int8Linear`): torch's kernels dequantise every weight to float
and multiply in float, which left the engine behind llama.cpp on Qwen2.5-Coder-1.5B (0.8-0.96x at 1 and 2 threads
here) and at about half its speed on AVX2-only CPUs (issue 51). These multiply int8-quantised activations with
integer dot products, as llama.cpp does, on AVX-512 VNNI or AVX2, whichever the CPU has (`cpu_kernels.isa()`).

The groups are GGUF's own: a Q4_0/Q4_1/Q4_K group of 32 is `Q4Linear`'s exactly (scale and offset in fp16), a
Q8_0 or Q5_0 block `Q8Linear`'s exactly; anything else is quantised by group (4-bit by minimum and maximum, 8-bit
symmetric). `lm.kernels` chooses between these and torch's (`use_runtime_kernels`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from runtime.errors import ConfigError
from runtime.models.lm.gguf_checkpoint import Q4Blocks, Q8Blocks

KERNEL_CHOICES = ("auto", "runtime", "torch")
GROUP = 32
ROWS_AT_ONCE = 4096  # rows quantised together: the float temporaries of the largest layer (the vocabulary) stay small


def use_runtime_kernels(choice: str, device: torch.device | str) -> bool:
    """Whether int8/int4 layers run on the runtime's kernels: `runtime` (an error where they cannot be built),
    `torch` (never), `auto` (on a CPU where they build; else torch's, with a warning logged once)."""
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"lm.kernels {choice!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if choice == "torch" or torch.device(device).type != "cpu":
        return False
    from runtime.models.lm import cpu_kernels

    if choice == "runtime":
        try:
            cpu_kernels.load()
        except cpu_kernels.KernelBuildError as err:
            raise ConfigError(f"lm.kernels = runtime: {err}") from None
        return True
    return cpu_kernels.available()


def kernel_path(choice: str, device: torch.device | str) -> str:
    """What int8/int4 layers run on, for reports: `runtime avx512-vnni`, `runtime avx2`, or `torch`."""
    if not use_runtime_kernels(choice, device):
        return "torch"
    from runtime.models.lm import cpu_kernels

    return f"runtime {cpu_kernels.isa()}"


def on_runtime_kernels(model: nn.Module) -> bool:
    """Whether a model's linears run on the runtime's kernels: then its cached attention runs on the runtime's
    kernel too (`attention.KernelKeys`), the library being loaded already."""
    return any(isinstance(m, Q4Linear | Q8Linear) for m in model.modules())


def _load() -> None:
    """The kernels' ops registered with torch (built once per machine): a layer is never made without them."""
    from runtime.models.lm import cpu_kernels

    cpu_kernels.load()


class Q4Linear(nn.Module):
    def __init__(self, packed: Tensor, bias: Tensor | None, in_features: int, out_features: int) -> None:
        super().__init__()
        _load()
        self.register_buffer("q4", packed)  # uint8 [ceil(out / 16), in / 32, 320] (cpu_kernels.pack_q4)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def from_blocks(cls, b: Q4Blocks, bias: Tensor | None) -> Q4Linear:
        from runtime.models.lm.cpu_kernels import pack_q4

        return cls(pack_q4(b.q, b.scale, b.low), bias, b.q.shape[1], b.q.shape[0])

    def dequantized(self) -> Tensor:
        from runtime.models.lm.cpu_kernels import dequantize

        return dequantize(self.q4, self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.runtime_kernels.q4_linear(x.reshape(-1, self.in_features), self.q4, self.out_features, None)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Q8Linear(nn.Module):
    def __init__(self, packed: Tensor, bias: Tensor | None, in_features: int, out_features: int) -> None:
        super().__init__()
        _load()
        self.register_buffer("q8", packed)  # uint8 [ceil(out / 16), in / 32, 544] (cpu_kernels.pack_q8)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def from_blocks(cls, b: Q8Blocks, bias: Tensor | None) -> Q8Linear:
        from runtime.models.lm.cpu_kernels import pack_q8

        return cls(pack_q8(b.q, b.scale), bias, b.q.shape[1], b.q.shape[0])

    @classmethod
    def quantize(cls, w: Tensor, bias: Tensor | None) -> Q8Linear:
        return cls.from_blocks(q8_blocks_of(w), bias)

    def dequantized(self) -> Tensor:
        from runtime.models.lm.cpu_kernels import dequantize

        return dequantize(self.q8, self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.runtime_kernels.q8_linear(x.reshape(-1, self.in_features), self.q8, self.out_features, None)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class PackedEmbedding(nn.Module):
    """The token embeddings in the file's own 4- or 8-bit groups (the kernels' q4/q8 layout), each looked-up row
    dequantised to `dtype`. Why: as a float table the 1.5B's 151,936 x 1,536 embeddings took 445 MB in bfloat16,
    for the Q4_K blocks the file keeps them in (146 MB packed); a decode step reads one row of it. The rows are the
    values the file's blocks hold (`packing.dequantize_rows`), cast to `dtype` as the float table's were."""

    def __init__(self, packed: Tensor, num_embeddings: int, dtype: torch.dtype) -> None:
        from runtime.models.lm.cpu_kernels.packing import Q4_BLOCK

        super().__init__()
        self.kind = "q4" if packed.shape[-1] == Q4_BLOCK else "q8"
        self.register_buffer(self.kind, packed)  # uint8 [ceil(rows / 16), dim / 32, 320 or 544]
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, packed.shape[1] * GROUP, dtype

    @classmethod
    def from_blocks(cls, blocks: Q4Blocks | Q8Blocks, dtype: torch.dtype) -> PackedEmbedding:
        from runtime.models.lm.cpu_kernels import pack_q4, pack_q8

        packed = (pack_q4(blocks.q, blocks.scale, blocks.low) if isinstance(blocks, Q4Blocks)
                  else pack_q8(blocks.q, blocks.scale))
        return cls(packed, blocks.q.shape[0], dtype)

    @property
    def packed(self) -> Tensor:
        return self.get_buffer(self.kind)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def forward(self, ids: Tensor) -> Tensor:
        from runtime.models.lm.cpu_kernels import dequantize_rows

        rows = dequantize_rows(self.packed, ids.reshape(-1).long())
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)


def q8_blocks_of(w: Tensor) -> Q8Blocks:
    """Quantise a float weight [out, in] symmetrically by groups of 32 inputs, as GGUF's Q8_0 does."""
    out, k = w.shape
    if k % GROUP:
        raise ConfigError(f"8-bit weights need input sizes divisible by {GROUP}; this layer has {k}")
    q = torch.empty(out, k, dtype=torch.int8)
    scale = torch.empty(out, k // GROUP)
    for start in range(0, out, ROWS_AT_ONCE):  # float temporaries of a few rows, not of a whole vocabulary
        blocks = w[start : start + ROWS_AT_ONCE].float().reshape(-1, k // GROUP, GROUP)
        s = blocks.abs().amax(-1) / 127
        scale[start : start + ROWS_AT_ONCE] = s
        q[start : start + ROWS_AT_ONCE] = torch.round(blocks / s.clamp(min=1e-30)[..., None]).clamp(
            -127, 127).to(torch.int8).reshape(-1, k)
    return Q8Blocks(q, scale)


def packed_embedding(state: dict[str, Tensor], name: str, table: nn.Embedding,
                     dtype: torch.dtype) -> PackedEmbedding | None:
    """The embeddings `state` (a model's own `state_dict`) holds under `name` in a kernel layout, as the meta `table`
    they replace, their rows in `dtype`; None when it holds a float table."""
    for kind in ("q4", "q8"):
        if f"{name}.{kind}" in state:
            return PackedEmbedding(state[f"{name}.{kind}"], table.num_embeddings, dtype)
    return None


def kernel_layer(state: dict[str, Tensor], name: str, lin: nn.Linear) -> nn.Module | None:
    """The layer `state` (a model's own `state_dict`, `packed_weights`) holds under `name` in a kernel layout, shaped
    as the meta `lin` it replaces; None when it holds none."""
    bias = state.get(f"{name}.bias")
    if f"{name}.q4" in state:
        return Q4Linear(state[f"{name}.q4"], bias, lin.in_features, lin.out_features)
    if f"{name}.q8" in state:
        return Q8Linear(state[f"{name}.q8"], bias, lin.in_features, lin.out_features)
    return None
