"""`runtime bench video-qa`: the scoring rule, the rendered talk, and one quick run end to end through the real
models (its accuracy is reported, not asserted: the benchmark measures it)."""

from __future__ import annotations

import json

import pytest
from cli_common import run_cli
from weights_common import ON_QWEN_CODER, packaged_or_skip

from runtime.bench import video_qa


def test_scoring() -> None:
    realtime = {"kind": "realtime", "expect": [["4.2"]]}
    assert video_qa.score(realtime, "The budget is 4.2 million euros.")
    assert not video_qa.score(realtime, "The budget is 42 million.")
    not_yet = {"kind": "not_yet", "forbid": ["september"]}
    assert video_qa.score(not_yet, "The release date has not been shown yet.")
    assert not video_qa.score(not_yet, "It is not before September.")  # gives the future away
    assert not video_qa.score(not_yet, "The release is on Monday.")  # a guess, not "not known"


CONTEXT = """[00:00.0] Good morning everyone.
[00:01.0] On screen: Budget | - Total budget: 4.2 million euros
[00:08.1] The more the proof the budget on Monday.
[00:14.0] User: When did the board approve the budget?
[00:21.5] We hire two designers.
[01:02.0] On screen: Roadmap | - Beta launch in May"""


def test_what_the_context_held_when_a_question_was_asked() -> None:
    lines = video_qa.context_lines(CONTEXT)
    assert lines[2] == (8.1, "The more the proof the budget on Monday.") and lines[-1][0] == 62.0
    assert video_qa.spoken(lines) == ["Good morning everyone.", "The more the proof the budget on Monday.",
                                      "We hire two designers."]
    assert video_qa.held_before(lines, 14, [["monday"]])  # misheard around it, but the answer was there
    assert not video_qa.held_before(lines, 14, [["designers"]])  # said at 21.5 s: not yet
    assert video_qa.held_before(lines, 22, [["designers"]])
    assert not video_qa.held_before(lines, 60, [["may"]]) and video_qa.held_before(lines, 63, [["may"]])
    assert not video_qa.held_before(lines, 20, [["approve"]])  # the user's own question does not count


def test_the_set_asks_every_kind_inside_its_talks() -> None:
    data = json.loads(video_qa.SET.read_text())
    for talk in data["talks"]:
        length = sum(s["seconds"] for s in talk["scenes"])
        assert {q["kind"] for q in talk["questions"]} == set(video_qa.KINDS)
        assert all(0 < q["at"] < length for q in talk["questions"])
        assert all(q.get("expect") or q.get("forbid") for q in talk["questions"])


def shorter_set(path) -> dict:
    """The quick talk cut to its first two slides and its last: 28 s, one question of each kind (the quick run's
    eight questions over 44 s cost a worker two minutes beside the rest of `make test`; its accuracy is the
    benchmark's to measure, not this test's)."""
    data = json.loads(video_qa.SET.read_text())
    talk = data["talks"][0]
    scenes = [s for s in talk["scenes"] if s.get("title") in ("Quarterly update", "Budget", "Roadmap")]
    asked = {"What is the total budget shown on the slide?": 14, "When is the public release?": 14,
             "When did the board approve the budget?": 21, "Who presented the quarterly update?": 26}
    questions = [dict(q, at=asked[q["q"]]) for q in talk["questions"] if q["q"] in asked]
    data["talks"] = [dict(talk, id="quarterly-short", scenes=scenes, questions=questions)]
    path.write_text(json.dumps(data))
    return data


@pytest.mark.slow
@ON_QWEN_CODER
def test_quick_run_end_to_end(capsys, tmp_path, monkeypatch) -> None:
    packaged_or_skip("pp-ocrv4-det")
    packaged_or_skip("whisper-tiny.en")
    data = shorter_set(tmp_path / "set.json")
    assert sorted(q["kind"] for q in data["talks"][0]["questions"]) == sorted(video_qa.KINDS)
    monkeypatch.setattr(video_qa, "SET", tmp_path / "set.json")
    code, out, err = run_cli(capsys, "bench", "video-qa", "--quick", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["questions"]) == 4 and all(isinstance(q["right"], bool) for q in result["questions"])
    for kind, acc in result["accuracy"].items():
        assert acc["asked"] == sum(q["kind"] == kind for q in result["questions"]) == 1
        assert acc["rate"] == pytest.approx(acc["right"] / acc["asked"], abs=1e-3)
    talk = result["talks"][0]
    assert talk["screens"] == 3 and 3 <= talk["ocr_reads"] <= 6  # three slides, each read about once
    assert "On screen: Budget | - Total budget: 4.2 million euros" in talk["context"]
    assert 0 < talk["screen_tokens"] < talk["context_tokens"]
    assert all(q["first_token_s"] is not None and q["first_token_s"] <= q["done_s"] for q in result["questions"])
    # the slides' facts were read before their questions; what the narration held is the ASR's to say
    assert all(q["answer_in_context"] for q in result["questions"] if q["kind"] in ("realtime", "backward"))
    assert result["accuracy"]["not_yet"]["answer_in_context"] is None
    assert 0 <= talk["narration_wer"] < 100
    # the default profile is not grounded: every question goes to the 1.5B, which says itself what is not known yet
    # (the release date, on a slide shown only after 14 s: measured "Not known yet." in every run), each refusal
    # only after the model said no to the refusal check (models/lm/refusal_check.py)
    answering = result["answering"]
    assert {k: answering[k] for k in ("grounded", "answers_in_context")} == {"grounded": False,
                                                                            "answers_in_context": False}
    refusals = sum(q["answer"].lower().startswith("not known") for q in result["questions"])
    assert answering["refusal_check"]["checked"] - answering["refusal_check"]["answered"] == refusals
    assert not any(q["not_heard"] for q in result["questions"])
    assert all("not known" in q["answer"].lower() for q in result["questions"] if q["kind"] == "not_yet")
