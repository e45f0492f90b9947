"""The processors a session runs: chunks in, events out.

Each processor is one asyncio task reading one bounded channel. Model compute goes to the device worker
(`worker.run`), so the loop only moves data and events:

    audio channel --> AudioProcessor --(worker: ASR)--> transcript events + TranscriptMemory
    video channel --> VideoProcessor (video_processor.py) --(worker: vision tower)--> video memory
    question channel --> QuestionProcessor --(worker: prefill, then one decode step per job)--> answer events
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.channels import BlockingChannel
from runtime.chunks import AudioChunk
from runtime.events import (
    Event,
    ResponseCreated,
    ResponseDone,
    ResponseTextDelta,
    ResponseTextDone,
    TranscriptionCompleted,
    TranscriptionDelta,
    error_event,
    new_id,
)
from runtime.memory.transcript import TranscriptMemory
from runtime.models.asr.base import ASRStream, TranscriptUpdate
from runtime.models.lm.backend import AnswerBackend
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)
Emit = Callable[[Event], Awaitable[None]]


def transcript_event(update: TranscriptUpdate) -> Event:
    if update.completed:
        return TranscriptionCompleted(
            item_id=update.item_id,
            transcript=update.transcript,
            start=update.start,
            end=update.end,
            media_time=update.end,
        )
    return TranscriptionDelta(
        item_id=update.item_id,
        delta=update.delta,
        unstable=update.unstable,
        start=update.start,
        end=update.end,
        media_time=update.end,
    )


class AudioProcessor:
    """Feeds audio chunks to the session's ASR stream in order; publishes how far it has heard."""

    def __init__(
        self, channel: BlockingChannel[AudioChunk], stream: ASRStream, worker: DeviceWorker, emit: Emit,
        memory: TranscriptMemory, on_transcript: Callable[[], None] = lambda: None,
    ) -> None:
        self.channel = channel
        self.stream = stream
        self.worker = worker
        self.emit = emit
        self.memory = memory
        self.on_transcript = on_transcript
        self.heard_until = 0.0  # media seconds of audio the ASR has consumed
        self.finished = False
        self._progress = asyncio.Condition()

    async def run(self) -> None:
        try:
            async for chunk in self.channel:
                updates = await self._step(self.stream.accept, chunk, chunk.start)
                await self._publish(updates, chunk.end)
            updates = await self._step(self.stream.finish, None, self.heard_until)
            await self._publish(updates, self.heard_until)
        finally:
            self.finished = True
            async with self._progress:
                self._progress.notify_all()

    async def _step(self, fn: Callable[..., list[TranscriptUpdate]], arg: object, at: float) -> list[TranscriptUpdate]:
        try:
            return await self.worker.run(Priority.ASR, fn, *([arg] if arg is not None else []))
        except Exception as err:  # one bad chunk costs its own words, not the session
            log.exception("ASR failed")
            await self.emit(error_event(f"speech recognition failed: {err}", code="asr_failed",
                                        type="server_error", media_time=at))
            return []

    async def _publish(self, updates: list[TranscriptUpdate], heard_until: float) -> None:
        for update in updates:
            self.memory.apply(update)
            if update.completed or update.delta or update.unstable:
                await self.emit(transcript_event(update))
        if updates:
            self.on_transcript()
        async with self._progress:
            self.heard_until = max(self.heard_until, heard_until)
            self._progress.notify_all()

    async def caught_up(self, media_time: float) -> None:
        """Wait until the ASR has consumed audio up to `media_time` (or has finished)."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.finished or self.heard_until >= media_time - 1e-9)


class ContextPrefiller:
    """Streaming prefill (Stream2LLM): whenever the transcript or the video memory changes, hand the answerer's
    stream session the new context and prefill it in small worker jobs, so a question later costs only its own
    prefill (and, with video, the change of its memory selection).

    Changes coalesce: while a prefill runs, further updates only mark the context dirty, and the next round
    prefills the latest state (update mode keeps the KV up to the longest common prefix)."""

    def __init__(self, lm_stream: Any, worker: DeviceWorker, memory: TranscriptMemory,
                 video: Any = None, answerer: AnswerBackend | None = None) -> None:
        self.lm_stream = lm_stream
        self.worker = worker
        self.memory = memory
        self.video = video  # runtime.memory.video.VideoMemory, when the model sees
        self.answerer = answerer  # embeds questions for memory selection
        self.dirty = asyncio.Event()
        self.prefilled_tokens = 0
        self.closed = False
        self.selected: list[tuple[float, float]] = []  # segments the last question selected (media spans)
        self.question: str | None = None  # while one is answered, background rounds keep its selection

    def mark_dirty(self) -> None:
        self.dirty.set()

    def end_question(self) -> None:
        """The answer is done: the memory goes back to its own selection."""
        self.question = None
        self.mark_dirty()

    async def run(self) -> None:
        while not self.closed:
            await self.dirty.wait()
            self.dirty.clear()
            await self.catch_up()

    def _suffix(self, question: str | None) -> list[Any] | None:
        """On the worker: the memory suffix from a fresh snapshot; a question selects its segments."""
        if self.video is None:
            return None
        from runtime.models.vlm.prompt import memory_pieces  # lazy: only with a VLM

        snapshot = self.video.snapshot()
        query = self.answerer.embed_text(question) if question and self.answerer is not None else None
        self.selected = []
        if query is not None and snapshot.segments:
            self.selected = [(s.start, s.end) for s in snapshot.select(query)]
        return memory_pieces(snapshot.blocks(query))

    async def catch_up(self, question: str | None = None) -> None:
        """Prefill the current context fully (also called right before answering, with the question, which
        then selects the memory until `end_question`)."""
        if question is not None:
            self.question = question
        suffix = await self.worker.run(Priority.PREFILL, self._suffix, self.question) if self.video else None
        if suffix is None:  # a stream without video takes the transcript alone (AnswerBackend's contract)
            self.lm_stream.set_context(self.memory.context())
        else:
            self.lm_stream.set_context(self.memory.context(), suffix)
        while n := await self.worker.run(Priority.PREFILL, self.lm_stream.prefill_step):
            self.prefilled_tokens += n


@dataclass
class Question:
    text: str
    media_time: float  # media seconds at which it was asked
    hear_until: float  # audio pushed when it was asked: the answer waits for the ASR to reach it
    client_event_id: str | None = None
    response_id: str = field(default_factory=lambda: new_id("resp"))
    asked_wall: float = field(default_factory=time.perf_counter)
    answered: asyncio.Event = field(default_factory=asyncio.Event, compare=False)  # set once its answer ended


class QuestionProcessor:
    """Answers questions one at a time from the transcript so far, streaming each token as it is decoded."""

    def __init__(
        self, channel: BlockingChannel[Question], answerer: AnswerBackend, worker: DeviceWorker, emit: Emit,
        memory: TranscriptMemory, audio: AudioProcessor, lm_stream: Any = None,
        prefiller: ContextPrefiller | None = None,
    ) -> None:
        self.channel = channel
        self.answerer = answerer
        self.lm_stream = lm_stream
        self.prefiller = prefiller
        self.worker = worker
        self.emit = emit
        self.memory = memory
        self.audio = audio
        self.current: Question | None = None
        self._cancelled: set[str] = set()
        self.answered = 0

    def cancel(self, response_id: str | None = None) -> bool:
        """Stop the current answer (or the named one) at its next decode step."""
        if self.current is None or response_id not in (None, self.current.response_id):
            return False
        self._cancelled.add(self.current.response_id)
        return True

    async def run(self) -> None:
        async for question in self.channel:
            self.current = question
            try:
                await self._answer(question)
            finally:
                self.current = None
                self._cancelled.discard(question.response_id)
                self.answered += 1
                question.answered.set()

    async def _answer(self, q: Question) -> None:
        item_id = new_id("item")
        response = {"id": q.response_id, "object": "realtime.response", "status": "in_progress",
                    "question": q.text}
        await self.emit(ResponseCreated(response=response, media_time=q.media_time))
        await self.audio.caught_up(q.hear_until)
        parts: list[str] = []
        status, reason, state, first_token_s, tokens, steps = "completed", None, None, None, 0, 0
        decoding: dict[str, Any] | None = None
        selected: list[tuple[float, float]] = []  # memory segments the question chose
        try:
            if self.prefiller is not None:  # usually only the question's memory selection is left to prefill
                await self.prefiller.catch_up(q.text)
                selected = list(self.prefiller.selected)
            state = await self.worker.run(Priority.PREFILL, self.answerer.start, self.memory.context(), q.text,
                                          stream=self.lm_stream)
            while True:
                if q.response_id in self._cancelled:
                    status, reason = "cancelled", "client_cancelled"
                    break
                step = await self.worker.run(Priority.DECODE, state.step)
                tokens += step.tokens
                steps += 1
                if first_token_s is None:
                    first_token_s = time.perf_counter() - q.asked_wall
                if step.delta:
                    parts.append(step.delta)
                    await self.emit(ResponseTextDelta(response_id=q.response_id, item_id=item_id,
                                                      delta=step.delta, media_time=q.media_time))
                if step.done:
                    if step.finish_reason == "length":
                        status, reason = "incomplete", "max_output_tokens"
                    break
        except Exception as err:
            log.exception("answer failed")
            status, reason = "failed", "error"
            await self.emit(error_event(f"answering failed: {err}", code="response_failed", type="server_error",
                                        client_event_id=q.client_event_id, media_time=q.media_time))
        finally:
            if state is not None:
                decoding = state.stats()
                await self.worker.run(Priority.CONTROL, state.release)
            if self.prefiller is not None:
                self.prefiller.end_question()
        text = "".join(parts)
        await self.emit(ResponseTextDone(response_id=q.response_id, item_id=item_id, text=text,
                                         media_time=q.media_time))
        total_s = time.perf_counter() - q.asked_wall
        response.update(
            status=status,
            status_details={"reason": reason} if reason else None,
            output=[{"id": item_id, "type": "message", "role": "assistant",
                     "content": [{"type": "output_text", "text": text}]}],
            usage={"output_tokens": tokens, "decode_steps": steps},
            timing={"first_token_s": None if first_token_s is None else round(first_token_s, 4),
                    "total_s": round(total_s, 4)},
        )
        if decoding is not None:  # speculative decoding: target forwards, drafted and accepted tokens
            response["decoding"] = decoding
        if self.prefiller is not None and self.prefiller.video is not None:
            response["video"] = {"selected_segments": [[round(a, 3), round(b, 3)] for a, b in selected]}
        await self.emit(ResponseDone(response=response, media_time=q.media_time))
