"""`runtime bench answers` asks each item's questions on one stream (the item's lines prefilled once, as a session
keeps one stream): the answers must be the ones a fresh stream per question gives, and a question asked after
fewer lines than the one before must not see the later lines."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.bench.answers import ask_all, transcript_context
from runtime.config import LMConfig
from runtime.models.lm.engine_answerer import EngineAnswerer

ITEM: dict[str, Any] = {
    "id": "standup", "kind": "meeting",
    "lines": ["Maria opened the standup at nine.", "Tom said the build is green again.",
              "Aisha will ship the release on Friday.", "Kenji asked for two more testers."],
    # not sorted by after_line: the third question needs a stream that has heard only two lines
    "questions": [{"q": "Who opened the standup?", "after_line": 3, "expect": [["maria"]]},
                  {"q": "When is the release?", "after_line": 4, "expect": [["friday"]]},
                  {"q": "What did Tom say?", "after_line": 2, "expect": [["green"]]}],
}


@pytest.fixture(scope="module")
def answerer() -> EngineAnswerer:
    return EngineAnswerer.load(LMConfig(backend="engine", model="tiny:qwen2", max_new_tokens=12, window_tokens=256),
                               device="cpu", dtype="float32")


def fresh_stream_answers(answerer: EngineAnswerer, item: dict[str, Any]) -> list[list[int]]:
    """What the bench did before: a new stream per question, its lines prefilled one by one."""
    out = []
    for q in item["questions"]:
        stream = answerer.open_stream()
        for k in range(1, q["after_line"] + 1):
            stream.set_context(transcript_context(item["lines"][:k]))
            while stream.prefill_step():
                pass
        state = answerer.start(transcript_context(item["lines"][: q["after_line"]]), q["q"], stream=stream)
        while not state.step().done:
            pass
        out.append(state.text.emitted.strip())
    return out


def test_one_stream_per_item_answers_as_a_fresh_stream_per_question(answerer: EngineAnswerer) -> None:
    lines: list[str] = []
    results = ask_all(answerer, [ITEM], lambda item: item["lines"], lines.append)
    expected = fresh_stream_answers(answerer, ITEM)
    assert [r["answer"] for r in results] == expected
    assert all(expected), expected  # random weights still say something: an empty answer would prove nothing
    assert [r["question"] for r in results] == [q["q"] for q in ITEM["questions"]]
    assert lines == ["answers: standup (3 questions)"]

