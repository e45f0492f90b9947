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
from runtime.models.lm.answerer import AnswerBackend
from runtime.models.vlm.prompt import memory_pieces
from runtime.pipeline import Emit
from runtime.pipeline.prefill import TextEmbedder
from runtime.session_state import AnswerActivity
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)
NOTE_QUESTION = "In one short sentence, what happens in these video frames?"
_note_keys = itertools.count(1 << 40)  # keys for note prompts: never equal to a memory block's


class NoteWriter:
    def __init__(self, answerer: AnswerBackend, worker: DeviceWorker, memory: VideoMemory, emit: Emit,
                 activity: AnswerActivity, embed_text: TextEmbedder, *, max_tokens: int = 24,
                 pending: int = 4) -> None:
        self.answerer, self.worker, self.memory, self.emit = answerer, worker, memory, emit
        self.activity, self.embed_text = activity, embed_text
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
        state = await self.worker.run(Priority.VISION, self.answerer.start, "", NOTE_QUESTION,
                                      suffix=memory_pieces([block]))
        text = ""
        try:
            for _ in range(self.max_tokens):
                step = await self.worker.run(Priority.VISION, self.answerer.step, state)
                text += step.delta
                if step.done:
                    break
        finally:
            await self.worker.run(Priority.CONTROL, self.answerer.release, state)
        text = " ".join(text.split())
        if not text:
            return
        embedding = await self.worker.run(Priority.VISION, self.embed_text, text)
        if self.memory.set_note(segment.id, text, embedding):
            self.written += 1
            await self.emit(VideoNote(segment_id=segment.id, text=text, start=segment.start, end=segment.end,
                                      media_time=segment.end))
