"""`runtime bench grammar [--model REF]`: the grammar libraries for constrained decoding, side by side.

Function calling on the local engine decodes a call's arguments under the function's JSON schema
(`runtime/models/lm/json_constraint.py`). Which library computes the per-token mask was chosen by this bench:
xgrammar and llguidance, on the real tokenizer (default: SmolLM2's 49,152 tokens), with realistic function
schemas, walking each schema's canonical arguments token by token as decoding would. Per library:
- the one-off cost of reading the tokenizer (once per process);
- compiling each schema, cold (no cache: a session's tools change);
- filling the next-token bitmask at each position (the cost on every decoded token), mean and worst;
- consuming a token and rolling one back (speculative decoding walks and un-walks draft trees).
A library that is not installed is a row saying so, with the command that installs it. Applying a bitmask to
the logits is the runtime's own, the same for both, and measured once. No target is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from runtime.bench.timing import machine
from runtime.models.lm.json_constraint import INSTALL, allowed_tokens, apply_bitmask
from runtime.models.lm.tokenizer import load_tokenizer
from runtime.models.loading import configure_threads, resolve_checkpoint

Status = Callable[[str], None]
REPEATS = 20
# realistic tool schemas, each with the arguments a call would carry (walked token by token)
SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "the city's name"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False,
        "examples": [{"city": "Paris", "unit": "celsius"}],
    },
    "create_event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 80},
            "start": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
            "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
            "location": {"type": "object", "properties": {"room": {"type": "string"},
                                                          "online": {"type": "boolean"}},
                         "required": ["online"], "additionalProperties": False},
            "reminders": {"type": "array", "items": {
                "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 0},
                                                 "method": {"enum": ["email", "popup"]}},
                "required": ["minutes", "method"], "additionalProperties": False}},
        },
        "required": ["title", "start", "duration_minutes", "attendees"], "additionalProperties": False,
        "examples": [{"title": "Budget review with the launch team", "start": "2026-05-17T09:30",
                      "duration_minutes": 45, "attendees": ["Dana", "Sam Porter", "priya@example.com"],
                      "location": {"room": "Lisbon 2", "online": True},
                      "reminders": [{"minutes": 10, "method": "popup"}, {"minutes": 1440, "method": "email"}]}],
    },
    "search_products": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "max_price": {"type": "number", "minimum": 0},
                       "in_stock": {"type": "boolean"}, "sort": {"enum": ["price", "rating", "newest"]},
                       "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["query"], "additionalProperties": False,
        "examples": [{"query": "noise cancelling headphones", "max_price": 199.99, "in_stock": True,
                      "sort": "rating", "tags": ["wireless", "over-ear"]}],
    },
}


def schema_of(name: str) -> dict[str, Any]:
    """A bench schema without its example (what a tool's `parameters` would be)."""
    return {k: v for k, v in SCHEMAS[name].items() if k != "examples"}


def _row(walk: Callable[[], dict[str, float]], repeats: int) -> dict[str, float]:
    """Each timing's median over `repeats` walks (the machine is shared: medians, not means)."""
    runs = [walk() for _ in range(repeats)]
    return {key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]}


def _walk_stats(fill_us: list[float], consume_us: list[float], rollback_us: float) -> dict[str, float]:
    return {"mask_us_mean": sum(fill_us) / len(fill_us), "mask_us_max": max(fill_us),
            "mask_us_first": fill_us[0], "consume_us_mean": sum(consume_us) / len(consume_us),
            "rollback_us": rollback_us}


def xgrammar_rows(tokenizer: PreTrainedTokenizerBase, vocab: int, stop: list[int], cases: dict[str, list[int]],
                  repeats: int) -> dict[str, Any]:
    try:
        import xgrammar as xgr
    except ImportError:
        return {"error": "not installed (pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2; "
                         "without --no-deps it pulls triton, 286 MB)"}
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
    out: dict[str, Any] = {"tokenizer_s": round(time.perf_counter() - t, 3), "schemas": {}}
    mask = xgr.allocate_token_bitmask(1, vocab)
    for name, ids in cases.items():
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(schema_of(name), any_whitespace=False, separators=(",", ":"))
        compile_ms = (time.perf_counter() - t) * 1e3

        def walk(compiled: xgr.CompiledGrammar = compiled, ids: list[int] = ids, name: str = name) -> dict[str, float]:
            matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
            return _timed_walk(ids, lambda: matcher.fill_next_token_bitmask(mask), matcher.accept_token,
                               lambda: matcher.rollback(1), f"xgrammar on {name}")

        out["schemas"][name] = {"compile_ms": round(compile_ms, 2), **_row(walk, repeats)}
    return out


def _timed_walk(ids: list[int], fill_mask: Callable[[], object], accept: Callable[[int], bool],
                rollback: Callable[[], object], what: str) -> dict[str, float]:
    """One pass over a schema's tokens as decoding makes it: the mask before each token, then its acceptance
    (microseconds each), and one rollback at the end."""
    fill, consume = [], []
    for token in ids:
        a = time.perf_counter()
        fill_mask()
        b = time.perf_counter()
        if not accept(token):
            raise RuntimeError(f"{what}: token {token} rejected")
        fill.append((b - a) * 1e6)
        consume.append((time.perf_counter() - b) * 1e6)
    a = time.perf_counter()
    rollback()
    return _walk_stats(fill, consume, (time.perf_counter() - a) * 1e6)


