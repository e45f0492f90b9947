"""CLI printers: JSON lines that round-trip through parse_event, and a readable live text view."""

import io

from runtime.events import (
    Metrics,
    ResponseAudioTranscriptDelta,
    ResponseAudioTranscriptDone,
    ResponseCreated,
    ResponseDone,
    ResponseTextDelta,
    ResponseTextDone,
    SessionCreated,
    TranscriptionCompleted,
    TranscriptionDelta,
    VideoNote,
    error_event,
    parse_event,
)
from runtime.io.printers import DIM, JsonLinesPrinter, TextPrinter, timestamp


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def conversation() -> list:
    item = dict(item_id="item_1", start=1.0, end=2.0)
    answer = dict(response_id="resp_1", item_id="item_a")
    return [
        SessionCreated(session={"id": "sess_1"}),
        TranscriptionDelta(delta="A red", unstable=" bal", **item),
        TranscriptionDelta(delta=" ball rolls", unstable=" to", **item),
        TranscriptionCompleted(transcript="A red ball rolls to the right.", **item),
        ResponseCreated(response={"id": "resp_1", "question": "What rolls?"}),
        ResponseTextDelta(delta="The red", **answer),
        ResponseTextDelta(delta=" ball.", **answer),
        ResponseTextDone(text="The red ball.", **answer),
        ResponseDone(response={"id": "resp_1", "status": "completed"}),
        Metrics(metrics={"rtf": 0.1}),
        error_event("question queue is full", code="queue_full"),
    ]


def test_json_lines_round_trip() -> None:
    stream = io.StringIO()
    printer = JsonLinesPrinter(stream)
    events = conversation()
    for event in events:
        printer.write(event)
    printer.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == len(events)
    parsed = [parse_event(line) for line in lines]
    assert [p.to_dict() for p in parsed] == [e.to_dict() for e in events]


def test_text_view() -> None:
    out, err = io.StringIO(), io.StringIO()
    printer = TextPrinter(out, error_stream=err)
    for event in conversation():
        printer.write(event)
    printer.close()
    lines = out.getvalue().splitlines()
    assert lines == ["[00:01.0] A red ball rolls to the right.", "Q: What rolls?", "A: The red ball."]
    assert "\x1b" not in out.getvalue()  # not a terminal: no unstable tail, no escapes
    assert err.getvalue() == "error: question queue is full\n"


def test_metrics_only_when_asked() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, show_metrics=True, error_stream=io.StringIO())
    printer.write(Metrics(metrics={"rtf": 0.1}))
    assert out.getvalue() == 'metrics: {"rtf":0.1}\n'


def test_terminal_shows_unstable_tail_dim() -> None:
    out = Terminal()
    printer = TextPrinter(out)
    printer.write(TranscriptionDelta(item_id="i", delta="hello", unstable=" wor", start=65.0, end=66.0))
    assert out.getvalue().startswith("[01:05.0] hello") and f"{DIM} wor" in out.getvalue()
    printer.write(TranscriptionCompleted(item_id="i", transcript="hello world", start=65.0, end=66.0))
    assert out.getvalue().endswith(" world\n")


def test_interleaved_lines_and_fallbacks() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, error_stream=io.StringIO())
    answer = dict(response_id="r", item_id="a")
    printer.write(ResponseCreated(response={"id": "r"}))
    printer.write(ResponseTextDelta(delta="Yes", **answer))
    printer.write(TranscriptionDelta(item_id="t", delta="more speech", start=3.0, end=4.0))
    printer.write(ResponseTextDelta(delta=" indeed", **answer))
    printer.write(ResponseDone(response={"id": "r", "status": "cancelled"}))
    printer.write(TranscriptionCompleted(item_id="t", transcript="more speech here", start=3.0, end=5.0))
    printer.write(TranscriptionCompleted(item_id="u", transcript="no deltas", start=6.0, end=7.0))
    printer.write(ResponseCreated(response={"id": "s"}))
    printer.write(ResponseTextDone(text="whole answer", response_id="s", item_id="b"))
    printer.write(ResponseDone(response={"id": "s", "status": "completed"}))
    printer.close()
    assert out.getvalue().splitlines() == [  # transcript held while the answer streams, then printed
        "A: Yes indeed [cancelled]",
        "[00:03.0] more speech here",
        "[00:06.0] no deltas",
        "A: whole answer",
    ]


