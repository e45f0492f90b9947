"""The generate answerer: a one-token-per-call loop that must match `generate()` exactly when greedy."""

from __future__ import annotations

from dataclasses import replace

import pytest
from lm_common import PROMPTS, N, greedy_ids, run_answer

from runtime.config import LMConfig
from runtime.errors import ConfigError, UserError
from runtime.models.lm import AnswerStep, GenerateAnswerer, load_answerer


@pytest.fixture(scope="module")
def answerer() -> GenerateAnswerer:
    return load_answerer(LMConfig(max_new_tokens=N), device="cpu", dtype="float32")


def with_cfg(answerer: GenerateAnswerer, **changes) -> GenerateAnswerer:
    cfg = replace(answerer.cfg, **changes)
    return GenerateAnswerer(answerer.model, answerer.tokenizer, cfg, name=answerer.name, seed=answerer.seed)


def test_load_reports_progress() -> None:
    lines: list[str] = []
    load_answerer(LMConfig(), device="cpu", dtype="float32", progress=lines.append)
    assert lines[0] == "loading lm tiny:qwen2 on cpu/float32 ..."
    assert lines[-1].startswith("lm loaded in ")
    with pytest.raises(ConfigError, match="unknown lm.backend 'spec'"):
        load_answerer(LMConfig(backend="spec"), device="cpu", dtype="float32")


def test_prompt_uses_the_chat_template(answerer: GenerateAnswerer) -> None:
    state = answerer.start("she said hello", "What did she say?")
    prompt = answerer.tokenizer.decode(state.prompt_ids)
    assert prompt.startswith(f"<|im_start|>system\n{answerer.cfg.system_prompt}<|im_end|>\n<|im_start|>user\n")
    assert "she said hello" in prompt and "What did she say?" in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert not state.context_cut
    state.release()


def test_greedy_steps_equal_generate(answerer: GenerateAnswerer) -> None:
    held_back = 0
    for context, question in PROMPTS:
        state = answerer.start(context, question)
        steps = run_answer(state)
        expected = greedy_ids(answerer.model, state.prompt_ids, pad_token_id=answerer.tokenizer.pad_token_id)
        assert state.generated == expected
        text = "".join(s.delta for s in steps)
        assert text == answerer.tokenizer.decode(expected, skip_special_tokens=True)
        assert steps[-1] == AnswerStep(steps[-1].delta, True, "length") and len(steps) == N
        assert not any(s.done for s in steps[:-1])
        emitted = ""
        for step in steps[:-1]:
            emitted += step.delta
            assert not emitted.endswith("\ufffd")  # incomplete characters are held back
        held_back += sum(not s.delta for s in steps)
        assert state.step() == AnswerStep("", True, "length", 0)  # after done: nothing more
        assert state.cache is None  # released when done
    assert held_back > 0, "no step ever held back an incomplete character: the UTF-8 path went untested"


def test_eos_stops_with_reason_stop(answerer: GenerateAnswerer) -> None:
    context, question = PROMPTS[1]
    greedy = answerer.start(context, question)
    run_answer(greedy)
    stopper = with_cfg(answerer)
    eos = greedy.generated[3]
    stopper.eos_ids = {eos}
    state = stopper.start(context, question)
    steps = run_answer(state)
    expected = greedy_ids(answerer.model, state.prompt_ids, pad_token_id=answerer.tokenizer.pad_token_id,
                          eos_token_id=eos)
    assert expected[-1] == eos and state.generated == expected[:-1]
    assert steps[-1].finish_reason == "stop" and len(steps) == len(expected)
    assert "".join(s.delta for s in steps) == answerer.tokenizer.decode(expected[:-1], skip_special_tokens=True)


def test_context_is_cut_from_the_front_to_fit(answerer: GenerateAnswerer) -> None:
    context = " ".join(f"sentence number {i} is here." for i in range(200))
    question = "Which sentence came last?"
    for budget in range(95, 160, 7):
        small = with_cfg(answerer, max_context_tokens=budget)
        state = small.start(context, question)
        assert budget - 4 <= len(state.prompt_ids) <= budget and state.context_cut  # fits, not over-cut
        prompt = small.tokenizer.decode(state.prompt_ids)
        assert "sentence number 199 is here." in prompt and "number 0 " not in prompt
        assert question in prompt and "... " in prompt
        assert len(run_answer(state)) == N  # the cut prompt decodes normally
    full = with_cfg(answerer, max_context_tokens=4096).start(context, question)
    assert not full.context_cut and "number 0 is here" in answerer.tokenizer.decode(full.prompt_ids)
    with pytest.raises(UserError, match="max_context_tokens=30"):
        with_cfg(answerer, max_context_tokens=30).start(context, question * 5)


def test_sampling_is_reproducible_per_seed(answerer: GenerateAnswerer) -> None:
    sampler = with_cfg(answerer, temperature=0.9, top_p=0.95)
    context, question = PROMPTS[1]

    def sample(**kwargs) -> list[int]:
        state = sampler.start(context, question, **kwargs)
        run_answer(state)
        return state.generated

    first = sample()
    assert sample() == first  # the answer's generator is seeded the same way each time
    assert sample(seed=1) != first
    greedy = answerer.start(context, question)
    run_answer(greedy)
    assert first != greedy.generated
    # top_p that keeps only the most likely token is greedy
    nucleus = with_cfg(answerer, temperature=1.0, top_p=1e-6)
    state = nucleus.start(context, question, seed=5)
    run_answer(state)
    assert state.generated == greedy.generated


def test_release_mid_answer_stops_it(answerer: GenerateAnswerer) -> None:
    state = answerer.start(*PROMPTS[1])
    state.step()
    state.release()
    assert state.cache is None and state.done
    assert state.step() == AnswerStep("", True, None, 0)
    assert len(state.generated) == 1
