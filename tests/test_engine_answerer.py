"""The engine as the pipeline's answerer: greedy output token-identical to transformers' generate() for every
drafter (speculative decoding is lossless), several tokens per target forward when drafts are right, the
stream's prefilled transcript reused across questions, and reproducible sampling."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from lm_common import PROMPTS, N, greedy_ids, run_answer
from transformers import PreTrainedModel

from runtime.config import LMConfig
from runtime.models.lm import AnswerStep, load_answerer
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_answerer import EngineAnswerer

DRAFTERS = ["none", "ngram", "recycling", "auto", "draft-model", "dyspec"]


def make(drafter: str, **cfg) -> EngineAnswerer:
    """The draft model is the tiny model itself: drafts are then always right, so acceptance is exercised."""
    lm = LMConfig(backend="engine", max_new_tokens=N, prefill_chunk_tokens=16, drafter=drafter,
                  draft_model="tiny:qwen2" if drafter in ("draft-model", "dyspec") else "", **cfg)
    answerer = load_answerer(lm, device="cpu", dtype="float32")
    assert isinstance(answerer, EngineAnswerer)
    return answerer


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_equals_generate_for_every_drafter(drafter: str, hf: PreTrainedModel) -> None:
    answerer = make(drafter)
    steps_total = tokens_total = accepted = 0
    for context, question in PROMPTS:
        state = answerer.start(context, question)
        steps = run_answer(state)
        expected = greedy_ids(hf, state.prompt_ids)
        assert state.generated == expected
        assert "".join(s.delta for s in steps) == answerer.tokenizer.decode(expected, skip_special_tokens=True)
        assert steps[-1].done and steps[-1].finish_reason == "length"
        assert state.step() == AnswerStep("", True, "length", 0)
        steps_total, tokens_total = steps_total + len(steps), tokens_total + len(expected)
        accepted += state.stats()["accepted"]
    if drafter in ("draft-model", "dyspec"):  # always-right drafts were verified and kept (how many: the adaptive depth
        assert accepted > 0  # follows measured cost, and a same-size draft model costs as much as the target)
    elif drafter == "none":
        assert steps_total == tokens_total


def test_stops_at_eos_and_reuses_the_streams_prefill(hf: PreTrainedModel) -> None:
    answerer = make("auto")
    stream = answerer.open_stream()
    context, question = PROMPTS[1]
    first = answerer.start(context, question, stream=stream)
    run_answer(first)
    answerer.eos_ids = {first.generated[3]}
    state = answerer.start(context, question, stream=stream)
    steps = run_answer(state)
    expected = greedy_ids(hf, state.prompt_ids, eos_token_id=first.generated[3])
    assert expected[-1] == first.generated[3] and state.generated == expected[:-1]
    assert steps[-1].finish_reason == "stop"
    answerer.eos_ids = set(answerer.engine.eos_ids)
    before = stream.session.stats.prefilled
    state = answerer.start(context + " Then they left.", question, stream=stream)
    assert stream.session.stats.prefilled - before < 10  # only the new words were prefilled
    run_answer(state)
    assert state.generated == greedy_ids(hf, state.prompt_ids)


def test_window_cut_is_reported(tiny_path: Path) -> None:
    answerer = make("none", window_tokens=48)
    text = " ".join(f"word{i}" for i in range(400))
    state = answerer.start(text, "Again?")
    assert state.context_cut and state.context_tokens == 48
    state.release()
    state.release()  # idempotent: the pipeline releases in `finally`


def test_sampling_is_reproducible_without_a_drafter() -> None:
    """Same seed -> same answer. With a drafter, which random numbers are drawn depends on the drafts, and the
    draft depth adapts to measured time, so only the distribution is fixed (test_speculative checks it)."""
    answerer = make("none", temperature=0.8, top_p=0.9)
    outs = []
    for _ in range(2):
        state = answerer.start("hello there", "Say something.", seed=3, stream=answerer.open_stream())
        run_answer(state)
        outs.append(state.generated)
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_engine_loads_only_when_asked() -> None:
    engine = LMEngine.load(LMConfig(max_new_tokens=N), device="cpu", dtype="float32")
    answerer = EngineAnswerer(engine)
    assert answerer.draft_engine is None and replace(answerer.cfg).drafter == "auto"


@pytest.mark.parametrize("drafter", ["ngram", "swift"])
def test_an_answerer_sharing_loaded_weights_decodes_as_one_loaded_for_it(drafter: str, hf: PreTrainedModel) -> None:
    """`EngineAnswerer.sharing` (the benchmarks' rows): another drafter over the weights one engine loaded gives
    generate()'s tokens, reads the very same weights, and refuses another weight format."""
    base = make("none")
    shared = EngineAnswerer.sharing(base.engine, replace(base.cfg, drafter=drafter))
    assert shared.engine.model is base.engine.model and shared.cfg.drafter == drafter
    for context, question in PROMPTS:
        state = shared.start(context, question)
        run_answer(state)
        assert state.generated == greedy_ids(hf, state.prompt_ids)
    with pytest.raises(ValueError, match="cannot run"):
        EngineAnswerer.sharing(base.engine, replace(base.cfg, weights="int8"))


def test_a_new_streams_first_answer_is_priced_with_what_earlier_streams_measured() -> None:
    """Step costs belong to the answerer (the machine, the model, the drafter), not to one conversation: a stream
    opened after another answered prices its first step with that answer's measurements, so its first drafted step
    is not the full-depth tree an unpriced controller picks (a new conversation's first answer drafted nine-node trees
    at three times a plain step's cost on an AVX2-only path)."""
    answerer = make("ngram")
    first, second = answerer.open_stream(), answerer.open_stream()
    assert first.costs is second.costs is answerer.costs
    context, question = PROMPTS[0]
    run_answer(answerer.start(context, question, stream=first))
    assert answerer.costs.verify  # the first answer's steps were timed
    # as the 1.5B measured them at one thread: a nine-node tree 2.3 times a plain step (the per-size prices, and the
    # line fitted to every size's times, which prices once the first answer measured two sizes)
    answerer.costs.verify.update({1: 0.060, 3: 0.068, 9: 0.140})
    for _ in range(20):
        for rows, seconds in ((1, 0.060), (3, 0.068), (9, 0.140)):
            answerer.costs.line.add(rows, seconds)
    answerer.costs.nodes.update({2: 2.0, 8: 8.0})
    state = answerer.start(context, question, stream=second)
    assert 1 <= state.decoder.controller.choose(8) < 8
    unpriced = make("ngram").start(context, question)  # nothing measured: every depth looks free
    assert unpriced.decoder.controller.choose(8) == 8
