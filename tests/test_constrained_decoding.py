"""Constrained decoding (function calling on the local engine, issue 26): with a JSON schema, an answer is exactly
one JSON value valid under it, for every backend and drafter, greedy or sampled; speculative decoding under the
mask is token-identical to plain decoding under the mask; the token budget still ends it ("length"); without a
schema nothing changes. On the real SmolLM2 a named function's call carries the asked-for city."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any

import pytest
import torch
from lm_common import PROMPTS, N, greedy_ids
from transformers import PreTrainedModel

from runtime.config import LMConfig
from runtime.errors import CheckpointNotFound, UserError
from runtime.models.lm import load_answerer
from runtime.models.lm.backend import Answer
from runtime.models.lm.drafters import Draft
from runtime.models.lm.engine_answerer import EngineAnswerer
from runtime.models.lm.generate_answerer import GenerateAnswerer
from runtime.models.lm.sampling import StopRule
from runtime.models.loading import resolve_checkpoint

try:
    import llguidance  # noqa: F401
except ImportError:  # CI installs the tools extra (make install): there a missing library is a failure
    if os.environ.get("CI"):
        raise
    pytest.skip("constrained decoding needs the tools extra: pip install -e '.[tools]'", allow_module_level=True)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 12},
    "minutes": {"type": "integer", "minimum": 5, "maximum": 90},
    "online": {"type": "boolean"},
    "people": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    "remind": {"type": "object", "properties": {"at": {"type": "number"}, "how": {"enum": ["email", "popup"]}},
               "required": ["how"], "additionalProperties": False}},
    "required": ["title", "minutes", "online", "people", "remind"], "additionalProperties": False}
CHOICE = {"enum": ["yes", "no", 42]}
# a random model never closes a free string: the tiny model's strings are bounded, so every value ends in budget
SHORT_WEATHER = {**WEATHER, "properties": {**WEATHER["properties"], "city": {"type": "string", "maxLength": 12}}}
SCHEMAS = {"weather": SHORT_WEATHER, "event": EVENT, "choice": CHOICE}
BUDGET = 96
DRAFTERS = ["none", "ngram", "recycling", "trigram", "auto", "draft-model"]


def valid(value: object, schema: dict[str, Any]) -> bool:
    """The JSON Schema subset these tests use, checked by hand (jsonschema is not a dependency)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(valid(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9)
                and all(valid(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
    if kind in ("integer", "number"):
        ok = isinstance(value, int) if kind == "integer" else isinstance(value, int | float)
        return (ok and not isinstance(value, bool) and schema.get("minimum", -math.inf) <= value
                <= schema.get("maximum", math.inf))  # 1.1E626045 is a valid JSON number: inf to Python
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def run(answer: Answer) -> tuple[str, str | None]:
    steps = [answer.step()]
    while not steps[-1].done:
        steps.append(answer.step())
    return "".join(s.delta for s in steps), steps[-1].finish_reason


def make(backend: str = "engine", drafter: str = "none", **cfg: float) -> EngineAnswerer | GenerateAnswerer:
    lm = LMConfig(backend=backend, max_new_tokens=BUDGET, prefill_chunk_tokens=16, drafter=drafter,
                  draft_model="tiny:qwen2" if drafter == "draft-model" else "", **cfg)
    return load_answerer(lm, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def plain() -> dict[tuple[str, int], tuple[list[int], str, str | None]]:
    """Plain greedy decoding under the mask (the `generate` backend, transformers' model): the reference."""
    answerer = make("generate")
    out = {}
    for name, schema in SCHEMAS.items():
        for p, (context, question) in enumerate(PROMPTS):
            state = answerer.start(context, question, schema=schema)
            text, reason = run(state)
            out[name, p] = (list(state.generated), text, reason)
    return out


def test_plain_masked_output_is_valid_json_and_the_mask_is_what_makes_it(plain) -> None:
    for (name, p), (_, text, reason) in plain.items():
        assert reason == "stop", (name, p, text)
        assert valid(json.loads(text), SCHEMAS[name]), (name, text)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text  # compact: no whitespace
    answerer = make("engine")  # without a schema the tiny random model says no JSON at all
    free, _ = run(answerer.start(*PROMPTS[1]))
    with pytest.raises(ValueError):
        json.loads(free)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_under_the_mask_equals_plain_under_the_mask(drafter: str, plain) -> None:
    answerer = make("engine", drafter)
    accepted = 0
    for (name, p), (ids, text, reason) in plain.items():
        state = answerer.start(*PROMPTS[p], schema=SCHEMAS[name])
        assert run(state) == (text, reason), (drafter, name, p)
        assert state.generated == ids
        accepted += state.stats()["accepted"]
    if drafter == "draft-model":  # the same model drafting: its drafts were walked through the grammar and kept
        assert accepted > 0


def test_rejected_drafts_never_reach_the_target(plain) -> None:
    """A drafter's node the grammar forbids (a raw newline: compact JSON has none, a string escapes it) is dropped
    before the forward; its sibling chain, the reference's own continuation, is accepted through the grammar."""
    answerer = make("engine", "ngram")
    ids, text, _ = plain["event", 1]

    class Oracle:
        def __init__(self) -> None:
            self.bad = answerer.tokenizer.encode("\n")[0]

        def propose(self, context: list[int], pending: int, budget: int) -> Draft:
            right = ids[len(state.generated) : len(state.generated) + budget]  # after `pending`
            return Draft([self.bad, *right], [-1, -1, *range(1, len(right))][: 1 + len(right)])

        def observe(self, *args: object) -> None: ...

        def reset(self) -> None: ...

    stream = answerer.open_stream()
    stream.drafter = Oracle()
    state = answerer.start(*PROMPTS[1], stream=stream, schema=EVENT)
    scored = []
    real = stream.session.score
    stream.session.score = lambda tokens, parents: scored.append(list(tokens)) or real(tokens, parents)
    assert run(state)[0] == text and state.generated == ids
    assert scored and all(stream.drafter.bad not in tokens[1:] for tokens in scored)
    assert state.stats()["accepted"] > 0


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft-model"])
def test_sampled_answers_are_valid_json(drafter: str) -> None:
    answerer = make("engine", drafter, temperature=1.0, top_p=0.95)
    for seed in range(4):
        for schema in SCHEMAS.values():
            text, reason = run(answerer.start(*PROMPTS[seed % len(PROMPTS)], seed=seed, schema=schema))
            if reason == "stop":  # sampling a long string can run out of budget; what came is still a prefix
                assert valid(json.loads(text), schema), (drafter, seed, text)


def test_the_budget_still_ends_the_answer(plain) -> None:
    _, full, _ = plain["event", 2]
    for backend, drafter in (("engine", "auto"), ("generate", "none")):
        answerer = make(backend, drafter)
        state = answerer.start(*PROMPTS[2], schema=EVENT, max_tokens=7)
        text, reason = run(state)
        assert reason == "length" and len(state.generated) == 7 and full.startswith(text) and text != full


def test_a_value_completed_by_the_budgets_last_token_ends_with_stop(plain) -> None:
    ids, text, _ = plain["weather", 0]
    state = make("engine", "auto").start(*PROMPTS[0], schema=SHORT_WEATHER, max_tokens=len(ids))
    assert run(state) == (text, "stop")
    rule = StopRule(frozenset({0}), 2)
    assert rule.take([5, 6, 0], []) == "stop" and rule.take([5, 6, 7], []) == "length"


def test_no_schema_changes_nothing(hf: PreTrainedModel) -> None:
    for drafter in ("none", "auto"):
        answerer = make("engine", drafter)
        for context, question in PROMPTS:
            state = answerer.start(context, question, schema=None, max_tokens=N)
            run(state)
            assert state.generated == greedy_ids(hf, state.prompt_ids)
            assert state.decoder.constraint is None
        assert answerer._grammars is None  # a schema-free process never loads the grammar library


def test_bad_schema_and_missing_library_are_one_line_errors(monkeypatch) -> None:
    answerer = make("engine")
    with pytest.raises(UserError, match="unusable JSON schema"):
        answerer.start("", "Go.", schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    monkeypatch.setitem(sys.modules, "llguidance", None)
    for backend in ("engine", "generate"):
        with pytest.raises(UserError, match=r"needs llguidance: pip install 'llguidance==1\.9\.1'"):
            make(backend).start("", "Go.", schema=SHORT_WEATHER)


# -- the real SmolLM2-135M-Instruct -------------------------------------------------------------------------

REF = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2() -> None:
    try:
        resolve_checkpoint(REF, role="lm")
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))


@pytest.mark.slow
def test_smollm2_calls_get_weather_with_the_city(smollm2) -> None:
    question = "What's the weather in Paris in celsius?"
    outs, loaded = {}, None
    for drafter in ("none", "ngram", "trigram", "auto"):  # plain eager, as the verifiers (test_compiled_step.py)
        cfg = LMConfig(backend="engine", model=REF, weights="int4", drafter=drafter, max_new_tokens=48, compile="off")
        # one load of the model, every drafter's answerer on it
        answerer = (EngineAnswerer.load(cfg, device="cpu", dtype="float32") if loaded is None
                    else EngineAnswerer.sharing(loaded, cfg))
        loaded = answerer.engine
        state = answerer.start("", question, schema=WEATHER)
        outs[drafter] = (run(state), state.generated)
    (text, reason), _ = outs["none"]
    assert reason == "stop" and json.loads(text) == {"city": "Paris", "unit": "celsius"}, text
    assert {d: o == outs["none"] for d, o in outs.items()} == {d: True for d in outs}


def test_mask_application_is_exact() -> None:
    from runtime.models.lm.json_constraint import allowed_tokens, apply_bitmask

    vocab = 70
    allowed = [0, 3, 31, 32, 69]
    bits = torch.zeros(96, dtype=torch.bool)
    bits[allowed] = True
    words = (bits.view(3, 32).long() << torch.arange(32)).sum(1).to(torch.int64)
    mask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words.tolist()], dtype=torch.int32)
    logits = torch.randn(vocab)
    out = apply_bitmask(logits, mask)
    assert allowed_tokens(mask, vocab).tolist() == allowed
    assert torch.equal(out[allowed], logits[allowed]) and torch.isinf(out).sum() == vocab - len(allowed)
    assert not torch.isinf(logits).any()  # the caller's logits are left as they were


def test_grammar_bench_reports_both_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """`runtime bench grammar --quick` on the tiny tokenizer: every schema compiled and walked by llguidance,
    xgrammar measured too or a row saying how to install it, and the engine's decode rows kept (each call decoded
    plainly and speculatively, the same text both ways)."""
    import argparse

    from runtime.bench import grammar

    monkeypatch.setattr(grammar, "DECODE_COMPILE", "off")  # the compiled step is held to the eager one elsewhere
    out = grammar.run(argparse.Namespace(model="tiny:qwen2", quick=True, threads=1), lambda _: None)
    assert set(out["llguidance"]["schemas"]) == set(grammar.SCHEMAS)
    assert set(out["decode"]) == {call for call, _ in grammar.CALLS}
    assert all(row["identical"] and row["none"]["tokens"] > 0 for row in out["decode"].values()), out["decode"]
    assert all(row["mask_us_mean"] > 0 for row in out["llguidance"]["schemas"].values())
    assert "schemas" in out["xgrammar"] or "pip install" in out["xgrammar"]["error"]
