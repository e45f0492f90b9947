"""Weight-only quantised linear layers on int8 activations for x86 CPUs: torch ops `runtime_kernels::q4_linear`
and `runtime_kernels::q8_linear` (kernels.cpp); and attention over a KV cache a token at a time in one call,
`runtime_kernels::attend` (attention.cpp: why is written there).

Why: decoding reads every weight once a token, so a CPU decodes only as fast as its matmul kernel reads weights.
torch's int4 and int8 kernels dequantise to float and read about 8.6 and 6.8 GB/s at one thread here (a plain sum
reads 15), and on AVX2-only CPUs the int4 one ran at about half of llama.cpp's speed (issue 51). These kernels do
what llama.cpp does: quantise the activations to int8 per group of 32 and multiply with integer dot products
(AVX2 maddubs/madd, AVX-512 VNNI dpbusd), a few instructions per 32 weights.

Exactness: each output element is computed by one thread in a fixed order over K from its own row of x, so the
logits of a row are bitwise the same whatever else is batched with it (a speculative verification of 16 rows
gives the logits of 16 one-row steps) and whatever the thread count; the AVX2, AVX-512 and scalar paths round
alike, so they agree bitwise too. The arithmetic is written out in kernels.cpp.

Use (from an nn.Module; the weights are packed once, at load):

    packed = pack_q4(blocks.q, blocks.scale, blocks.low)    # or pack_q8(q, scale); keep as a buffer
    y = q4_linear(x.reshape(-1, k), packed, n)              # x float32 or bfloat16 [M, K] -> [M, n], x's dtype

`load()` builds the library once per machine (into `cache_dir()/kernels`) and registers the ops with their fake
(shape) implementations, so torch.compile keeps them as calls inside a compiled graph. It raises
`KernelBuildError` where they cannot be built; `available()` says so without raising, for falling back to torch's
kernels. The path is chosen from the CPU's features (`isa()`); `RUNTIME_KERNEL_ISA=avx2` (or `scalar`), or
`ATEN_CPU_CAPABILITY=avx2` as for torch's own kernels, forces a narrower one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import torch
from torch import Tensor

from runtime.models.lm.cpu_kernels.build import KernelBuildError, load_library
from runtime.models.lm.cpu_kernels.packing import dequantize, dequantize_rows, pack_q4, pack_q8, unpack_q4, unpack_q8

__all__ = ["ISAS", "KernelBuildError", "attend", "available", "best_isa", "dequantize", "dequantize_rows", "isa",
           "load", "pack_q4", "pack_q8", "q4_linear", "q8_linear", "set_isa", "unpack_q4", "unpack_q8", "using_isa"]

log = logging.getLogger(__name__)
ISAS = ("scalar", "avx2", "avx512-vnni")  # the paths, by the code kernels.cpp numbers them with
ENV = "RUNTIME_KERNEL_ISA"
_lock = threading.Lock()
_state: bool | KernelBuildError = False  # True once loaded; the error once a build failed (not retried)


def load() -> None:
    """Build (once per machine) and load the kernels, register their fake implementations, and apply a path
    forced by the environment. Raises `KernelBuildError` when they cannot be built here."""
    global _state
    with _lock:
        if _state is True:
            return
        if isinstance(_state, KernelBuildError):
            raise _state
        try:
            load_library()
        except KernelBuildError as err:
            log.warning("%s; torch's own kernels run instead", err)  # once: later calls re-raise it silently
            _state = err
            raise
        _register_fakes()
        _state = True
    forced = _forced_isa()
    if forced is not None:
        set_isa(forced)


def available() -> bool:
    """Whether the kernels run here (loading them if need be); a build failure is logged once, not raised."""
    try:
        load()
    except KernelBuildError:
        return False
    return True


def q4_linear(x: Tensor, packed: Tensor, n: int, out_dtype: torch.dtype | None = None) -> Tensor:
    """y[..., j] = sum_k x[..., k] w[j, k] for the `pack_q4` weights of `n` output rows, x float32 or bfloat16
    [..., K]; y in `out_dtype` (default x's dtype). x is quantised to int8 per row and group of 32 (module doc)."""
    if _state is not True:
        load()
    return torch.ops.runtime_kernels.q4_linear(x, packed, n, out_dtype)


def q8_linear(x: Tensor, packed: Tensor, n: int, out_dtype: torch.dtype | None = None) -> Tensor:
    """`q4_linear` for `pack_q8` weights."""
    if _state is not True:
        load()
    return torch.ops.runtime_kernels.q8_linear(x, packed, n, out_dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Attention of each new token over the cache slots it sees, computed token by token in one call
    (attention.cpp): q [n, H, d], k/v [KV, S, d] (one layer's cache), `mask` bool [n, S] (None: every token sees
    all S slots); out [n, H, d] in q's dtype. A token's output depends only on its query and the keys it sees, so
    a verified draft's tokens get bitwise what one-token steps get."""
    if _state is not True:
        load()
    return torch.ops.runtime_kernels.attend(q, k, v, mask, scale)


def isa() -> str:
    """The path the kernels run now: "avx512-vnni", "avx2" or "scalar"."""
    load()
    return ISAS[torch.ops.runtime_kernels.isa()]


def best_isa() -> str:
    """The widest path this CPU runs."""
    load()
    return ISAS[torch.ops.runtime_kernels.best_isa()]


def set_isa(name: str) -> None:
    """Run the kernels on path `name` (one of `ISAS`) from now on, in this process; a path wider than the CPU's
    is a ValueError."""
    load()
    if name not in ISAS:
        raise ValueError(f"kernel path {name!r} is not one of {', '.join(ISAS)}")
    if ISAS.index(name) > ISAS.index(best_isa()):
        raise ValueError(f"this CPU cannot run the {name} kernels (its best is {best_isa()})")
    torch.ops.runtime_kernels.set_isa(ISAS.index(name))


@contextlib.contextmanager
def using_isa(name: str) -> Iterator[None]:
    """Run the kernels on path `name` inside the block (tests compare the paths in one process)."""
    before = isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(before)


def _forced_isa() -> str | None:
    """The path the environment asks for: `RUNTIME_KERNEL_ISA` (a name of `ISAS`, or `auto`), else torch's own
    `ATEN_CPU_CAPABILITY` (`avx2` -> avx2, `default` -> scalar); a path wider than the CPU's is ignored."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted in ("", "auto"):
        aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
        wanted = {"avx2": "avx2", "default": "scalar"}.get(aten, "")
    if not wanted:
        return None
    if wanted not in ISAS:
        log.warning("%s=%s is not one of auto, %s; ignored", ENV, wanted, ", ".join(ISAS))
        return None
    if ISAS.index(wanted) > torch.ops.runtime_kernels.best_isa():
        log.warning("%s=%s: this CPU's best path is %s; using that", ENV, wanted, best_isa())
        return None
    return wanted


def _register_fakes() -> None:
    """Shapes for torch.compile's fake tensors: inductor then keeps each op as one extern call in the graph."""

    def fake(x: Tensor, packed: Tensor, n: int, out_dtype: torch.dtype | None = None) -> Tensor:
        torch._check(x.shape[-1] == packed.shape[1] * 32)
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype or x.dtype)

    for op in ("q4_linear", "q8_linear"):
        torch.library.register_fake(f"runtime_kernels::{op}")(fake)

    @torch.library.register_fake("runtime_kernels::attend")
    def fake_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
        return q.new_empty(q.shape).contiguous()
