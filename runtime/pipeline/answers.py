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
from runtime.events import (
    ContentPartAdded,
    ContentPartDone,
    ItemAdded,
    ItemDone,
    OutputItemAdded,
    OutputItemDone,
    ResponseCreated,
    ResponseDone,
    ResponseTextDelta,
    ResponseTextDone,
    error_event,
    new_id,
)
from runtime.memory.conversation import Conversation, Item
from runtime.models.lm.backend import Answer, AnswerBackend, DecodingStats, LMStream
from runtime.pipeline import Emit
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)


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
    """One request for a response: `response.create`, a scripted or typed question, or the end of a turn."""

    text: str | None  # None: what the user said or typed since the last answer, read when the answer starts
    media_time: float  # media seconds at which it was asked
    hear_until: float  # audio pushed when it was asked: the answer waits for the ASR to reach it
    client_event_id: str | None = None
    commits: int = 0  # commits asked for before it: the answer waits for their transcripts to complete
    instructions: str = ""  # the session's and the request's, given with the question
    max_tokens: int | None = None
    in_conversation: bool = True  # False (`conversation: "none"`): the answer is not added to the conversation
    record_question: bool = False  # a question from a script or the terminal joins the conversation with its answer
    metadata: dict[str, object] | None = None
    response_id: str = field(default_factory=lambda: new_id("resp"))
    asked_wall: float = field(default_factory=time.perf_counter)
    answered: asyncio.Event = field(default_factory=asyncio.Event, compare=False)  # set once its answer ended

    def prompt(self, text: str) -> str:
        return f"{text}\n\nInstructions: {self.instructions}" if self.instructions else text