def llguidance_rows(tokenizer: PreTrainedTokenizerBase, vocab: int, stop: list[int], cases: dict[str, list[int]],
                    repeats: int) -> dict[str, Any]:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        return {"error": f"not installed ({INSTALL})"}
    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=stop)
    out: dict[str, Any] = {"tokenizer_s": round(time.perf_counter() - t, 3), "schemas": {}}
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    for name, ids in cases.items():
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_of(name),
                                                                defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_ms = (time.perf_counter() - t) * 1e3
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")

        def walk(grammar: str = grammar, ids: list[int] = ids, name: str = name) -> dict[str, float]:
            m = llguidance.LLMatcher(lltok, grammar)
            return _timed_walk(ids, lambda: llguidance.torch.fill_next_token_bitmask(m, mask), m.consume_token,
                               lambda: m.rollback(1), f"llguidance on {name}")

        out["schemas"][name] = {"compile_ms": round(compile_ms, 2), **_row(walk, repeats)}
    return out


def apply_cost_us(vocab: int) -> dict[str, float]:
    """The runtime's own bitmask application to one row of float32 logits (a string's mask: most tokens
    allowed; an enum's: a few)."""
    logits = torch.randn(vocab)
    out = {}
    for kind, allowed in (("few_allowed", np.arange(0, vocab, 4096)), ("most_allowed", np.arange(vocab)[100:])):
        bits = np.zeros((vocab + 31) // 32 * 32, dtype=bool)
        bits[allowed] = True
        mask = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())
        assert allowed_tokens(mask, vocab).tolist() == allowed.tolist()
        times, buffer = [], torch.empty(vocab)
        for _ in range(200):
            t = time.perf_counter()
            apply_bitmask(logits, mask, buffer)
            times.append((time.perf_counter() - t) * 1e6)
        out[kind] = round(statistics.median(times), 2)
    return out


DECODE_COMPILE = "auto"  # the decode rows' lm.compile: as sessions run the engine (the tests set "off": 30 s less)
CALLS = (("get_weather", "What's the weather in Paris in celsius?"),
         ("create_event", "Book a 45 minute budget review with Dana and Sam on May 17th 2026 at 9:30, online."))


def decode_rows(ref: str, status: Status, tries: int = 3) -> dict[str, Any]:
    """Calls decoded by the engine (int4) under each schema, plainly and speculatively (`auto`), best of `tries`:
    tokens/s, tokens per target forward, whether both said the same, and the share of the decode time spent in
    the grammar (masks, consumes, draft checks). The model is loaded once; the drafters share its weights."""
    from runtime.config import LMConfig
    from runtime.models.lm.engine_answerer import EngineAnswerer

    out: dict[str, Any] = {}
    cfg = LMConfig(backend="engine", model=ref, weights="int4", drafter="none", max_new_tokens=160,
                   compile=DECODE_COMPILE)
    loaded = EngineAnswerer.load(cfg, device="cpu", dtype="float32", progress=status)
    for drafter in ("none", "auto"):
        status(f"grammar: decoding calls with the engine, drafter {drafter}")
        answerer = EngineAnswerer.sharing(loaded.engine, replace(cfg, drafter=drafter))
        for call, question in CALLS:
            best: dict[str, Any] | None = None
            for _ in range(tries):  # best of `tries`: the machine is shared
                state = answerer.start("", question, schema=schema_of(call), stream=answerer.open_stream())
                t = time.perf_counter()
                text, reason = "", None
                while reason is None:
                    step = state.step()
                    text, reason = text + step.delta, step.finish_reason
                wall = time.perf_counter() - t
                stats = state.stats()
                row = {"tokens": len(state.generated), "tok_s": round(len(state.generated) / wall, 1),
                       "grammar_share": round(state.decoder.constraint.spent_s / wall, 4), "finish": reason,
                       "tokens_per_forward": round(stats["accepted_per_step"], 2), "text": text}
                best = row if best is None or row["tok_s"] > best["tok_s"] else best
            out.setdefault(call, {})[drafter] = best
    for call in out:
        out[call]["identical"] = out[call]["none"]["text"] == out[call]["auto"]["text"]
    return out


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    ref = args.model or "builtin:smollm2-135m-instruct"
    threads = configure_threads(args.threads)
    status(f"grammar: reading the tokenizer of {ref}")
    tokenizer, eos = load_tokenizer(resolve_checkpoint(ref, role="lm"))
    vocab = len(tokenizer)
    stop = sorted(eos) if eos else [tokenizer.eos_token_id]
    cases = {name: tokenizer(json.dumps(SCHEMAS[name]["examples"][0], separators=(",", ":")),
                             add_special_tokens=False)["input_ids"] for name in SCHEMAS}
    repeats = 3 if args.quick else REPEATS
    out: dict[str, Any] = {"bench": "grammar", "quick": bool(args.quick), "model": ref, "vocab": vocab,
                           "machine": machine("cpu", None, threads),
                           "tokens": {name: len(ids) for name, ids in cases.items()}, "repeats": repeats}
    status("grammar: xgrammar")
    out["xgrammar"] = xgrammar_rows(tokenizer, vocab, stop, cases, repeats)
    status("grammar: llguidance")
    out["llguidance"] = llguidance_rows(tokenizer, vocab, stop, cases, repeats)
    out["apply_us"] = apply_cost_us(vocab)
    if out["llguidance"].get("error") is None:  # --quick: each call decoded once per drafter, not best of three
        out["decode"] = decode_rows(ref, status, tries=1 if args.quick else 3)
    return out