def test_a_transcript_line_cut_by_an_answer_goes_on_without_a_double_space() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, error_stream=io.StringIO())
    item = dict(item_id="t", start=0.1, end=1.0)
    printer.write(TranscriptionDelta(delta="the", **item))
    printer.write(ResponseCreated(response={"id": "r", "question": "what?"}))  # ends the transcript line
    printer.write(ResponseDone(response={"id": "r", "status": "completed"}))
    printer.write(TranscriptionDelta(delta=" red ball", **item))  # the item goes on, on a new line
    printer.write(TranscriptionDelta(delta=" rolls", **item))
    printer.write(TranscriptionCompleted(transcript="the red ball rolls away", **item))  # ends the same line
    printer.close()
    # the item's start is not repeated: the continuation is stamped where the printed words ended, marked "…"
    assert out.getvalue().splitlines() == ["[00:00.1] the", "Q: what?", "A: ", "[00:01.0] … red ball rolls away"]


def test_a_video_note_waits_for_the_transcript_line_in_progress() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, error_stream=io.StringIO())
    item = dict(item_id="t", start=0.1, end=2.0)
    printer.write(TranscriptionDelta(delta="a red", **item))
    printer.write(VideoNote(segment_id=0, text="a ball", start=0.0, end=3.0))
    printer.write(TranscriptionDelta(delta=" ball rolls", **item))
    printer.write(TranscriptionCompleted(transcript="a red ball rolls", **item))
    printer.close()
    assert out.getvalue().splitlines() == ["[00:00.1] a red ball rolls", "[00:00.0] (video, to [00:03.0]) a ball"]


def test_timestamp() -> None:
    assert timestamp(0) == "[00:00.0]"
    assert timestamp(59.96) == "[01:00.0]"
    assert timestamp(754.32) == "[12:34.3]"


def test_video_notes_print_on_their_own_line_and_wait_for_an_answer() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, error_stream=io.StringIO())
    printer.write(ResponseCreated(response={"id": "r1"}))
    printer.write(ResponseTextDelta(response_id="r1", item_id="i", delta="A ball"))
    printer.write(VideoNote(segment_id=0, text="a red ball rolls", start=0.0, end=9.5))
    assert "red ball" not in out.getvalue()  # held: it would cut the answer's line
    printer.write(ResponseTextDone(response_id="r1", item_id="i", text="A ball"))
    printer.write(ResponseDone(response={"id": "r1", "status": "completed"}))
    printer.close()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("A ball")
    assert lines[-1] == f"{timestamp(0.0)} (video, to {timestamp(9.5)}) a red ball rolls"


def test_an_item_without_words_prints_no_line() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, error_stream=io.StringIO())
    printer.write(TranscriptionCompleted(item_id="a", transcript="one", start=0.0, end=1.0))
    printer.write(TranscriptionCompleted(item_id="b", transcript="  ", start=1.0, end=2.0))  # silence, committed
    printer.close()
    assert out.getvalue().splitlines() == ["[00:00.0] one"]



def render(text: str, columns: int) -> list[str]:
    """What a terminal `columns` wide shows after `text` (the escapes the printer uses; colours ignored)."""
    import re

    rows, row, col = [[]], 0, 0
    for token in re.findall(r"\x1b\[(\d*)([A-Za-z])|(\r)|(\n)|(.)", text, flags=re.S):
        n, op, cr, nl, ch = token
        if ch:
            if col == columns:
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            rows[row][col:col + 1] = [ch]
            col += 1
        elif nl:
            row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
        elif cr:
            col = 0
        elif op == "D":
            col = max(0, col - int(n or 1))
        elif op == "A":
            row = max(0, row - int(n or 1))
        elif op == "K":
            del rows[row][col:]
        elif op == "J":
            del rows[row][col:]
            del rows[row + 1 :]
    return ["".join(r) for r in rows]


