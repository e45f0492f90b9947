"""`runtime bench llm --model REF`: a real language model (e.g. builtin:smollm2-135m-instruct) on this machine.

Everything side by side in one run, because this machine is shared and noisy:
- per weight format (`lm.weights`: fp32, bf16, int8, int4, each decoding plainly as `lm.compile = auto` has it:
  int8 and int4 through the compiled step; and `int4-eager` beside them): greedy decode and prefill tokens/s of
  the engine at 1 and 2 threads, the weight bytes one decode step reads and the bound they set at the measured
  copy bandwidth, and quality against fp32 (perplexity on a fixed text; top-1 agreement with fp32's greedy
  continuation);
- the peers: transformers `generate` (the same file, fp32) and llama.cpp (llama-cpp-python, the same GGUF, the
  same thread count), each a row with the reason when it cannot run;
- the best format against llama.cpp in turns (`paired_vs_llama_cpp`): the target reads these ratios;
- time to first token after 4k streamed tokens against prefilling them at question time (the best format);
- the speculative-decoding table (`llm_spec.py`).
Targets are reported with `met`, never asserted.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.bench.llm_peers import decode_once, llama_cpp_rows, open_llama
from runtime.bench.llm_spec import spec_table, spec_tokens
from runtime.bench.timing import machine
from runtime.config import LMConfig
from runtime.errors import UserError
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_answerer import EngineAnswerer
from runtime.models.lm.engine_session import EngineSession
from runtime.models.lm.generate_answerer import transformers_model
from runtime.models.lm.gguf_checkpoint import gguf_file
from runtime.models.lm.kernel_linears import kernel_path
from runtime.models.lm.transformer import Transformer
from runtime.models.loading import resolve_checkpoint

Status = Callable[[str], None]
FORMATS = ("fp32", "bf16", "int8", "int4")
# the rows: each format as `lm.compile = auto` runs it plainly (int8/int4 compiled), and int4 eager beside it.
# --quick compiles int4 alone (the format the profiles serve): a compile costs about 30 s from inductor's cache (SmolLM2
# on 2 cores; 14 s on a quieter day) and about a minute without, once per format and thread count, which is most of
# a quick run; its int8 row is eager then. transformers' GGUF conversion is kept in the cache after the first run
# (generate_answerer.transformers_model: 31 s of a quick run before, 5 s after).
ROWS = {"fp32": ("fp32", "auto"), "bf16": ("bf16", "auto"), "int8": ("int8", "auto"), "int4": ("int4", "auto"),
        "int4-eager": ("int4", "off")}
THREADS = (1, 2)
CONTEXT = ("[00:02] Dana: Thanks for joining. The product launch moves from May 3rd to May 17th.\n"
           "[00:09] Sam: Then the press kit must be final by May 10th, and the budget stays at 42,000 euros.\n"
           "[00:18] Dana: Priya will book the venue in Lisbon; Tom handles the demo videos.\n")
QUESTION = "Write a detailed plan for the launch, step by step."
PPL_TEXT = ("The committee met on Tuesday to review the plans for the new library. After a long discussion about the "
            "budget, they agreed to build the reading room first and to open it to the public in the spring. The "
            "architect explained that the windows would face south, so the room would be bright in the morning. "
            "Several members asked about the cost of heating, and the treasurer promised a detailed estimate by the "
            "next meeting. Finally, the chair thanked everyone and closed the session at half past eight.")


def copy_bandwidth_gb_s() -> float:
    """Best of five copies of a 256 MiB buffer (read + write bytes per second)."""
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def transcript_tokens(encode: Callable[[str], list[int]], tokens: int) -> list[int]:
    """About `tokens` ids of a meeting transcript under a tokenizer's `encode` (the engine's, or llama.cpp's own in a
    process without the engine): the long prefill both engines are timed on."""
    lines = [f"[{i // 60:02d}:{i % 60:02d}] Speaker {i % 3}: item {i} on the agenda costs {i * 7} euros." for i in
             range(4000)]
    text, k = "", 0
    while len(encode(text)) < tokens:
        text += lines[k] + "\n"
        k += 1
    return encode(text)[:tokens]


def step_bytes(model: Transformer) -> int:
    """Bytes one decode step reads: every weight of the projections and the head, norms, one embedding row."""
    total = 0
    for module in [*model.model.layers, model.lm_head, model.model.norm]:
        for t in [*module.parameters(), *module.buffers()]:
            total += t.nbytes
    table = model.model.embed_tokens  # a float table or one packed in the file's blocks: one row's share of it
    return total + sum(t.nbytes for t in [*table.parameters(), *table.buffers()]) // table.num_embeddings


def decode_tok_s(answerer: EngineAnswerer, n: int, context: str = CONTEXT) -> float:
    """Greedy tokens/s of `n` tokens answering QUESTION about `context` (its prompt's prefill not timed)."""
    state = answerer.start(context, QUESTION, stream=answerer.open_stream())
    state.step()
    state.step()
    t = time.perf_counter()
    done = 0
    while done < n and not state.step().done:
        done += 1
    seconds = time.perf_counter() - t
    state.release()
    return done / seconds


def prefill_tok_s(engine: LMEngine, tokens: int) -> float:
    session = engine.open_session()
    text = (CONTEXT * 64)[: tokens * 6]
    session.set_context(text)
    t = time.perf_counter()
    done = 0
    while done < tokens and (k := session.prefill_step()):
        done += k
    return done / (time.perf_counter() - t)


@torch.inference_mode()
def quality(model: Transformer, ref_greedy: list[int], prompt: list[int], ppl_ids: list[int]) -> dict[str, float]:
    """Perplexity of `PPL_TEXT` and top-1 agreement with fp32's greedy continuation (teacher-forced)."""
    ids = torch.tensor(ppl_ids)
    logits = model(ids, torch.arange(len(ids)))
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:])
    seq = torch.tensor(prompt + ref_greedy)
    top1 = model(seq, torch.arange(len(seq))).argmax(-1)[len(prompt) - 1 : -1]
    agree = float((top1 == torch.tensor(ref_greedy)).float().mean())
    return {"perplexity": round(float(nll.exp()), 3), "greedy_agreement": round(agree, 4)}


