"""The memory a big model's sessions take: `runtime bench llm --model REF`'s `memory` rows (`llm_big.py`).

Why a process of its own: RSS is the whole process's, and the bench's process holds every format's model and whatever
the rows before left in the allocator. Each row is a fresh child (`python -m runtime.bench.llm_memory`; the two run
at once, since a process's RSS is its own whatever runs beside it) that loads the model as the runtime serves it
(from the packed cache, as every load after the first does), then opens sessions one by one, each answering a
question about the same `tokens`-token transcript, and reports its RSS (VmRSS, read after `malloc_trim`: pages the
allocator holds free are not the model's) after the load and after each session, and its peak (VmHWM). So
`session_rss_mb` is what a process serving one conversation with this model holds, and `per_extra_session_mb` what
each further session adds: its KV cache and buffers, where a second copy of the weights would add their whole size
(the sessions of one engine share one). The peer row does the same with llama.cpp on the same GGUF (llama-cpp-python,
its bench context of 2,048 tokens), for one session: the binding's `Llama` is a model with one context, so a second
would load the model again.
"""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
from typing import Any

from runtime.bench.llm_model import QUESTION, Status, transcript_tokens
from runtime.bench.timing import at_most

SESSIONS = 2
TARGET_SESSION_GB = 2.0  # issue 51: a session with the 1.5B
TARGET_EXTRA_MB = 400.0  # a session's KV cache (3 x 41 MB for the 1.5B's 3,044 slots) and buffers, not a weights copy


def _rss() -> dict[str, float]:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the reading includes the allocator's free pages
        pass
    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}
    return {"rss_mb": round(kb["VmRSS"] / 1024, 1), "peak_mb": round(kb["VmHWM"] / 1024, 1)}


def _engine(ref: str, fmt: str, tokens: int) -> dict[str, Any]:
    import torch

    from runtime.config import LMConfig
    from runtime.models.lm.engine_answerer import EngineAnswerer

    torch.set_num_threads(2)
    base = _rss()
    cfg = LMConfig(backend="engine", model=ref, weights=fmt, max_new_tokens=16)
    answerer = EngineAnswerer.load(cfg, device="cpu", dtype="float32")
    loaded = _rss()
    transcript = answerer.tokenizer.decode(transcript_tokens(answerer.engine.encode, tokens))
    after, keep = [], []  # the answers stay referenced: each session's cache is counted while the next one runs
    for _ in range(SESSIONS):
        answer = answerer.start(transcript, QUESTION, stream=answerer.open_stream())
        while not answer.step().done:
            pass
        keep.append(answer)
        after.append(_rss())
    return {"kv_cache_mb_per_session": round(answerer.engine.cache_bytes() / 2**20, 1),
            **_rows(base, loaded, after)}


def _llama(ref: str, tokens: int) -> dict[str, Any]:
    from runtime.bench.llm_peers import open_llama
    from runtime.models.lm.gguf_checkpoint import gguf_file
    from runtime.models.loading import resolve_checkpoint

    file = gguf_file(resolve_checkpoint(ref, role="lm"))
    if file is None:
        raise SystemExit(f"{ref} is not a GGUF file")
    base = _rss()
    first = open_llama(file, 2)
    loaded = _rss()
    first.eval(transcript_tokens(lambda text: first.tokenize(text.encode(), add_bos=False), tokens))
    # one session: the binding's `Llama` is a model and one context, so a second one would load the model again
    return _rows(base, loaded, [_rss()])


def _rows(base: dict[str, float], loaded: dict[str, float], after: list[dict[str, float]]) -> dict[str, Any]:
    extra = (after[-1]["rss_mb"] - after[0]["rss_mb"]) / (len(after) - 1) if len(after) > 1 else None
    return {"rss_mb_before_load": base["rss_mb"], "rss_mb_loaded": loaded["rss_mb"],
            "rss_mb_after_sessions": [a["rss_mb"] for a in after], "peak_mb": after[-1]["peak_mb"],
            "session_rss_mb": after[0]["rss_mb"], "per_extra_session_mb": None if extra is None else round(extra, 1)}


def measure(ref: str, fmt: str, tokens: int, status: Status, peer: bool) -> dict[str, Any]:
    """The memory rows of `ref` in format `fmt` (and llama.cpp's on the same file when `peer`), each in a child."""
    out: dict[str, Any] = {"sessions": SESSIONS, "transcript_tokens": tokens,
                           "definition": "VmRSS after malloc_trim, in a fresh process per row; session_rss_mb: with "
                                         "one session that has answered; per_extra_session_mb: each further one"}
    names = ("runtime", "llama_cpp") if peer else ("runtime",)
    status(f"memory: {' and '.join(names)} over a {tokens}-token transcript, each in a fresh process, at once (RSS "
           "is each process's own)")
    children = {name: subprocess.Popen([sys.executable, "-m", "runtime.bench.llm_memory", name, ref, fmt, str(tokens)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names}
    for name, child in children.items():
        stdout, stderr = child.communicate()
        if child.returncode != 0:
            tail = stderr.strip().splitlines()[-1:] or ["no output"]
            out[name] = {"skipped": f"the child failed: {tail[0]}"}
        else:
            out[name] = json.loads(stdout.strip().splitlines()[-1])
    ours = out["runtime"]
    out["targets"] = {
        "session_rss_gb": at_most(None if "skipped" in ours else round(ours["session_rss_mb"] / 1024, 2),
                                  TARGET_SESSION_GB),
        "per_extra_session_mb": at_most(ours.get("per_extra_session_mb"), TARGET_EXTRA_MB),
    }
    return out


if __name__ == "__main__":
    kind, model, weights, n = sys.argv[1:5]
    print(json.dumps(_engine(model, weights, int(n)) if kind == "runtime" else _llama(model, int(n))))
