"""Streaming prefill (Stream2LLM): the context goes into the language model's KV while it streams in, so a
question later costs only its own prefill (and, with video, the change of its memory selection).

Whenever the transcript or the video memory changes (`ContextChanges`), the LM stream gets the newest context
and prefills it in small worker jobs. Changes coalesce: while a round runs, further changes only mark the
context dirty, and the next round prefills the latest state (update mode keeps the KV up to the longest common
prefix). A round is the unit of consistency: the background loop and a question's catch-up never interleave
(`_round` is held across a round's jobs), so a question never sees the context half-set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from torch import Tensor

from runtime.memory.conversation import Conversation
from runtime.memory.video import VideoMemory
from runtime.models.lm.backend import LMStream
from runtime.models.lm.pieces import Piece
from runtime.models.vlm.prompt import memory_pieces
from runtime.session_state import ContextChanges
from runtime.worker import DeviceWorker, Priority

TextEmbedder = Callable[[str], Tensor | None]  # text -> a vector in the memory's space (question-aware selection)


class ContextPrefiller:
    def __init__(self, stream: LMStream, worker: DeviceWorker, transcript: Conversation,
                 changes: ContextChanges, *, video: VideoMemory | None = None,
                 embed_text: TextEmbedder | None = None) -> None:
        self.stream, self.worker, self.transcript, self.changes = stream, worker, transcript, changes
        self.video, self.embed_text = video, embed_text
        self.prefilled_tokens = 0
        self.selected: list[tuple[float, float]] = []  # segments the last question selected (media spans)
        self.question: str | None = None  # while one is answered, background rounds keep its selection
        self._round = asyncio.Lock()
        self._asking = 0  # questions waiting for a round

    @property
    def sees_video(self) -> bool:
        """Whether a question selects video segments (the answer then reports which)."""
        return self.video is not None

    async def run(self) -> None:
        while True:
            await self.changes.wait()
            await self.catch_up()

    def end_question(self) -> None:
        """The answer is done: the memory goes back to its own selection."""
        self.question = None
        self.changes.mark()

    @property
    def priority(self) -> Priority:
        """A round's jobs wait behind the decode steps of answers in flight (`Priority.CONTEXT`: in a server, other
        sessions' answers), unless a question waits for the round: then they go ahead of them (`PREFILL`)."""
        return Priority.PREFILL if self._asking else Priority.CONTEXT

    async def catch_up(self, question: str | None = None) -> None:
        """Prefill the current context fully (also called right before answering, with the question, which
        then selects the memory until `end_question`)."""
        self._asking += question is not None
        try:
            async with self._round:
                if question is not None:
                    self.question = question
                suffix = await self.worker.run(self.priority, self._suffix, self.question) if self.video else None
                text = self.transcript.context()
                if suffix is None:  # a stream without video takes the transcript alone (LMStream's contract)
                    await self.worker.run(self.priority, self.stream.set_context, text)
                else:  # (tokenising the new context is model work too: on the worker)
                    await self.worker.run(self.priority, self.stream.set_context, text, suffix)
                while n := await self.worker.run(self.priority, self.stream.prefill_step):
                    self.prefilled_tokens += n
        finally:
            self._asking -= question is not None

    def _suffix(self, question: str | None) -> list[Piece] | None:
        """On the worker: the memory suffix from a fresh snapshot; a question selects its segments."""
        if self.video is None:
            return None
        snapshot = self.video.snapshot()
        query = self.embed_text(question) if question and self.embed_text is not None else None
        self.selected = []
        if query is not None and snapshot.segments:
            self.selected = [(s.start, s.end) for s in snapshot.select(query)]
        return memory_pieces(snapshot.blocks(query))
