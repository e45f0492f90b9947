"""The forced-AVX2 rows of `runtime bench llm --model ...`: a child process (`python -m runtime.bench.llm_avx2 REF
FORMAT quick|full`, started by `llm_big.avx2_child` with `llm_big.AVX2_ENV`) that runs the paired decode and prefill
trials against llama.cpp again on the kernels' AVX2 path, and prints them as one line of JSON.

Why a child: torch chooses its own kernels (`ATEN_CPU_CAPABILITY`) and oneDNN its instruction set once, at start-up,
so only a fresh process runs what an AVX2-only CPU runs. Its peer is llama.cpp's AVX2-only build where `make
peers-avx2` has built it (the parent puts it first on the child's path), else this CPU's own build; which one it
raced is in its output, as ggml itself reports it (`llm_peers.llama_cpp_build`)."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from runtime.bench.llm_big import (
    AVX2_ENV,
    FULL,
    QUICK,
    Plan,
    decode_context,
    lm_compile,
    paired_prefill,
    transcript_ids,
)
from runtime.bench.llm_model import QUESTION, paired_vs_llama_cpp
from runtime.bench.llm_peers import AVX2_INSTALL, llama_cpp_build
from runtime.config import LMConfig
from runtime.models.lm import cpu_kernels
from runtime.models.lm.engine_answerer import EngineAnswerer
from runtime.models.lm.gguf_checkpoint import gguf_file
from runtime.models.loading import resolve_checkpoint


def forced_rows(ref: str, fmt: str, plan: Plan) -> dict[str, Any]:
    """The paired decode and prefill rows of format `fmt` (`plan.avx2_trials` each) in this process, as it runs."""

    def progress(line: str) -> None:  # to the parent, which shows it as its own status
        print(line, file=sys.stderr, flush=True)

    file = gguf_file(resolve_checkpoint(ref, role="lm"))
    assert file is not None
    n, trials, context = plan.decode_tokens, plan.avx2_trials, decode_context(plan)
    cfg = LMConfig(backend="engine", model=ref, weights=fmt, kernels="runtime", drafter="none",
                   max_new_tokens=n + 8, compile=lm_compile(plan, True))
    answerer = EngineAnswerer.load(cfg, device="cpu", dtype="float32", progress=progress)
    prompt = list(answerer.start(context, QUESTION, stream=answerer.open_stream()).prompt_ids)
    ids = transcript_ids(answerer.engine, plan.prefill_tokens)
    peer = llama_cpp_build()
    if peer["avx512"]:
        peer["note"] = f"this CPU's own build, with AVX-512, not the one an AVX2-only CPU runs: {AVX2_INSTALL}"
    return {"kernels": f"runtime {cpu_kernels.isa()}", "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "env": AVX2_ENV, "llama_cpp": peer,
            "paired_decode": paired_vs_llama_cpp(ref, fmt, file, prompt, n, trials, progress, answerer=answerer,
                                                 context=context),
            "paired_prefill": paired_prefill(answerer.engine, file, ids, plan.avx2_prefill_trials, progress)}


if __name__ == "__main__":
    ref, fmt, size = sys.argv[1:4]
    print(json.dumps(forced_rows(ref, fmt, QUICK if size == "quick" else FULL)))
