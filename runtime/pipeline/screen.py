"""Text on screen into the session: the frames worth reading are read on the device worker, and what they
show joins the conversation and goes to the client.

    video frames --> ScreenReader.take --(worker: ChangeDetector says due? -> TextReader.read -> ScreenText.add)
                       |--> `runtime.screen.text` event (a screen opened or changed)
                       '--> the screen notes (memory/screen_notes.py): one "On screen" item per screen in the
                            conversation, so answers read it in time order beside what was said (the prefiller
                            takes the change), older screens consolidated within `screen.max_note_tokens`

    a question --> NotesWithQuestion.start: the screens it points at that the context no longer holds whole are
                   given with it (the answerer's question text), so the prefilled context stays as it is

The video processor hands each frame over after its own work, so a frame is read (or skipped) before the next
one is taken: reading bounds itself. While a read runs, newer frames wait in the video channel, which keeps the
latest and counts what it drops; `ChangeDetector` reads at most once per `screen.min_interval_s` of media time.
A read that fails costs that frame (an `error` event), not the session.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Any

from runtime.chunks import VideoFrame
from runtime.config import ScreenConfig
from runtime.events import ScreenText as ScreenTextEvent
from runtime.events import error_event
from runtime.memory.screen_notes import ScreenNotes
from runtime.memory.screen_text import Screen, ScreenText
from runtime.models.lm.answering import Answering, AnswerRequest, Preparing, RunningAnswer
from runtime.models.ocr.reader import TextReader
from runtime.pipeline import Emit
from runtime.pipeline.screen_change import ChangeDetector
from runtime.session_state import ContextChanges
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)


class ScreenReader:
    def __init__(self, reader: TextReader, cfg: ScreenConfig, worker: DeviceWorker, emit: Emit,
                 notes: ScreenNotes, changes: ContextChanges) -> None:
        self.reader, self.worker, self.emit = reader, worker, emit
        self.notes, self.changes = notes, changes
        self.detector = ChangeDetector(threshold=cfg.threshold, min_interval_s=cfg.min_interval_s,
                                       refresh_s=cfg.refresh_s)
        self.screens = ScreenText(min_confidence=cfg.min_confidence, max_screens=cfg.max_screens)
        self.reads = 0
        self.read_s = 0.0  # worker seconds spent reading

    async def take(self, frames: list[VideoFrame]) -> None:
        for frame in frames:
            try:
                screen = await self.worker.run(Priority.VISION, self._look, frame)
            except Exception as err:  # one unreadable frame costs that frame
                log.exception("screen reading failed")
                await self.emit(error_event(f"screen reading failed: {err}", code="screen_failed",
                                            type="server_error", media_time=frame.time))
                continue
            if screen is not None:
                await self._publish(screen, frame.time)

    def _look(self, frame: VideoFrame) -> Screen | None:
        """On the worker: read the frame if it is due, and merge what it shows."""
        if not self.detector.due(frame.time, frame.image):
            return None
        began = time.perf_counter()
        lines = self.reader.read(frame.image)
        self.read_s += time.perf_counter() - began
        self.reads += 1
        self.detector.read_done(frame.time)
        return self.screens.add(frame.time, lines)

    async def _publish(self, screen: Screen, now: float) -> None:
        self.notes.publish(screen.screen_id, screen.start, screen.end, [line.text for line in screen.lines])
        self.changes.mark()
        lines = [{**asdict(line), "box": list(line.box)} for line in screen.lines]
        await self.emit(ScreenTextEvent(screen_id=screen.screen_id, text=screen.text, lines=lines,
                                        start=screen.start, end=screen.end, media_time=now))

    def metrics(self) -> dict[str, Any]:
        """Frames offered, reads, worker seconds reading, screens kept, and the notes' budget and selections
        (`runtime.metrics` under `screen`)."""
        return {"frames_offered": self.detector.offered, "reads": self.reads, "read_s": round(self.read_s, 3),
                "screens": len(self.screens.screens), **self.notes.metrics()}


class NotesWithQuestion:
    """An `Answering` that gives each question the screens it points at (`ScreenNotes.with_question`), around
    the session's answerer, local or remote: the question is the part of the prompt made per answer, so the
    prefilled context (and a server's prefix cache) stays valid."""

    def __init__(self, inner: Answering, notes: ScreenNotes) -> None:
        self.inner, self.notes = inner, notes

    async def start(self, request: AnswerRequest) -> RunningAnswer:
        return await self.inner.start(self._with_notes(request))

    def prepare(self, request: AnswerRequest) -> None:
        """As the inner answerer prepares (`Preparing`; a remote one does not): the request as `start` makes it."""
        if isinstance(self.inner, Preparing):
            self.inner.prepare(self._with_notes(request))

    def drop_prepared(self) -> None:
        if isinstance(self.inner, Preparing):
            self.inner.drop_prepared()

    def _with_notes(self, request: AnswerRequest) -> AnswerRequest:
        return replace(request, question=self.notes.with_question(request.question))