def test_a_revised_final_transcript_replaces_its_line(monkeypatch) -> None:
    import os
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: os.terminal_size((30, 24)))
    item = dict(item_id="i", start=1.0, end=4.0)
    events = [TranscriptionDelta(delta="Try again. Fair", unstable=" agai", **item),
              TranscriptionDelta(delta=" again. Fair,", unstable=" bet", **item),
              TranscriptionCompleted(transcript="Try again. Fail again. Fail better.", **item)]
    out = Terminal()
    printer = TextPrinter(out)
    for event in events:
        printer.write(event)
    screen = render(out.getvalue(), 30)
    assert "".join(screen) == "[00:01.0] Try again. Fail again. Fail better."  # wrapped over rows, nothing left over
    log = io.StringIO()  # not a terminal: the revision is a new line with the same start
    printer = TextPrinter(log)
    for event in events:
        printer.write(event)
    assert log.getvalue().splitlines() == ["[00:01.0] Try again. Fair again. Fair,",
                                           "[00:01.0] (revised) Try again. Fail again. Fail better."]


def test_a_revised_transcript_is_stamped_where_its_speech_began() -> None:
    # without the speech gate, words written before the VAD heard the speech come stamped at the buffer's start
    log = io.StringIO()
    printer = TextPrinter(log)
    printer.write(TranscriptionDelta(item_id="i", delta="you", unstable="", start=0.0, end=0.2))
    printer.write(TranscriptionCompleted(item_id="i", transcript="Red ball.", start=0.3, end=0.9))
    assert log.getvalue().splitlines() == ["[00:00.0] you", "[00:00.3] (revised) Red ball."]


def test_an_answer_made_without_the_model_says_why_and_how_to_ask_it() -> None:
    out = io.StringIO()
    printer = TextPrinter(out, error_stream=io.StringIO())
    printer.write(ResponseCreated(response={"id": "r"}))
    printer.write(ResponseTextDelta(delta="Not known yet: nothing heard or shown so far mentions webinar.",
                                    response_id="r", item_id="a"))
    printer.write(ResponseDone(response={"id": "r", "status": "completed", "grounding": {"not_heard": ["webinar"]}}))
    printer.close()
    assert out.getvalue().splitlines() == [
        "A: Not known yet: nothing heard or shown so far mentions webinar. [the model was not asked: lm.grounded; "
        "--set lm.grounded=false asks it]"]


def test_an_answer_that_cannot_see_the_screen_says_the_model_was_not_asked() -> None:
    from runtime.memory.screen_questions import CANNOT_SEE_SCREEN

    out = io.StringIO()
    printer = TextPrinter(out, error_stream=io.StringIO())
    printer.write(ResponseCreated(response={"id": "r", "question": "What is on the slide?"}))
    printer.write(ResponseTextDelta(delta=CANNOT_SEE_SCREEN, response_id="r", item_id="a"))
    printer.write(ResponseDone(response={"id": "r", "status": "completed", "screen": "unseen"}))
    printer.close()
    assert out.getvalue().splitlines() == [
        "Q: What is on the slide?",
        f"A: {CANNOT_SEE_SCREEN} [the model was not asked: no screen reader, no video model]"]


def test_a_spoken_answer_prints_its_transcript() -> None:
    """`serve --speak`: the answer is audio, and the terminal shows its words as they are decoded."""
    out = io.StringIO()
    printer = TextPrinter(out)
    answer = dict(response_id="resp_1", item_id="item_a")
    for event in (ResponseCreated(response={"id": "resp_1", "question": "What rolls?"}),
                  ResponseAudioTranscriptDelta(delta="The red", **answer),
                  ResponseAudioTranscriptDelta(delta=" ball.", **answer),
                  ResponseAudioTranscriptDone(transcript="The red ball.", **answer),
                  ResponseDone(response={"id": "resp_1", "status": "completed"})):
        printer.write(event)
    printer.close()
    assert "A: The red ball.\n" in out.getvalue() and out.getvalue().count("The red ball.") == 1