class QuestionProcessor:
    """Answers questions one at a time from the conversation so far, streaming each token as it is decoded."""

    def __init__(self, channel: BlockingChannel[Question], answerer: AnswerBackend, worker: DeviceWorker,
                 emit: Emit, conversation: Conversation, heard: HeardClock, activity: AnswerActivity,
                 changes: ContextChanges, *, lm_stream: LMStream | None = None,
                 prefiller: QuestionPrefill | None = None) -> None:
        self.channel, self.answerer, self.worker, self.emit = channel, answerer, worker, emit
        self.conversation, self.heard, self.activity, self.changes = conversation, heard, activity, changes
        self.lm_stream, self.prefiller = lm_stream, prefiller
        self.current: Question | None = None
        self._cancelled: dict[str, str] = {}  # response id -> why
        self.answered = 0

    def cancel(self, response_id: str | None = None, reason: str = "client_cancelled") -> bool:
        """Stop the current answer (or the named one) at its next decode step."""
        if self.current is None or response_id not in (None, self.current.response_id):
            return False
        self._cancelled.setdefault(self.current.response_id, reason)
        return True

    async def run(self) -> None:
        async for question in self.channel:
            self.current = question
            try:
                await self._answer(question)
            finally:
                self.current = None
                self._cancelled.pop(question.response_id, None)
                self.answered += 1
                self.activity.ended(at=self.heard.until)
                question.answered.set()

    async def _answer(self, q: Question) -> None:
        item = Item(new_id("item"), q.media_time, q.media_time, role="assistant", audio=False, status="in_progress")
        response: dict[str, object] = {
            "id": q.response_id, "object": "realtime.response", "status": "in_progress", "output": [],
            "conversation_id": "auto" if q.in_conversation else None, "output_modalities": ["text"],
            "max_output_tokens": "inf" if q.max_tokens is None else q.max_tokens, "metadata": q.metadata}
        if q.text is not None:
            response["question"] = q.text
        # A copy: `response` is completed below, and a consumer reading this event later must see it in progress.
        await self.emit(ResponseCreated(response=dict(response), media_time=q.media_time))
        await self.heard.reached(q.hear_until, q.commits)
        question = q.text if q.text is not None else self.conversation.pending_user_text()
        if q.in_conversation:
            self.conversation.add(item)
        previous = self.conversation.previous_id(item.item_id) if q.in_conversation else None
        await self.emit(OutputItemAdded(response_id=q.response_id, item=item.to_api(), media_time=q.media_time))
        if q.in_conversation:
            await self.emit(ItemAdded(item=item.to_api(), previous_item_id=previous, media_time=q.media_time))
        await self.emit(ContentPartAdded(response_id=q.response_id, item_id=item.item_id,
                                         part={"type": "text", "text": ""}, media_time=q.media_time))
        parts: list[str] = []
        status, details, first_token_s, tokens, steps, prompt_tokens = "completed", None, None, 0, 0, 0
        answer: Answer | None = None
        decoding: DecodingStats | None = None
        selected: list[tuple[float, float]] = []  # memory segments the question chose
        try:
            if not question.strip():
                raise NothingToAnswer("nothing to answer: no user message since the last answer")
            if self.prefiller is not None:  # usually only the question's memory selection is left to prefill
                await self.prefiller.catch_up(question)
                selected = list(self.prefiller.selected)
            answer = await self.worker.run(Priority.PREFILL, self.answerer.start, self.conversation.context(),
                                           q.prompt(question), stream=self.lm_stream, max_tokens=q.max_tokens)
            prompt_tokens = len(answer.prompt_ids)
            while True:
                if q.response_id in self._cancelled:
                    status, details = "cancelled", {"type": "cancelled", "reason": self._cancelled[q.response_id]}
                    break
                step = await self.worker.run(Priority.DECODE, answer.step)
                tokens += step.tokens
                steps += 1
                if first_token_s is None:
                    first_token_s = time.perf_counter() - q.asked_wall
                if step.delta:
                    parts.append(step.delta)
                    await self.emit(ResponseTextDelta(response_id=q.response_id, item_id=item.item_id,
                                                      delta=step.delta, media_time=q.media_time))
                if step.done:
                    if step.finish_reason == "length":
                        status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
                    break
        except Exception as err:
            if not isinstance(err, NothingToAnswer):
                log.exception("answer failed")
            code = "no_input" if isinstance(err, NothingToAnswer) else "response_failed"
            status, details = "failed", {"type": "failed", "error": {"type": "server_error", "code": code,
                                                                    "message": str(err)}}
            await self.emit(error_event(str(err) if code == "no_input" else f"answering failed: {err}", code=code,
                                        type="invalid_request_error" if code == "no_input" else "server_error",
                                        client_event_id=q.client_event_id, media_time=q.media_time))
        finally:
            if answer is not None:
                decoding = await self.worker.run(Priority.CONTROL, answer.stats)
                await self.worker.run(Priority.CONTROL, answer.release)
            if self.prefiller is not None:
                self.prefiller.end_question()
        text = "".join(parts)
        item.stable, item.completed = text, True
        item.status = "completed" if status == "completed" else "incomplete"
        if q.in_conversation:
            if q.record_question and question.strip():  # the question goes before its answer
                asked = Item(new_id("item"), q.media_time, q.media_time, audio=False, stable=question, completed=True)
                before = self.conversation.add(asked, after=previous or "root")
                for kind in (ItemAdded, ItemDone):
                    await self.emit(kind(item=asked.to_api(), previous_item_id=before, media_time=q.media_time))
            self.changes.mark()  # the answer (and its question) join the context
        await self.emit(ResponseTextDone(response_id=q.response_id, item_id=item.item_id, text=text,
                                         media_time=q.media_time))
        await self.emit(ContentPartDone(response_id=q.response_id, item_id=item.item_id,
                                        part={"type": "text", "text": text}, media_time=q.media_time))
        await self.emit(OutputItemDone(response_id=q.response_id, item=item.to_api(), media_time=q.media_time))
        if q.in_conversation:
            await self.emit(ItemDone(item=item.to_api(), previous_item_id=self.conversation.previous_id(item.item_id),
                                     media_time=q.media_time))
        total_s = time.perf_counter() - q.asked_wall
        response.update(
            status=status,
            status_details=details,
            output=[item.to_api()],
            usage={"total_tokens": prompt_tokens + tokens, "input_tokens": prompt_tokens, "output_tokens": tokens,
                   "decode_steps": steps},
            timing={"first_token_s": None if first_token_s is None else round(first_token_s, 4),
                    "total_s": round(total_s, 4)},
        )
        if decoding is not None:  # speculative decoding: target forwards, drafted and accepted tokens
            response["decoding"] = decoding
        if self.prefiller is not None and self.prefiller.sees_video:
            response["video"] = {"selected_segments": [[round(a, 3), round(b, 3)] for a, b in selected]}
        await self.emit(ResponseDone(response=response, media_time=q.media_time))


class NothingToAnswer(ValueError):
    """A response was asked for with no user message since the last answer."""