def _formats(ref: str, args: argparse.Namespace, status: Status,
             n: int) -> tuple[dict[str, Any], list[int], dict[str, EngineAnswerer]]:
    """The rows per weight format, the prompt's ids, and the loaded answerer of each of `FORMATS` (kept for the
    rows after: loading a format again, and compiling its step again per thread count, cost more than the rows)."""
    rows: dict[str, Any] = {}
    kept: dict[str, EngineAnswerer] = {}
    ref_greedy: list[int] = []
    prompt: list[int] = []
    ppl_ids: list[int] = []
    for name, (fmt, compile_mode) in ROWS.items():
        status(f"{name}: loading")
        # the speculative table's answer length (at least n + 8): its plain row then shares this row's cache
        # geometry, so the step compiled here serves it
        if args.quick and name != "int4":  # quick compiles the served format only (see ROWS)
            compile_mode = "off"
        cfg = LMConfig(backend="engine", model=ref, weights=fmt, drafter="none",
                       max_new_tokens=max(n + 8, spec_tokens(args.quick)), compile=compile_mode)
        answerer = EngineAnswerer.load(cfg, device="cpu", dtype="float32", progress=status)
        engine = answerer.engine
        if fmt == "fp32":
            ppl_ids = engine.encode(PPL_TEXT)
            state = answerer.start(CONTEXT, QUESTION, stream=answerer.open_stream())
            prompt = list(state.prompt_ids)
            while not state.step().done:
                pass
            ref_greedy = list(state.generated)
        row: dict[str, Any] = {"weights": fmt, "kernels": kernel_path(cfg.kernels, "cpu") if fmt.startswith("int")
                               else "torch", "compiled_step": engine.compiled is not None,
                               "weight_bytes_per_token": step_bytes(engine.model)}
        for threads in THREADS:
            recompiles = engine.compiled is not None and threads != torch.get_num_threads()  # compiled at load's
            torch.set_num_threads(threads)
            status(f"{name}: decode and prefill at {threads} thread(s)" + (
                " (compiling the step for this thread count first: about a minute)" if recompiles else ""))
            row[f"decode_tok_s_{threads}t"] = round(max(decode_tok_s(answerer, n) for _ in range(2)), 2)
            row[f"prefill_tok_s_{threads}t"] = round(prefill_tok_s(engine, 512), 1)
        torch.set_num_threads(1)
        row.update(quality(engine.model, ref_greedy, prompt, ppl_ids))
        rows[name] = row
        if name in FORMATS:
            kept[name] = answerer
        del answerer, engine
    return rows, prompt, kept


