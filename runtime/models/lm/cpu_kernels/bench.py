"""Speed of the kernels on Qwen2.5-Coder-1.5B's projection shapes against torch's int4 and int8 CPU kernels.

    python -m runtime.models.lm.cpu_kernels.bench [--threads 1,2] [--m 1,4,16,256] [--seconds 0.3]

Why: a decode step reads every weight once, so the figure that matters at M = 1 is the weight bytes read per
second; at M = 16 (a speculative verification) and 256 (a prefill chunk) it is time against M one-row calls.
Each case runs for about `--seconds` and reports its best time: the machines are shared and timings noisy.
Torch's kernels run on the path torch chose at start-up: run once more with `ATEN_CPU_CAPABILITY=avx2` (which
forces these kernels' AVX2 path too) for both sides' AVX2 figures. Weights are random (speed does not depend on
their values).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor

from runtime.models.lm import cpu_kernels as ck

# Qwen2.5-Coder-1.5B: (name, N, K, per step). The head only at M <= 16: a prefill needs the last row's logits.
SHAPES = [("qkv", 2048, 1536, 28), ("o", 1536, 1536, 28), ("gate_up", 17920, 1536, 28), ("down", 1536, 8960, 28),
          ("head", 151936, 1536, 1)]


def best_ms(fn: Callable[[], object], seconds: float) -> float:
    """The best wall time of `fn` in ms, over about `seconds` (at least 3 runs, after one warm-up)."""
    fn()
    best, start, runs = float("inf"), time.perf_counter(), 0
    while runs < 3 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        runs += 1
    return best * 1e3


def torch_int4(n: int, k: int) -> tuple[Callable[[Tensor], Tensor], int]:
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = (torch.rand(k // 32, n, 2) * 0.01).to(torch.bfloat16)
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)), packed.numel() + sz.numel() * 2


def torch_int8(n: int, k: int) -> tuple[Callable[[Tensor], Tensor], int]:
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n) * 0.01).to(torch.bfloat16)
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x, w, scales)), w.numel() + scales.numel() * 2


def ours(kind: str, n: int, k: int) -> tuple[Callable[[Tensor], Tensor], int]:
    g = k // 32
    scale = torch.rand(n, g) * 0.01
    if kind == "q4":
        packed = ck.pack_q4(torch.randint(0, 16, (n, k), dtype=torch.uint8), scale, -8 * scale)
        return (lambda x: ck.q4_linear(x, packed, n)), packed.numel()
    packed = ck.pack_q8(torch.randint(-127, 128, (n, k), dtype=torch.int8), scale)
    return (lambda x: ck.q8_linear(x, packed, n)), packed.numel()


def decode_step(kinds: list[str], paths: list[str], threads: list[int], seconds: float, torch_too: bool) -> None:
    """The matmuls of one whole decode step (M = 1), each of the 28 layers with its own weights: about 0.9 GB
    (4-bit) read from memory as a real step reads them, where one shape alone stays in the CPU's cache."""
    cap = torch.backends.cpu.get_cpu_capability().lower()
    print("\none decode step's matmuls, 28 layers + head, each its own weights (M = 1):")
    for kind in kinds:
        makers: list[tuple[str, Callable[[int, int], tuple[Callable[[Tensor], Tensor], int]], str | None]] = [
            (f"{kind}-{p}", lambda n, k, kind=kind: ours(kind, n, k), p) for p in paths]
        if torch_too:
            makers.append((f"torch-{'int4' if kind == 'q4' else 'int8'}-{cap}",
                           torch_int4 if kind == "q4" else torch_int8, None))
        for label, make, path in makers:
            calls = [make(n, k) for _, n, k, per_step in SHAPES for _ in range(per_step)]
            xs = {k: torch.randn(1, k).to(torch.bfloat16) for _, _, k, _ in SHAPES}
            ks = [k for _, _, k, per_step in SHAPES for _ in range(per_step)]
            size = sum(c[1] for c in calls)
            if path is not None:
                ck.set_isa(path)

            def step(calls: list[tuple[Callable[[Tensor], Tensor], int]] = calls, ks: list[int] = ks,
                     xs: dict[int, Tensor] = xs) -> None:
                for (fn, _), k in zip(calls, ks, strict=True):
                    fn(xs[k])

            for t in threads:
                torch.set_num_threads(t)
                ms = best_ms(step, max(seconds, 1.0))
                print(f"  {label:>18} {t} thr: {ms:8.2f} ms  {size / ms / 1e6:5.1f} GB/s  ({1e3 / ms:5.1f} steps/s "
                      "bound)", flush=True)
            del calls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--m", default="1,4,16,256")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--kinds", default="q4,q8", help="q4 (against torch int4), q8 (against torch int8)")
    ap.add_argument("--isa", default="", help="paths of ours to run (default: avx2 and the CPU's best)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--step", action="store_true", help="only the whole decode step, every layer its own weights")
    args = ap.parse_args(argv)
    ck.load()
    forced = ck.isa()
    paths = args.isa.split(",") if args.isa else sorted({"avx2", forced} if forced != "scalar" else {"scalar"})
    threads = [int(t) for t in args.threads.split(",")]
    ms = [int(m) for m in args.m.split(",")]
    kinds = args.kinds.split(",")
    cap = torch.backends.cpu.get_cpu_capability().lower()
    if args.step:
        decode_step(kinds, paths, threads, args.seconds, not args.no_torch)
        ck.set_isa(forced)
        return
    print(f"ours: {', '.join(paths)} (CPU best {ck.best_isa()}); torch: {cap}; times are the best of "
          f"~{args.seconds} s each")
    print(f"{'shape':>8} {'N':>6} {'K':>5} {'M':>4} {'thr':>3} {'impl':>18} {'ms':>9} {'GB/s':>6} {'vs torch':>8}")
    for name, n, k, _ in SHAPES:
        if name not in args.shapes.split(","):
            continue
        for kind in kinds:
            impls = [(f"{kind}-{p}", *ours(kind, n, k), p) for p in paths]
            if not args.no_torch:
                fn, size = (torch_int4 if kind == "q4" else torch_int8)(n, k)
                impls.append((f"torch-{'int4' if kind == 'q4' else 'int8'}-{cap}", fn, size, None))
            for t in threads:
                torch.set_num_threads(t)
                for m in ms:
                    if name == "head" and m > 16:
                        continue
                    x = torch.randn(m, k).to(torch.bfloat16)
                    times = {}
                    for label, fn, _, path in impls:
                        if path is not None:
                            ck.set_isa(path)
                        times[label] = best_ms(lambda fn=fn, x=x: fn(x), args.seconds)
                    base = next((v for lab, v in times.items() if lab.startswith("torch")), None)
                    for label, _, size, _ in impls:
                        rel = f"{base / times[label]:7.2f}x" if base else ""
                        print(f"{name:>8} {n:>6} {k:>5} {m:>4} {t:>3} {label:>18} {times[label]:9.3f} "
                              f"{size / times[label] / 1e6:6.1f} {rel:>8}", flush=True)
    ck.set_isa(forced)


if __name__ == "__main__":
    main()
