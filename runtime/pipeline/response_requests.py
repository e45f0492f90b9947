"""Every way a response gets asked for, in one place: `response.create`, a scripted or typed question, and the
end of a turn that turn detection found; and the one way one is cut short by the user speaking (barge-in).

The question queue is bounded: a request that finds it full (or closed) is answered with an `error` event
and dropped; nothing waits for room, so a burst of requests cannot stall the audio or the client's reader.
Turns and scripted questions queue behind the answer in progress; a client's `response.create` is refused while
a response that joins the conversation is queued or running (`active_response`), as the Realtime API refuses it.
"""

from __future__ import annotations

from runtime.channels import BlockingChannel, ChannelClosed
from runtime.events import error_event
from runtime.models.lm.prompt import IDLE_QUESTION
from runtime.pipeline import Emit
from runtime.pipeline.answers import QuestionProcessor
from runtime.pipeline.questions import Question
from runtime.session_config import SessionConfig
from runtime.session_state import AnswerActivity, HeardClock, SessionSettings


class ResponseRequests:
    def __init__(self, questions: BlockingChannel[Question], answers: QuestionProcessor, activity: AnswerActivity,
                 heard: HeardClock, settings: SessionSettings, emit: Emit) -> None:
        self.questions, self.answers, self.activity = questions, answers, activity
        self.heard, self.settings, self.emit = heard, settings, emit
        self._joining: list[Question] = []  # queued or answering, and joining the conversation

    async def request(self, question: Question) -> bool:
        """Queue `question`; False (after an `error` event) when the queue is full or closed."""
        q = self.questions
        if len(q) >= q.capacity or q.closed:
            why = "closed" if q.closed else f"full ({q.capacity} waiting)"
            await self.emit(error_event(f"question queue is {why}; ask again after the current answer",
                                        code="question_queue_full", client_event_id=question.client_event_id,
                                        media_time=question.media_time))
            return False
        self.activity.asked()  # from now on a note waits: the question goes first
        try:
            await q.put(question)
        except ChannelClosed:
            self.activity.ended()
            return False
        if question.in_conversation:  # (pruned here too: a session whose turns answer themselves never asks)
            self._joining = [q for q in self._joining if not q.answered.is_set()] + [question]
        return True

    def active_response(self) -> str | None:
        """The id of a response that will join the conversation and has not ended (queued or answering)."""
        self._joining = [q for q in self._joining if not q.answered.is_set()]
        return self._joining[0].response_id if self._joining else None

    async def turn_ended(self, item_id: str, at: float, settings: SessionConfig | None = None) -> None:
        """Turn detection committed the user's turn: answer it when the session asked for that where the turn
        ended (`settings`, the session's settings then; None: now)."""
        config = settings or self.settings.config
        detection = config.turn_detection
        if detection is not None and detection.create_response:
            await self.request(self._turn_question(at, config))

    def turn_may_end(self, item_id: str, transcript: str) -> None:
        """The user paused and the turn would likely read `transcript`: the answer it would get starts now, when
        nothing else is being answered (`QuestionProcessor.prepare`: kept only if the turn ends as expected)."""
        config = self.settings.config
        detection = config.turn_detection
        if detection is None or not detection.create_response or self.active_response() or len(self.questions):
            return
        at = self.heard.until
        self.answers.prepare(self._turn_question(at, config), item_id, transcript)

    def turn_goes_on(self) -> None:
        self.answers.drop_prepared()

    def _turn_question(self, at: float, config: SessionConfig) -> Question:
        """The response a turn that turn detection ended asks for, under the session's settings `config`."""
        return Question(None, at, at, commits=self.heard.commits, instructions=config.instructions,
                        max_tokens=config.max_output_tokens, tools=config.tools, speech=config.speech())

    async def idle_timeout(self, item_id: str, at: float, settings: SessionConfig | None = None) -> None:
        """Nobody spoke for `idle_timeout_ms` after the last answer: the model speaks up (as the API's does), as
        the session's settings were when it fired (`settings`; None: now)."""
        config = settings or self.settings.config
        await self.request(Question(IDLE_QUESTION, at, at, commits=self.heard.commits, instructions=config.instructions,
                                    max_tokens=config.max_output_tokens, asks_about_stream=False,
                                    speech=config.speech()))

    def speech_started(self) -> None:
        """Barge-in: the user speaking again cuts the answer in progress short, when the session asks for that."""
        detection = self.settings.config.turn_detection
        if detection is not None and detection.interrupt_response:
            self.answers.barge_in()  # cancels the answer in progress; truncates a spoken one to what was heard
