"""Helpers shared by the benchmarks: wall time that waits for the accelerator, percentiles, targets, and the
record of the machine and library versions every result carries."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: str = "cpu") -> tuple[T, float]:
    """Run `fn` and return (result, seconds), waiting for queued GPU work on both sides."""
    synchronize(device)
    started = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - started


def percentiles_ms(seconds: Sequence[float], qs: Sequence[int] = (50, 95)) -> dict[str, float]:
    if not seconds:
        return {f"p{q}": float("nan") for q in qs}
    values = np.asarray(seconds) * 1000.0
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in qs}


def at_most(value: float | None, target: float) -> dict[str, Any]:
    """A target of the form `value <= target`, as the benchmarks report it (a missing value is not met)."""
    return {"value": value, "target": f"<= {target:g}", "met": value is not None and value <= target}


def at_least(value: float | None, target: float) -> dict[str, Any]:
    """A target of the form `value >= target` (a missing value is not met)."""
    return {"value": value, "target": f">= {target:g}", "met": value is not None and value >= target}


def cpu_name() -> str:
    """The CPU's model name (a VM may only say "AMD EPYC"), with the widest vector extension it advertises: the
    same name covers AVX-512 and AVX2-only parts, whose results differ."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in info.splitlines()
                                                             if ":" in line)}
    name = fields.get("model name", "unknown")
    flags = set(fields.get("flags", "").split())
    widest = next((f for f in ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if f in flags), "none")
    return f"{name} ({widest})"


def machine(device: str, dtype: str | None, threads: int) -> dict[str, Any]:
    """Where a result was measured: numbers are only comparable with the same hardware and library versions."""
    import transformers

    return {"device": device, "dtype": dtype, "torch_threads": threads, "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": cpu_name(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None}
