"""llama.cpp as the CPU speed peer of `runtime bench llm --model FILE.gguf`: llama-cpp-python on the same GGUF file
at the same thread counts. Optional (`pip install -e .[llamacpp]` builds it from source, about 10 minutes on 2
cores; pip's wheel cache keeps the build): when it is missing the row says so and the bench goes on."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

INSTALL = "pip install -e '.[llamacpp]'  (builds llama.cpp from source: about 10 minutes on 2 cores)"


def llama_cpp_rows(file: Path, prompt: Sequence[int], n: int, threads: Sequence[int],
                   status: Callable[[str], None]) -> dict[str, Any]:
    """Greedy decode tokens/s (n tokens after the prompt, llama.cpp's own top-1 sampler) and prefill tokens/s
    (512 tokens in one batch) per thread count; the same prompt ids as the engine's rows."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"skipped": f"llama-cpp-python is not installed: {INSTALL}"}
    import llama_cpp

    out: dict[str, Any] = {"version": llama_cpp.__version__}
    try:
        _measure(Llama, file, prompt, n, threads, status, out)
    except Exception as err:  # any failure of the peer is its row, never the bench's end
        return {**out, "skipped": f"llama.cpp failed on {file.name}: {type(err).__name__}: {err}"}
    return out


def _measure(Llama: type, file: Path, prompt: Sequence[int], n: int, threads: Sequence[int],  # noqa: N803
             status: Callable[[str], None], out: dict[str, Any]) -> None:
    for t in threads:
        status(f"llama.cpp: decode and prefill at {t} thread(s)")
        llm = Llama(str(file), n_threads=t, n_threads_batch=t, n_ctx=2048, n_batch=512, verbose=False)
        best = 0.0
        for _ in range(2):
            llm.reset()
            gen = llm.generate(list(prompt), temp=0.0, top_k=1, reset=True)
            next(gen)  # the prompt's forward and the first token
            start = time.perf_counter()
            for _ in range(n):
                next(gen)
            best = max(best, n / (time.perf_counter() - start))
            gen.close()
        out[f"decode_tok_s_{t}t"] = round(best, 2)
        filler = (list(prompt) * (512 // max(1, len(prompt)) + 1))[:512]
        llm.reset()
        start = time.perf_counter()
        llm.eval(filler)
        out[f"prefill_tok_s_{t}t"] = round(512 / (time.perf_counter() - start), 1)
        del llm
