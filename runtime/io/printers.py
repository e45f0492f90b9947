"""Event sinks for the CLI: JSON lines for programs, a live text view for people.

Both take every event type and ignore what they do not show, so a new event never breaks a printer.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import TextIO

from runtime.events import (
    Error,
    Event,
    Metrics,
    ResponseAudioTranscriptDelta,
    ResponseAudioTranscriptDone,
    ResponseCreated,
    ResponseDone,
    ResponseTextDelta,
    ResponseTextDone,
    ScreenText,
    TranscriptionCompleted,
    TranscriptionDelta,
    VideoNote,
)

DIM, RESET, ERASE_TO_END = "\x1b[2m", "\x1b[0m", "\x1b[K"


class JsonLinesPrinter:
    """One event per line, exactly `event.to_json()`, flushed at once so a pipe reader sees it live."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout

    def write(self, event: Event) -> None:
        self.stream.write(event.to_json() + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.stream.flush()


def timestamp(seconds: float) -> str:
    """`[mm:ss.s]` of a media time."""
    tenths = max(0, round(seconds * 10))
    return f"[{tenths // 600:02d}:{tenths % 600 / 10:04.1f}]"


class TextPrinter:
    """A live, human view: one line per transcript item, `[mm:ss.s] text`, growing as deltas arrive and
    ending with the final transcript; answers as `Q: question` then `A: ` and the streamed text; errors on
    `error_stream` as `error: message`; metrics only with `show_metrics`. An answer that starts mid-sentence
    cuts its line: the item goes on after it on a new line with the same start time. A video note waits for
    the transcript line in progress to end.

    On a terminal the unstable tail of the transcript is shown dim and replaced on the next update; on
    anything else only stable text is written, so a log file never contains text that was later changed, except
    by the ASR's final pass (`asr.final_pass`): a completed transcript that revises the streamed words is printed
    whole, on a terminal over its line, elsewhere as a new line with the same start time marked "(revised)".
    While an answer streams, transcript events are held and printed after it, so neither is cut in half.
    """

    def __init__(
        self, stream: TextIO | None = None, *, show_metrics: bool = False, error_stream: TextIO | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.error_stream = error_stream if error_stream is not None else sys.stderr
        self.show_metrics = show_metrics
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._line: str | None = None  # who owns the open (unterminated) line: "item:<id>" / "answer:<id>"
        self._tail = 0  # characters of dim unstable text at the end of the open line
        self._column = 0  # characters printed on the open line (to rewrite it when a final pass revises it)
        self._stable: dict[str, str] = {}  # item_id -> stable text printed so far
        self._starts: dict[str, float] = {}  # item_id -> media start, for the line prefix
        self._heard: dict[str, float] = {}  # item_id -> media time its printed words reach (a continuation's stamp)
        self._answered: set[str] = set()  # responses whose text has been printed
        self._held: list[Event] = []  # transcript events that arrived while an answer was streaming

    def write(self, event: Event) -> None:
        answering = self._line is not None and self._line.startswith("answer:")
        hearing = self._line is not None and self._line.startswith("item:")
        if answering and isinstance(event, (TranscriptionDelta, TranscriptionCompleted, VideoNote, ScreenText)) or (
                hearing and isinstance(event, (VideoNote, ScreenText))):  # a note waits for the sentence it would cut
            self._held.append(event)
        elif isinstance(event, TranscriptionDelta):
            self._transcript_delta(event)
        elif isinstance(event, TranscriptionCompleted):
            self._transcript_done(event)
        elif isinstance(event, ScreenText):
            self._end_line()
            self._out(f"{timestamp(event.start)} (on screen) {event.text}\n")
        elif isinstance(event, VideoNote):
            self._end_line()
            self._out(f"{timestamp(event.start)} (video, to {timestamp(event.end)}) {event.text}\n")
        elif isinstance(event, ResponseCreated):
            self._response_created(event)
        elif isinstance(event, (ResponseTextDelta, ResponseAudioTranscriptDelta)):  # a spoken answer shows its words
            if self._line == "answer:":  # the response.created carried no id: this is its text
                self._line = f"answer:{event.response_id}"
            opened = self._open(f"answer:{event.response_id}", "A: ")
            fresh = opened or event.response_id not in self._answered
            self._out(event.delta.lstrip() if fresh else event.delta)
            self._answered.add(event.response_id)
        elif isinstance(event, (ResponseTextDone, ResponseAudioTranscriptDone)):
            text = event.text if isinstance(event, ResponseTextDone) else event.transcript
            if event.response_id not in self._answered and text:  # no deltas came: show it whole
                self._open(f"answer:{event.response_id}", "A: ")
                self._out(text)
                self._answered.add(event.response_id)
        elif isinstance(event, ResponseDone):
            self._response_done(event)
        elif isinstance(event, Error):
            self._end_line()
            message = event.error.get("message") or event.error.get("code") or "unknown error"
            self.error_stream.write(f"error: {message}\n")
            self.error_stream.flush()
        elif isinstance(event, Metrics) and self.show_metrics:
            self._end_line()
            self._out(f"metrics: {json.dumps(event.metrics, separators=(',', ':'), default=str)}\n")
        self.stream.flush()

    def close(self) -> None:
        held, self._held = self._held, []
        self._end_line()
        for item in held:
            self.write(item)
        self._end_line()
        self.stream.flush()

    # -- transcript ---------------------------------------------------------------------------------------
    def _transcript_delta(self, event: TranscriptionDelta) -> None:
        item = event.item_id
        self._starts.setdefault(item, event.start)
        printed = self._stable.get(item, "")
        if not event.delta and not self.tty and self._line != f"item:{item}":
            return  # nothing stable to add, and an unstable tail is not shown off a terminal
        # An item cut by another line goes on on a new line, stamped where its printed words ended, marked "…"
        prefix = f"{timestamp(self._heard[item])} … " if printed else f"{timestamp(self._starts[item])} "
        opened = self._open(f"item:{item}", prefix)
        self._clear_tail()
        shown = event.delta.lstrip() if not printed or opened else event.delta  # no space after the prefix
        self._out(shown)
        self._stable[item] = printed + (event.delta if printed else shown)  # the item's text, not the line's
        if self._stable[item]:
            self._heard[item] = event.end
        if self.tty and event.unstable:
            unstable = event.unstable.lstrip() if not self._stable[item] or (opened and not shown) else event.unstable
            self._out(f"{DIM}{unstable}{RESET}")
            self._tail = len(unstable)

    def _transcript_done(self, event: TranscriptionCompleted) -> None:
        item = event.item_id
        self._starts.pop(item, None)  # the line's stamp is the completed event's: where the speech began
        self._heard.pop(item, None)
        printed = self._stable.pop(item, "")
        final = event.transcript.strip()
        if not final and self._line != f"item:{item}":  # a buffer that held no words (silence before a commit)
            return
        if printed and final.startswith(printed) and self._line == f"item:{item}":
            self._clear_tail()
            self._out(final[len(printed) :])
        elif self.tty and self._line == f"item:{item}":  # a final pass revised the line: rewrite it in place
            self._clear_tail()
            self._erase_open_line()
            self._out(f"{timestamp(event.start)} {final}")
        else:  # nothing shown yet, another line came between, or the final text differs: print it whole
            self._end_line()
            revised = "(revised) " if printed and not final.startswith(printed.strip()) else ""
            self._out(f"{timestamp(event.start)} {revised}{final}")
        self._out("\n")
        self._line = None
        held, self._held = self._held, []  # video notes that waited for this line
        for note in held:
            self.write(note)

    # -- answers ------------------------------------------------------------------------------------------
    def _response_created(self, event: ResponseCreated) -> None:
        response_id = str(event.response.get("id", ""))
        question = event.response.get("question")
        self._end_line()
        if question:
            self._out(f"Q: {question}\n")
        self._open(f"answer:{response_id}", "A: ")

    def _response_done(self, event: ResponseDone) -> None:
        response_id = str(event.response.get("id", ""))
        status = event.response.get("status", "completed")
        if status != "completed":
            self._open(f"answer:{response_id}", "A: ")
            self._out(f" [{status}]")
        elif event.response.get("grounding"):  # answered without the model: say why, and what turns it off
            self._open(f"answer:{response_id}", "A: ")
            self._out(" [the model was not asked: lm.grounded; --set lm.grounded=false asks it]")
        elif event.response.get("screen") == "unseen":  # answered without the model: it cannot see the screen either
            self._open(f"answer:{response_id}", "A: ")
            self._out(" [the model was not asked: no screen reader, no video model]")
        if self._line in (f"answer:{response_id}", "answer:"):
            self._end_line()
        self._answered.discard(response_id)
        held, self._held = self._held, []
        for item in held:
            self.write(item)

    # -- line bookkeeping ---------------------------------------------------------------------------------
    def _open(self, owner: str, prefix: str) -> bool:
        """Make `owner` the open line, ending another's first; a new line starts with `prefix` (True)."""
        if self._line == owner:
            return False
        self._end_line()
        self._out(prefix)
        self._line = owner
        return True

    def _end_line(self) -> None:
        if self._line is not None:
            self._clear_tail()
            self._out("\n")
            self._line = None

    def _clear_tail(self) -> None:
        if self._tail:
            self._out(f"\x1b[{self._tail}D{ERASE_TO_END}")
            self._tail = 0

    def _erase_open_line(self) -> None:
        """Move back to the start of the open line, over the rows it wrapped onto, and erase from there."""
        columns = shutil.get_terminal_size().columns
        rows = max(0, self._column - 1) // max(1, columns)
        self._out((f"\x1b[{rows}A" if rows else "") + "\r\x1b[J")
        self._column = 0

    def _out(self, text: str) -> None:
        if text:
            self.stream.write(text)
            if "\x1b" not in text:  # the open line's printed width (escape sequences move, not print)
                line = text.rsplit("\n", 1)
                self._column = len(line[-1]) if len(line) > 1 else self._column + len(text)
