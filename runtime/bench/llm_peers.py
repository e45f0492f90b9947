"""llama.cpp as the CPU speed peer of `runtime bench llm --model FILE.gguf`: llama-cpp-python on the same GGUF file
at the same thread counts. Optional (`make peers` builds it from source for this CPU, about 5 minutes on 2
cores, once per kind of CPU): when it is missing the row says so and the bench goes on."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from llama_cpp import Llama

INSTALL = "make peers  (builds llama.cpp from source for this CPU: about 5 minutes on 2 cores)"
# llama.cpp built for AVX2 alone, beside the environment (the Makefile's LLAMA_AVX2): the peer of the runtime's AVX2
# path forced on a wider CPU, standing in for the llama.cpp an AVX2-only CPU would run
AVX2_BUILD = Path.home() / ".cache" / "runtime" / "peers" / "llama-cpp-python-0.3.36-avx2"
AVX2_INSTALL = "make peers-avx2  (builds llama.cpp for AVX2 alone, beside the environment: about 5 minutes on 2 cores)"


def avx2_build_env() -> dict[str, str]:
    """The environment a child process imports llama.cpp's AVX2-only build under ({} when it is not built)."""
    if not (AVX2_BUILD / "llama_cpp").is_dir():
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(AVX2_BUILD), os.environ.get("PYTHONPATH", "")) if p)}


def llama_cpp_build() -> dict[str, Any]:
    """Which llama.cpp this process imports: its version, where from, and the instruction sets ggml says it was
    built with (its own report, not ours: `llama_print_system_info`)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    isas = sorted(part.split("=")[0].strip() for part in info.replace("CPU :", "").split("|")
                  if part.strip().endswith("= 1"))
    where = Path(llama_cpp.__file__).parent.parent
    return {"version": llama_cpp.__version__, "from": str(where), "built_with": isas,
            "avx512": any(i.startswith("AVX512") for i in isas)}


def llama_cpp_rows(file: Path, prompt: Sequence[int], n: int, threads: Sequence[int],
                   status: Callable[[str], None]) -> dict[str, Any]:
    """Greedy decode tokens/s (n tokens after the prompt, llama.cpp's own top-1 sampler) and prefill tokens/s
    (512 tokens in one batch) per thread count; the same prompt ids as the engine's rows."""
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": f"llama-cpp-python is not installed: {INSTALL}"}

    out: dict[str, Any] = {"version": llama_cpp.__version__}
    try:
        _measure(file, prompt, n, threads, status, out)
    except Exception as err:  # any failure of the peer is its row, never the bench's end
        return {**out, "skipped": f"llama.cpp failed on {file.name}: {type(err).__name__}: {err}"}
    return out


def open_llama(file: Path, threads: int) -> Llama:
    """llama.cpp on `file` at `threads` threads (decode and batch), as every row here runs it."""
    from llama_cpp import Llama

    return Llama(str(file), n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512, verbose=False)


def decode_once(llm: Llama, prompt: Sequence[int], n: int) -> float:
    """Tokens/s of `n` greedy tokens after `prompt` (its forward and first token not timed)."""
    llm.reset()
    gen = llm.generate(list(prompt), temp=0.0, top_k=1, reset=True)
    next(gen)  # the prompt's forward and the first token
    start = time.perf_counter()
    for _ in range(n):
        next(gen)
    rate = n / (time.perf_counter() - start)
    gen.close()
    return rate


def _measure(file: Path, prompt: Sequence[int], n: int, threads: Sequence[int], status: Callable[[str], None],
             out: dict[str, Any]) -> None:
    for t in threads:
        status(f"llama.cpp: decode and prefill at {t} thread(s)")
        llm = open_llama(file, t)
        out[f"decode_tok_s_{t}t"] = round(max(decode_once(llm, prompt, n) for _ in range(2)), 2)
        filler = (list(prompt) * (512 // max(1, len(prompt)) + 1))[:512]
        llm.reset()
        start = time.perf_counter()
        llm.eval(filler)
        out[f"prefill_tok_s_{t}t"] = round(512 / (time.perf_counter() - start), 1)
        llm.close()  # its threads go now, not when the garbage collector finds it: idle ones slowed the next run


def llama_cpp_logits(file: Path, ids: Sequence[int], threads: int = 2) -> np.ndarray:
    """llama.cpp's logits [len(ids), vocab] (float32) for every position of `ids` in one batch."""
    from llama_cpp import Llama

    llm = Llama(str(file), n_threads=threads, n_threads_batch=threads, n_ctx=max(256, len(ids) + 8),
                n_batch=max(256, len(ids)), logits_all=True, verbose=False)
    llm.eval(list(ids))
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()  # its threads go now, not when the garbage collector finds it: idle ones slowed the next run
    return out


def logits_difference(ours: torch.Tensor, peer: torch.Tensor) -> dict[str, float]:
    """How far `ours` [n, vocab] is from the peer's logits on the same positions: the mean and largest KL(peer ||
    ours) of the next-token distributions, top-1 agreement and the largest logit difference.

    The first position is left out: its token attends to itself alone, and on Qwen2.5 its hidden state carries the
    massive activations of an attention sink, which llama.cpp quantises to 8 bits before every matmul (KL up to 5.6
    there against ours in exact float32 on the same file, and about 0.002 at every later position). In use that
    position is the chat template's first token, whose prediction is never read."""
    a, b = ours[1:].float(), peer[1:].float()
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (lb.exp() * (lb - la)).sum(-1)
    return {"kl_mean": round(float(kl.mean()), 5), "kl_max": round(float(kl.max()), 5),
            "top1_agreement": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4),
            "max_abs_logit_diff": round(float((a - b).abs().max()), 3), "positions": int(a.shape[0])}