def transformers_rows(path: Path, prompt: list[int], n: int, status: Status) -> dict[str, Any]:
    """transformers `generate` on the same file (its GGUF loader dequantises to fp32), at 1 and 2 threads."""
    status("transformers generate: loading the same file")
    hf = transformers_model(path, torch.float32, keep=True).eval()  # the conversion read back after the first run
    x = torch.tensor([prompt])
    out: dict[str, Any] = {}
    for threads in THREADS:
        torch.set_num_threads(threads)

        def gen(k: int) -> float:
            t = time.perf_counter()
            with torch.inference_mode():
                hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                            do_sample=False, pad_token_id=0)
            return time.perf_counter() - t

        gen(2)
        out[f"decode_tok_s_{threads}t"] = round((n - 1) / max(1e-9, gen(n) - gen(1)), 2)
    torch.set_num_threads(1)
    return out


def paired_vs_llama_cpp(ref: str, fmt: str, file: Path, prompt: list[int], n: int, trials: int,
                        status: Status, answerer: EngineAnswerer | None = None,
                        context: str = CONTEXT) -> dict[str, Any]:
    """The engine in format `fmt` (as `lm.compile = auto` runs it) and llama.cpp decoding the same prompt in
    turns, `trials` times per thread count, each trial's ratio from two back-to-back runs (who goes first
    alternates).

    Why: this machine is shared, and its speed drifts by 10-20 % over minutes (the same engine has measured 96 and
    125 tokens/s at 2 threads an hour apart). The rows above are minutes apart, so their ratio carries that drift;
    a ratio of neighbouring runs does not, and the median over trials drops the trial a burst of other work hit.

    `answerer`: the format's row's own (`_formats`), whose step is already compiled at each thread count; without
    one it is loaded here. `prompt` is the ids of QUESTION about `context` (what the engine's side answers)."""
    if answerer is None:
        cfg = LMConfig(backend="engine", model=ref, weights=fmt, drafter="none", max_new_tokens=n + 8,
                       compile="auto")
        answerer = EngineAnswerer.load(cfg, device="cpu", dtype="float32", progress=status)
    out: dict[str, Any] = {"weights": fmt, "trials": trials, "decode_tokens": n}
    for threads in THREADS:
        torch.set_num_threads(threads)
        status(f"{fmt} and llama.cpp in turns at {threads} thread(s), {trials} trials")
        llm = open_llama(file, threads)
        decode_tok_s(answerer, 4)  # a changed thread count recompiles the step: not inside a trial
        pairs = []
        for trial in range(trials):  # who goes first alternates: neither always runs on the other's heels
            if trial % 2:
                peer = decode_once(llm, prompt, n)
                pairs.append((decode_tok_s(answerer, n, context), peer))
            else:
                pairs.append((decode_tok_s(answerer, n, context), decode_once(llm, prompt, n)))
        out[f"{threads}t"] = {"ours_tok_s": [round(o, 1) for o, _ in pairs],
                              "llama_cpp_tok_s": [round(p, 1) for _, p in pairs],
                              "ratios": [round(o / p, 3) for o, p in pairs],
                              "median_ratio": round(statistics.median(o / p for o, p in pairs), 3)}
        llm.close()  # its threads go now, not when the garbage collector finds it: idle ones slowed the next run
    torch.set_num_threads(1)
    return out


