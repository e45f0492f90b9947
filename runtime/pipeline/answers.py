"""Questions in, answers out: one at a time, each token streamed the moment it is decoded.

An answer waits for the words spoken before its question (`HeardClock`), lets the prefiller finish the
context (with the question choosing the video memory's segments), prefills itself as one worker job, then
decodes one (speculative) step per job: ASR chunks overtake decoding between tokens, and a cancel lands within
one step. What the answer reads is a `ContextSource`: today the transcript; the seam where a conversation of
items will plug in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from runtime.channels import BlockingChannel
from runtime.events import ResponseCreated, ResponseDone, ResponseTextDelta, ResponseTextDone, error_event, new_id
from runtime.models.lm.backend import Answer, AnswerBackend, DecodingStats, LMStream
from runtime.pipeline import Emit
from runtime.session_state import AnswerActivity, HeardClock
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)


class ContextSource(Protocol):
    """What an answer reads besides its question (the transcript so far)."""

    def context(self) -> str: ...


class QuestionPrefill(Protocol):
    """What an answer needs of the prefiller (`prefill.ContextPrefiller`): the context caught up with the
    question choosing the video memory's segments, which it keeps until `end_question`."""

    selected: list[tuple[float, float]]  # media spans the last question selected

    @property
    def sees_video(self) -> bool: ...

    async def catch_up(self, question: str | None = None) -> None: ...

    def end_question(self) -> None: ...


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

    def __init__(self, channel: BlockingChannel[Question], answerer: AnswerBackend, worker: DeviceWorker,
                 emit: Emit, context: ContextSource, heard: HeardClock, activity: AnswerActivity, *,
                 lm_stream: LMStream | None = None, prefiller: QuestionPrefill | None = None) -> None:
        self.channel, self.answerer, self.worker, self.emit = channel, answerer, worker, emit
        self.context, self.heard, self.activity = context, heard, activity
        self.lm_stream, self.prefiller = lm_stream, prefiller
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
                self.activity.ended()
                question.answered.set()

    async def _answer(self, q: Question) -> None:
        item_id = new_id("item")
        response: dict[str, object] = {"id": q.response_id, "object": "realtime.response",
                                       "status": "in_progress", "question": q.text}
        # A copy: `response` is completed below, and a consumer reading this event later must see it in progress.
        await self.emit(ResponseCreated(response=dict(response), media_time=q.media_time))
        await self.heard.reached(q.hear_until)
        parts: list[str] = []
        status, reason, first_token_s, tokens, steps = "completed", None, None, 0, 0
        answer: Answer | None = None
        decoding: DecodingStats | None = None
        selected: list[tuple[float, float]] = []  # memory segments the question chose
        try:
            if self.prefiller is not None:  # usually only the question's memory selection is left to prefill
                await self.prefiller.catch_up(q.text)
                selected = list(self.prefiller.selected)
            answer = await self.worker.run(Priority.PREFILL, self.answerer.start, self.context.context(), q.text,
                                           stream=self.lm_stream)
            while True:
                if q.response_id in self._cancelled:
                    status, reason = "cancelled", "client_cancelled"
                    break
                step = await self.worker.run(Priority.DECODE, answer.step)
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
            if answer is not None:
                decoding = await self.worker.run(Priority.CONTROL, answer.stats)
                await self.worker.run(Priority.CONTROL, answer.release)
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
        if self.prefiller is not None and self.prefiller.sees_video:
            response["video"] = {"selected_segments": [[round(a, 3), round(b, 3)] for a, b in selected]}
        await self.emit(ResponseDone(response=response, media_time=q.media_time))
