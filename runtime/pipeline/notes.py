"""Think While Watching's segment notes: while no question waits, the language model writes one short line
per closed memory segment from its keyframe, stores it in the memory (selection scores it) and emits
`video.note`.

A note never delays an answer: before each one the writer waits for `AnswerActivity` to be idle, and its jobs
run at vision priority, below prefill and decode. Pending segments are bounded (oldest dropped first): notes
are a bonus, never a backlog.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging

from runtime.events import VideoNote
from runtime.memory.video import MemoryBlock, Segment, VideoMemory
from runtime.models.lm.backend import AnswerBackend
from runtime.models.lm.prompt import NOTE_QUESTION
from runtime.models.vlm.prompt import memory_pieces
from runtime.pipeline import Emit
from runtime.session_state import AnswerActivity
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)
_note_keys = itertools.count(1 << 40)  # keys for note prompts: never equal to a memory block's


class NoteWriter:
    def __init__(self, answerer: AnswerBackend, worker: DeviceWorker, memory: VideoMemory, emit: Emit,
                 activity: AnswerActivity, *, max_tokens: int = 24, pending: int = 4) -> None:
        self.answerer, self.worker, self.memory, self.emit, self.activity = answerer, worker, memory, emit, activity
        self.max_tokens = max_tokens
        self.pending: collections.deque[Segment] = collections.deque(maxlen=pending)
        self._wake = asyncio.Event()
        self.written = 0

    def add(self, segments: list[Segment]) -> None:
        self.pending.extend(segments)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                await self.activity.idle()  # a question is waiting or being answered: it goes first
                segment = self.pending.popleft()
                try:
                    await self._write(segment)
                except Exception:  # a failed note is only a missing note
                    log.exception("writing a video note failed")

    async def _write(self, segment: Segment) -> None:
        block = MemoryBlock(kind="retrieved", key=next(_note_keys), start=segment.start, end=segment.end,
                            embeds=segment.keyframe)
        answer = await self.worker.run(Priority.VISION, self.answerer.start, "", NOTE_QUESTION,
                                       suffix=memory_pieces([block]))
        text = ""
        try:
            for _ in range(self.max_tokens):
                step = await self.worker.run(Priority.VISION, answer.step)
                text += step.delta
                if step.done:
                    break
        finally:
            await self.worker.run(Priority.CONTROL, answer.release)
        text = " ".join(text.split())
        if not text:
            return
        embedding = await self.worker.run(Priority.VISION, self.answerer.embed_text, text)
        if self.memory.set_note(segment.id, text, embedding):
            self.written += 1
            await self.emit(VideoNote(segment_id=segment.id, text=text, start=segment.start, end=segment.end,
                                      media_time=segment.end))