def ttft_after_streaming(ref: str, fmt: str, tokens: int, status: Status,
                         loaded: LMEngine | None = None) -> dict[str, Any]:
    """First token after `tokens` of transcript were streamed in (prefilled as they landed) vs the same engine
    prefilling all of them when the question comes. `loaded`: an engine of that format whose weights are used
    (no second load). No decode step is timed here (prefill and the question's tail only), so none is compiled."""
    cfg = LMConfig(backend="engine", model=ref, weights=fmt, drafter="none", window_tokens=tokens + 512,
                   compile="off")
    engine = LMEngine.load(cfg, device="cpu", dtype="float32") if loaded is None else LMEngine(
        loaded.model, loaded.tokenizer, cfg, name=ref, eos_ids=loaded.eos_ids)
    lines = [f"[{i // 60:02d}:{i % 60:02d}] Speaker {i % 3}: item {i} on the agenda costs {i * 7} euros." for i in
             range(2000)]
    text, k = "", 0
    while len(engine.encode(text)) < tokens:
        text += lines[k] + "\n"
        k += 1
    streamed = engine.open_session()
    status(f"ttft: streaming {tokens} tokens in")
    for i in range(1, 9):
        streamed.set_context(text[: len(text) * i // 8])
        while streamed.prefill_step():
            pass

    def first(session: EngineSession) -> float:
        t = time.perf_counter()
        session.begin_answer("What does item 5 cost?")
        int(session.next_logits().argmax())
        seconds = time.perf_counter() - t
        session.end_answer()
        return seconds

    ours = first(streamed)
    cold = engine.open_session()
    cold.set_context(text)
    status(f"ttft: prefilling all {tokens} tokens at question time")
    naive = first(cold)
    return {"context_tokens": len(engine.encode(text)), "streamed_ms": round(ours * 1000, 1),
            "prefill_at_question_ms": round(naive * 1000, 1), "speedup": round(naive / ours, 1),
            "target": ">= 20", "met": naive / ours >= 20}


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    if args.device != "cpu":
        raise UserError(f"runtime bench llm --model measures CPU weight formats against llama.cpp on the CPU; "
                        f"--device {args.device} is not measured here")
    if args.threads or args.dtype:
        status("note: --threads and --dtype are not used: every row is measured at 1 and 2 threads, and each "
               "weight format sets its own dtype")
    ref = args.model
    n = 16 if args.quick else 96
    path = resolve_checkpoint(ref, role="lm")
    out: dict[str, Any] = {"bench": "llm", "model": ref, "quick": args.quick, "decode_tokens": n}
    status("copy bandwidth")
    bandwidth = copy_bandwidth_gb_s()
    out["copy_bandwidth_gb_s"] = round(bandwidth, 1)
    formats, prompt, answerers = _formats(ref, args, status, n)
    for row in formats.values():
        row["bandwidth_bound_tok_s"] = round(bandwidth * 1e9 / row["weight_bytes_per_token"], 1)
    out["formats"] = formats
    out["transformers_generate"] = transformers_rows(path, prompt, min(n, 32), status)
    file = gguf_file(path)
    out["llama_cpp"] = llama_cpp_rows(file, prompt, n, THREADS, status) if file else {
        "skipped": "llama.cpp reads GGUF files; this checkpoint is not one"}
    best = max(FORMATS, key=lambda f: formats[f]["decode_tok_s_1t"])
    out["best_format"] = best
    paired = None
    if file and "skipped" not in out["llama_cpp"]:
        try:
            paired = out["paired_vs_llama_cpp"] = paired_vs_llama_cpp(ref, best, file, prompt, n,
                                                                      3 if args.quick else 7, status,
                                                                      answerer=answerers[best])
        except Exception as err:  # the peer's failure is its row, never the bench's end
            out["paired_vs_llama_cpp"] = {"skipped": f"llama.cpp failed: {type(err).__name__}: {err}"}
    targets: dict[str, Any] = {}
    for threads in THREADS:
        ours = formats[best][f"decode_tok_s_{threads}t"]
        peer = out["llama_cpp"].get(f"decode_tok_s_{threads}t")
        ratio = paired[f"{threads}t"]["median_ratio"] if paired else None
        targets[f"decode_vs_llama_cpp_{threads}t"] = {
            "ratio": ratio, "measured": "median over paired trials (paired_vs_llama_cpp)",
            "rows_ratio": None if not peer else round(ours / peer, 3), "target": ">= 1.0",
            "met": ratio is not None and ratio >= 1.0}
        hf = out["transformers_generate"][f"decode_tok_s_{threads}t"]
        targets[f"decode_vs_transformers_{threads}t"] = {"ratio": round(ours / hf, 2), "target": ">= 3",
                                                         "met": ours / hf >= 3}
    out["ttft_after_streaming"] = ttft_after_streaming(ref, best, 1024 if args.quick else 4096, status,
                                                       loaded=answerers[best].engine)
    targets["ttft_streamed_vs_prefill"] = {k: out["ttft_after_streaming"][k] for k in ("speedup", "target", "met")}
    out["targets"] = targets
    out["speculative"] = spec_table(ref, best, quick=args.quick, status=status, loaded=answerers[best].engine)
    out["machine"] = machine("cpu", "weights per row; activations float32 (fp32) or bfloat16", 1)
    return out
