"""Questions in, answers out: one at a time, each token streamed the moment it is decoded.

An answer waits for the words spoken before its question (`HeardClock`), lets the prefiller finish the
context (with the question choosing the video memory's segments), then asks its `Answering` for an answer and
awaits one step at a time: a local backend runs each step as a worker job (ASR chunks overtake decoding between
tokens), a remote one streams from its server. A cancel does not wait for the step in flight. What the answer
reads is the conversation; what it says (text, function calls) becomes the response's items (`ResponseOutput`).

Two answers are given without asking the model, since it would only guess: a question about the screen in a
session that cannot see it (`sees_screen` false: no screen reader and no video memory) is told so
(`memory/screen_questions.py`), and with `grounding` a question nothing heard or shown mentions yet, or one about
the screen before any text on it was read, is "not known yet" (`memory/grounding.py`).

What a question is, and what the model is asked for it (with `continues`, no new user message): `questions.py`.

A turn's answer may be started before the turn has ended (`prepare`): while the turn rule times the user's pause,
the audio processor knows the turn's likely final words, and the request the answer will make is built from the
conversation as the commit will leave it and handed to an answerer that can prepare (`Preparing`); the answer after
the commit gets that start when its request is the very same. Voice-to-voice latency is why: the prefill of the
question then happens inside the 500 ms of silence instead of after it.

Spoken answers (`speech`, with the session's `Speaker`) and barge-in: `barge_in` (speech started while the agent
speaks) cancels the answer in progress and, once it has ended, truncates its spoken message to what the client had
played (`spoken_output.SpokenAudio.heard_ms`), with `conversation.item.truncated`; an answer that already ended but
whose audio the client is still playing by that rule is truncated the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol, TypeVar

from runtime.channels import BlockingChannel
from runtime.errors import RequestError
from runtime.events import ItemAdded, ItemDone, ItemTruncated, ResponseCreated, ResponseDone, error_event, new_id
from runtime.memory.conversation import Conversation, Item
from runtime.memory.grounding import Grounding, not_known_answer
from runtime.memory.screen_questions import CANNOT_SEE_SCREEN, NOTHING_READ_YET, asks_about_screen
from runtime.models.lm.answering import Answering, AnswerRequest, Preparing, RunningAnswer, Step, TextAnswer
from runtime.models.lm.backend import DecodingStats
from runtime.models.lm.remote_answerer import RemoteError
from runtime.pipeline import Emit
from runtime.pipeline.questions import CONTINUE_QUESTION, OPENING_QUESTION, Question, answer_request
from runtime.pipeline.response_output import ResponseOutput
from runtime.pipeline.spoken_output import Speaker, SpokenAudio
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock

log = logging.getLogger(__name__)
T = TypeVar("T")


class QuestionPrefill(Protocol):
    """What an answer needs of the prefiller (`prefill.ContextPrefiller`): the context caught up with the
    question choosing the video memory's segments, which it keeps until `end_question`."""

    selected: list[tuple[float, float]]  # media spans the last question selected

    @property
    def sees_video(self) -> bool: ...

    async def catch_up(self, question: str | None = None) -> None: ...

    def end_question(self) -> None: ...


