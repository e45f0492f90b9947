"""Prompt texts (runtime/models/lm/prompt.py): the engine's head/tail split must rebuild the generate
answerer's prompt exactly, with and without a chat template, and a cut context is marked."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from lm_common import PROMPTS
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.config import LMConfig
from runtime.models.lm.generate_answerer import GenerateAnswerer
from runtime.models.lm.prompt import CUT_MARK, EMPTY_CONTEXT, prompt_parts, prompt_text

SYSTEM = LMConfig().system_prompt
CONTEXTS = [c for c, _ in PROMPTS] + ["line one\nline two\n", "  spaced  ", "{braces} and <|im_end|> text"]


@pytest.fixture(scope="module")
def chat(tiny_path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    assert tokenizer.chat_template
    return tokenizer


@pytest.fixture(scope="module")
def base(chat) -> PreTrainedTokenizerBase:
    tokenizer = copy.deepcopy(chat)
    tokenizer.chat_template = None
    return tokenizer


@pytest.mark.parametrize("which", ["chat", "base"])
def test_head_transcript_tail_is_the_whole_prompt(which: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(which)
    for question in ["What was said?", "¿Qué pidió? 🙂", "Count the words."]:
        head, tail = prompt_parts(tokenizer, SYSTEM, question)
        assert head.endswith("Transcript so far:\n") and SYSTEM in head and question not in head
        assert tail.startswith(f"\n\nQuestion: {question}")
        for context in CONTEXTS:
            assert head + (context or EMPTY_CONTEXT) + tail == prompt_text(tokenizer, SYSTEM, context, question)
    assert prompt_parts(tokenizer, SYSTEM, "q")[0] == prompt_parts(tokenizer, SYSTEM, "another")[0]  # head fixed


def test_the_prompt_texts_themselves(chat, base) -> None:
    assert prompt_text(base, "Be brief.", "she said hi", "Who?") == (
        "Be brief.\n\nTranscript so far:\nshe said hi\n\nQuestion: Who?\nAnswer:")
    assert prompt_text(base, "Be brief.", "", "Who?") == (
        f"Be brief.\n\nTranscript so far:\n{EMPTY_CONTEXT}\n\nQuestion: Who?\nAnswer:")
    assert prompt_text(chat, "Be brief.", "she said hi", "Who?") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTranscript so far:\nshe said hi\n\n"
        "Question: Who?<|im_end|>\n<|im_start|>assistant\n")


def test_typed_content_templates_get_typed_parts(chat) -> None:
    """A VLM-style template that reads only typed parts loses plain strings; the split then uses typed parts."""
    tokenizer = copy.deepcopy(chat)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{{ p.text }}{% endfor %}"
                               "</{{ m.role }}>{% endfor %}<assistant>")
    head, tail = prompt_parts(tokenizer, "Sys.", "Why?")
    assert head == "<system>Sys.</system><user>Transcript so far:\n"
    assert tail == "\n\nQuestion: Why?</user><assistant>"


def test_a_cut_context_is_marked_and_keeps_the_latest_words(tiny_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    answerer = GenerateAnswerer(model, tokenizer, LMConfig(max_context_tokens=90), name="tiny")  # type: ignore[arg-type]
    context = " ".join(f"w{i}" for i in range(300))
    ids, kept, cut = answerer.build_prompt(context, "Last word?")
    text = tokenizer.decode(ids)
    head, tail = prompt_parts(tokenizer, answerer.cfg.system_prompt, "Last word?")
    assert cut and 0 < kept < 300 and len(ids) <= 90
    assert text.startswith(head + CUT_MARK) and text.endswith(tail) and "w299" + tail in text
    assert text == prompt_text(tokenizer, answerer.cfg.system_prompt, text[len(head):-len(tail)], "Last word?")
    ids, kept, cut = answerer.build_prompt("w1 w2", "Last word?")
    assert not cut and CUT_MARK not in tokenizer.decode(ids)
