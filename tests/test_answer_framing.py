"""An answer ends where it starts writing the conversation's own lines (a timestamp, the next "Question:"),
and no piece of such a line is ever streamed (`backend.AnswerText`, `prompt.framing_line`)."""

from runtime.models.lm.backend import AnswerText
from runtime.models.lm.prompt import framing_line, may_become_framing
from runtime.models.lm.sampling import StopRule

EOS = 0


class _Pieces:
    """A tokenizer whose token i decodes to PIECES[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(self.pieces[i] for i in ids)


def _answer(pieces: list[str], *, framing: bool = True) -> tuple[list[str], str, str | None]:
    """Feed the pieces one token a step: (the deltas streamed, the text, the finish reason)."""
    tok = _Pieces(["<eos>", *pieces])
    text = AnswerText(tok, StopRule(frozenset({EOS}), max_new_tokens=64), framing=framing)  # type: ignore[arg-type]
    deltas = []
    for token in [*range(1, len(pieces) + 1), EOS]:
        step = text.take([token])
        deltas.append(step.delta)
        if step.done:
            break
    return deltas, text.emitted, text.finish_reason


def test_a_timestamped_line_ends_the_answer_and_none_of_it_is_streamed():
    deltas, said, reason = _answer(["Priya", " Nair", ".", "\n", "[", "00", ":42.0] On screen: Pricing"])
    assert said == "Priya Nair." and reason == "stop"
    assert "".join(deltas) == said and not any("[" in d or "\n" in d for d in deltas)


def test_the_next_question_ends_it_too_even_after_a_blank_line():
    deltas, said, reason = _answer(["Priya", " Nair", "\n\n", "Pre", "mise: a user.", "\n\n", "Question", ": who?"])
    assert said == "Priya Nair\n\nPremise: a user." and reason == "stop"


def test_other_lines_are_held_only_until_they_show_they_are_not_framing():
    deltas, said, reason = _answer(["Two", " steps:", "\n", "[", "a", "] first", "\n", "Then", " done."])
    assert said == "Two steps:\n[a] first\nThen done." and reason == "stop"  # ended by the end-of-sequence token
    assert deltas[2] == "" and deltas[3] == "" and deltas[4] == "\n[a"  # "\n" and "\n[" waited for the next piece


def test_without_framing_nothing_is_cut():
    _, said, _ = _answer(['{"a":', "\n", "[", "1]}"], framing=False)  # JSON under a schema may start a line so
    assert said == '{"a":\n[1]}'


def test_framing_line_and_its_prefixes():
    assert framing_line("ok\n[12:00.0] x") == 2 and framing_line("ok\nQuestion: y") == 2
    assert framing_line("[00:01.0] at the very start is the answer's own text") is None
    assert framing_line("ok\n[a] item") is None and framing_line("ok\nQuestions remain") is None
    assert framing_line("See:\n[1] the first point") is None  # a numbered reference is not a timestamp
    assert all(may_become_framing(t) for t in ("ok\n", "ok\n[", "ok\n[12", "ok\n[12:", "ok\nQues",
                                                "ok\nTranscript so"))
    assert not any(may_become_framing(t) for t in ("ok", "ok\nThe", "ok\n[a", "ok\n[1]", "ok\nQuery"))


def test_a_numbered_line_is_held_until_it_shows_it_is_no_timestamp():
    deltas, said, reason = _answer(["See", ":", "\n", "[1", "]", " the first point."])
    assert said == "See:\n[1] the first point." and reason == "stop" and deltas[3] == ""


def test_an_answer_that_runs_out_of_tokens_on_a_possible_framing_line_ends_before_it():
    tok = _Pieces(["<eos>", "Nair", ".", "\n", "Ques"])
    text = AnswerText(tok, StopRule(frozenset({EOS}), max_new_tokens=4))  # type: ignore[arg-type]
    step = text.take([1, 2, 3, 4])
    assert step.done and text.finish_reason == "length" and text.emitted == "Nair."


def test_a_carriage_return_waits_for_its_line_feed():
    deltas, said, reason = _answer(["Nair", ".", "\r", "\n", "[00:", "42.0] On screen"])
    assert said == "Nair." and reason == "stop" and not any("\r" in d for d in deltas)