class QuestionProcessor:
    """Answers questions one at a time from the conversation so far, streaming each token as it is decoded."""

    def __init__(self, channel: BlockingChannel[Question], answering: Answering, emit: Emit,
                 conversation: Conversation, heard: HeardClock, activity: AnswerActivity, changes: ContextChanges, *,
                 prefiller: QuestionPrefill | None = None, grounding: Grounding | None = None,
                 sees_screen: bool = True, speaker: Speaker | None = None) -> None:
        self.channel, self.answering, self.emit = channel, answering, emit
        self.conversation, self.heard, self.activity, self.changes = conversation, heard, activity, changes
        self.prefiller = prefiller
        self.grounding = grounding  # with it, a question nothing heard or shown mentions is "not known yet"
        # False: the session has no screen reader and no video memory, so a question about the screen is told that
        # it cannot be seen (the session builder says which; a test's processor sees by default)
        self.sees_screen = sees_screen
        self.speaker = speaker  # the session's voice (None: answers are text whatever is asked)
        self.current: Question | None = None
        self.output: ResponseOutput | None = None  # the current answer's output
        self.last_spoken: tuple[Item, SpokenAudio] | None = None  # the newest spoken message that ended
        self._barge_at: dict[str, float] = {}  # response id -> input media time at which speech cut it short
        self._truncating: set[asyncio.Task[None]] = set()
        self._cancelled: dict[str, str] = {}  # response id -> why
        self._cancel_signal = asyncio.Event()  # set while the current answer is cancelled
        self._closing: set[asyncio.Future[object]] = set()  # answers started after their cancel, being closed
        self.answered = 0

    def cancel(self, response_id: str | None = None, reason: str = "client_cancelled") -> bool:
        """Stop the current answer (or the named one) now: a step in flight is dropped."""
        if self.current is None or response_id not in (None, self.current.response_id):
            return False
        self._cancelled.setdefault(self.current.response_id, reason)
        self._cancel_signal.set()
        return True

    def barge_in(self) -> None:
        """Speech started while the agent may be speaking: the answer in progress is cancelled (and truncated to what
        was heard once it ends, in `_answer`); an ended spoken message the client is still playing is truncated."""
        at = self.heard.until
        if self.current is not None and self.cancel(reason="turn_detected"):
            self._barge_at.setdefault(self.current.response_id, at)
        if self.last_spoken is not None:
            item, spoken = self.last_spoken
            heard = spoken.heard_ms(at)
            if heard < spoken.track.duration_ms:
                self.last_spoken = None
                task = asyncio.create_task(self._truncate(item, heard))
                self._truncating.add(task)
                task.add_done_callback(self._truncating.discard)

    def prepare(self, q: Question, item_id: str, transcript: str) -> None:
        """Start on the answer a turn would get were it to end now with `transcript` as its item's final text, while
        the turn rule still times the pause: the request is built as `_answer` builds it, from the conversation as
        it would then be (`Conversation.as_if_completed`), and the answerer prepares it (`Preparing`). The answer
        after the commit uses it when its request is the same (the transcript as expected, nothing else said or
        shown meanwhile); otherwise it is dropped. Only in the plain case, where `_answer` asks the model at once:
        no answer in progress, no tools or calls, no grounding, video memory or screen question (those decide
        more before the model is asked)."""
        answering = self.answering
        if self.current is not None or not isinstance(answering, Preparing) or q.tools.tools:
            return
        if self.grounding is not None or (self.prefiller is not None and self.prefiller.sees_video):
            return
        conversation = self.conversation.as_if_completed(item_id, transcript)
        question = " ".join(it.text for it in conversation.pending_user_items())
        if not question.strip() or conversation.calls_since_user() or asks_about_screen(question):
            return
        answering.prepare(answer_request(q, question, [], conversation))

    def drop_prepared(self) -> None:
        """What `prepare` started no longer holds (the user spoke on)."""
        if isinstance(self.answering, Preparing):
            self.answering.drop_prepared()

    async def _truncate(self, item: Item, audio_end_ms: int) -> None:
        """Cut a spoken assistant message to `audio_end_ms` (the server's own truncation, at a barge-in)."""
        if item.spoken is None or self.conversation.get(item.item_id) is None:
            return  # deleted meanwhile
        item.stable, item.unstable = item.spoken.cut(audio_end_ms), ""
        self.changes.mark()
        await self.emit(ItemTruncated(item_id=item.item_id, audio_end_ms=audio_end_ms, media_time=self.heard.until))

    async def run(self) -> None:
        try:
            await self._answer_all()
        finally:
            self.drop_prepared()

    async def _answer_all(self) -> None:
        async for question in self.channel:
            self.current = question
            try:
                await self._answer(question)
            finally:
                if self.output is not None:
                    self.output.abort()  # only does something when the answer itself was cancelled
                self.current = self.output = None
                self._cancelled.pop(question.response_id, None)
                self._barge_at.pop(question.response_id, None)
                self._cancel_signal.clear()
                self.answered += 1
                self.activity.ended(at=self.heard.until)
                question.answered.set()

    async def _answer(self, q: Question) -> None:
        speech = q.speech if self.speaker is not None else None
        response: dict[str, object] = {
            "id": q.response_id, "object": "realtime.response", "status": "in_progress", "output": [],
            "conversation_id": "auto" if q.in_conversation else None,
            "output_modalities": ["audio"] if speech else ["text"],
            "max_output_tokens": "inf" if q.max_tokens is None else q.max_tokens, "metadata": q.metadata}
        if speech is not None:
            response["audio"] = {"output": {"format": speech.format.to_dict(), "voice": speech.voice}}
        if q.text is not None:
            response["question"] = q.text
        # A copy: `response` is completed below, and a consumer reading this event later must see it in progress.
        await self.emit(ResponseCreated(response=dict(response), media_time=q.media_time))
        await self.heard.reached(q.hear_until, q.commits)
        asked = self.conversation.pending_user_items() if q.text is None else [
            it for it in map(self.conversation.get, q.input_items) if it is not None]
        question = q.text if q.text is not None else " ".join(it.text for it in asked)
        calls = self.conversation.calls_since_user() if q.text is None else []
        items = self.conversation.items
        output = ResponseOutput(q.response_id, q.media_time, q.in_conversation, self.conversation, self.emit,
                                anchor=items[-1].item_id if items else None,
                                fallback=next((it.item_id for it in reversed(items) if it.in_api), None),
                                speaker=self.speaker, speech=speech)
        self.output = output
        status, details, first_token_s, tokens, steps, prompt_tokens = "completed", None, None, 0, 0, 0
        answer: RunningAnswer | None = None
        decoding: DecodingStats | None = None
        selected: list[tuple[float, float]] = []  # memory segments the question chose
        not_heard: list[str] = []  # with `grounding`: the question's words that nothing heard or shown mentions
        unseen = unread = False  # a screen question the session cannot see / has read no text for yet
        given: str | None = None  # the answer given without asking the model
        opens = q.continues and not question.strip() and not calls  # answered from the conversation as it is
        if opens:
            question = CONTINUE_QUESTION if any(it.in_api for it in items) else OPENING_QUESTION
        try:
            if not question.strip():
                raise NothingToAnswer("nothing to answer: no user message since the last answer")
            # with tools, a function may know what the stream does not; continuing calls, its output answers
            if q.asks_about_stream and not q.tools.active and not calls and not opens:
                screen_question = asks_about_screen(question)
                unseen = screen_question and not self.sees_screen
                if self.grounding is not None and not unseen:
                    unread = screen_question and self.grounding.nothing_read_on_screen()
                    # a turn of several typed messages: the earlier ones tell, only the last one asks
                    not_heard = [] if unread else self.grounding.not_heard(question, asked[-1:], q.instructions)
            given = (CANNOT_SEE_SCREEN if unseen else NOTHING_READ_YET if unread
                     else not_known_answer(not_heard) if not_heard else None)
            # usually only the question's memory selection is left to prefill
            if self.prefiller is not None and given is None:
                await self.prefiller.catch_up(question)
                selected = list(self.prefiller.selected)
            request = answer_request(q, question, calls, self.conversation)
            if given is not None:  # the model is not asked: it would guess
                answer = TextAnswer(given)
            else:
                answer = await self._start_or_cancel(request, q.response_id)
            prompt_tokens = answer.prompt_tokens if answer is not None else 0
            while answer is not None:
                step = await self._step_or_cancel(answer, q.response_id)
                if step is None:
                    status, details = "cancelled", {"type": "cancelled", "reason": self._cancelled[q.response_id]}
                    break
                tokens += step.tokens
                steps += 1
                if first_token_s is None and step.tokens:  # a server's chunks without a token do not count
                    first_token_s = time.perf_counter() - q.asked_wall
                if step.call is not None:
                    await output.add_call(step.call)
                if step.text:
                    await output.add_text(step.text)
                if step.done:
                    if step.finish_reason == "length":
                        status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
                    break
            if answer is None:  # cancelled before it started
                status, details = "cancelled", {"type": "cancelled", "reason": self._cancelled[q.response_id]}
            else:
                prompt_tokens = answer.prompt_tokens or prompt_tokens  # a server reports it with its last chunk
        except Exception as err:
            # the client's to fix (nothing to answer, a question or instructions too long, a schema the decoder
            # cannot use): its own code, no traceback; anything else is the server's
            client = isinstance(err, NothingToAnswer | RequestError)
            if not client and not isinstance(err, RemoteError):
                log.exception("answer failed")
            code = ("no_pending_item" if isinstance(err, NothingToAnswer)
                    else err.code if isinstance(err, RequestError) else "response_failed")
            kind = "invalid_request_error" if client else "server_error"
            status, details = "failed", {"type": "failed", "error": {"type": kind, "code": code, "message": str(err)}}
            await self.emit(error_event(str(err) if client else f"answering failed: {err}", code=code, type=kind,
                                        client_event_id=q.client_event_id, media_time=q.media_time))
        finally:
            if answer is not None:
                decoding = await answer.close()
            if self.prefiller is not None:
                self.prefiller.end_question()
        # A response that failed before it said anything adds nothing: no empty assistant item, so the user's turn
        # is still the one to answer when the client retries. Any other response has an output item, an empty
        # message at least.
        items: list[Item] = []
        if output.items or status != "failed":
            if not output.items:
                await output.add_text("")
            if q.in_conversation and q.record_question and question.strip():  # the question goes before its answer
                recorded = Item(new_id("item"), q.media_time, q.media_time, audio=False, stable=question,
                                completed=True, question=True)
                before = self.conversation.add(recorded,
                                               after=self.conversation.line_before(output.items[0].item_id))
                for kind in (ItemAdded, ItemDone):
                    await self.emit(kind(item=recorded.to_api(), previous_item_id=before, media_time=q.media_time))
            items = await output.finish(completed=status == "completed", cut_short=status in ("cancelled", "failed"))
        if q.in_conversation:
            self.changes.mark()  # the answer (and its question) join the context
        total_s = time.perf_counter() - q.asked_wall
        response.update(
            status=status,
            status_details=details,
            output=[item.to_api() for item in items],
            usage={"total_tokens": prompt_tokens + tokens, "input_tokens": prompt_tokens, "output_tokens": tokens,
                   "decode_steps": 0 if given is not None else steps},
            timing={"first_token_s": None if first_token_s is None else round(first_token_s, 4),
                    "total_s": round(total_s, 4)},
        )
        if decoding is not None:  # speculative decoding: target forwards, drafted and accepted tokens
            response["decoding"] = decoding
        if not_heard or unread:
            response["grounding"] = {"not_heard": not_heard, **({"screen": "unread"} if unread else {})}
        if unseen:
            response["screen"] = "unseen"
        if self.prefiller is not None and self.prefiller.sees_video:
            response["video"] = {"selected_segments": [[round(a, 3), round(b, 3)] for a, b in selected]}
        # Ended before response.done is sent: a client may send the next response.create the moment it reads it, and
        # that must not find this one still active (conversation_already_has_active_response, with no done to come)
        q.answered.set()
        await self.emit(ResponseDone(response=response, media_time=q.media_time))
        if output.spoken is not None and output.message is not None and q.in_conversation:
            barged = self._barge_at.get(q.response_id)
            if barged is not None:  # cut short by the user speaking: keep what was heard
                await self._truncate(output.message, output.spoken.heard_ms(barged))
            else:
                self.last_spoken = (output.message, output.spoken)

    async def _start_or_cancel(self, request: AnswerRequest, response_id: str) -> RunningAnswer | None:
        """The started answer, or None once the response is cancelled: a cancel does not wait for a start in
        flight (a server's connect retries, a local prefill); a start that completes after it is closed then."""
        if response_id in self._cancelled:  # cancelled while it waited for the words before it
            return None
        start = asyncio.ensure_future(self.answering.start(request))
        started = False
        try:
            started = await self._before_cancel(start, response_id)
        finally:
            if not started:
                self._closing.add(start)
                start.add_done_callback(self._close_unused)
        return start.result() if started else None

    def _close_unused(self, start: asyncio.Future[RunningAnswer]) -> None:
        self._closing.discard(start)
        if not start.cancelled() and start.exception() is None:
            closing = asyncio.ensure_future(start.result().close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def _step_or_cancel(self, answer: RunningAnswer, response_id: str) -> Step | None:
        """The answer's next step, or None once the response is cancelled: a cancel does not wait for a step in
        flight (a remote server may take its time), the step is dropped and the answer closed."""
        step = asyncio.ensure_future(answer.step())
        try:
            if await self._before_cancel(step, response_id):
                return step.result()
            return None
        finally:
            if not step.done():  # cancelled, or the session is stopping: the step in flight is dropped
                step.cancel()
                step.add_done_callback(_retrieved)

    async def _before_cancel(self, work: asyncio.Future[T], response_id: str) -> bool:
        """Whether `work` finished before the response was cancelled (`work` itself is left as it is)."""
        if response_id in self._cancelled:
            return False
        cancelled = asyncio.ensure_future(self._cancel_signal.wait())
        try:
            await asyncio.wait((work, cancelled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        return work.done()


def _retrieved(future: asyncio.Future[object]) -> None:
    """A dropped step's outcome is read, so an error it ended with is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


class NothingToAnswer(ValueError):
    """A response was asked for with no user message since the last answer."""
