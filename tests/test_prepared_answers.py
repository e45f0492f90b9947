"""An answer prepared while the user's pause is timed (`OnWorker.prepare`, `QuestionProcessor.prepare`): the
request prepared from the conversation as the turn would leave it equals the one the turn's answer makes after the
commit; a start with that request gets the prepared answer, any other request (or the user speaking on) releases
it before anything else starts on the stream."""

import asyncio
import threading

import pytest
from session_fakes import TwoStepAnswer

from runtime.channels import BlockingChannel
from runtime.function_tools import ToolUse, parse_tools
from runtime.memory.conversation import Conversation, Item
from runtime.memory.screen_notes import ScreenNotes
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.lm.answering import AnswerRequest, Preparing, Step, TextAnswer
from runtime.models.lm.backend import AnswerStep
from runtime.models.tts.clauses import split_clauses
from runtime.pipeline.answers import QuestionProcessor
from runtime.pipeline.local_answers import OnWorker
from runtime.pipeline.questions import Question
from runtime.pipeline.screen import NotesWithQuestion
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock
from runtime.worker import DeviceWorker, Priority


class _Backend:
    """Logs each start (its context and question) and each release, in the order the worker ran them."""

    name = "logging"

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> TwoStepAnswer:
        self.log.append(("start", question))
        answer = TwoStepAnswer([])
        answer.release = lambda: self.log.append(("release", question))  # type: ignore[method-assign]
        return answer


def _request(question: str, **kw) -> AnswerRequest:
    return AnswerRequest("[00:01.0] what is the plan", question, 32, **kw)


@pytest.mark.asyncio
async def test_a_start_with_the_prepared_request_gets_the_prepared_answer():
    backend = _Backend()
    with DeviceWorker() as worker:
        answering = OnWorker(backend, worker)
        answering.prepare(_request("what is the plan"))
        running = await answering.start(_request("what is the plan"))
        assert backend.log == [("start", "what is the plan")] and answering.prepared_used == 1
        assert (await running.step()).text == "a "
        await running.close()
    assert backend.log[-1] == ("release", "what is the plan")


@pytest.mark.asyncio
async def test_another_request_or_speech_that_goes_on_releases_it_before_the_next_start():
    backend = _Backend()
    with DeviceWorker() as worker:
        answering = OnWorker(backend, worker)
        answering.prepare(_request("what is the plan"))
        running = await answering.start(_request("what is the plan today"))  # the turn said more
        await running.close()
        answering.prepare(_request("hello"))
        answering.drop_prepared()
        running = await answering.start(_request("hello again"))
        await running.close()
    assert backend.log == [("start", "what is the plan"), ("release", "what is the plan"),
                           ("start", "what is the plan today"), ("release", "what is the plan today"),
                           ("start", "hello"), ("release", "hello"), ("start", "hello again"),
                           ("release", "hello again")]
    assert answering.prepared_used == 0 and answering.prepared_dropped == 2


@pytest.mark.asyncio
async def test_a_request_with_tools_is_not_prepared():
    backend = _Backend()
    with DeviceWorker() as worker:
        answering = OnWorker(backend, worker)
        tools = ToolUse(parse_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tools"))
        answering.prepare(_request("what is the plan", tools=tools))
        running = await answering.start(_request("what is the plan"))
        await running.close()
    assert backend.log == [("start", "what is the plan"), ("release", "what is the plan")]


class _WordsAnswer:
    """Says `text` a word a step, logging each step; `fail_at` makes that step raise."""

    prompt_ids = [1]  # noqa: RUF012 - read only

    def __init__(self, text: str, log: list[str], fail_at: int | None = None) -> None:
        self.words, self.log, self.fail_at = [w + " " for w in text.split()], log, fail_at
        self.words[-1] = self.words[-1].rstrip()
        self.i = 0

    def step(self) -> AnswerStep:
        if self.i == self.fail_at:
            raise RuntimeError("step failed")
        self.i += 1
        self.log.append(f"step {self.i}")
        done = self.i >= len(self.words)
        return AnswerStep(self.words[self.i - 1] if self.i <= len(self.words) else "", done, "stop" if done else None)

    def release(self) -> None:
        self.log.append("release")

    def stats(self) -> None:
        return None


class _WordsBackend:
    name = "words"

    def __init__(self, text: str, fail_at: int | None = None) -> None:
        self.text, self.fail_at, self.log = text, fail_at, []

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> _WordsAnswer:
        self.log.append("start")
        return _WordsAnswer(self.text, self.log, self.fail_at)


ANSWER = "The train to Boston leaves at seven from platform four."


async def _all_steps(running) -> list[Step]:
    steps = [await running.step()]
    while not steps[-1].done:
        steps.append(await running.step())
    await running.close()
    return steps


@pytest.mark.asyncio
async def test_a_prepared_answer_decodes_its_first_clause_ahead_and_then_goes_on_as_unprepared():
    plain, ahead = _WordsBackend(ANSWER), _WordsBackend(ANSWER)
    with DeviceWorker() as worker:
        unprepared = await _all_steps(await OnWorker(plain, worker).start(_request("when")))
        answering = OnWorker(ahead, worker)
        answering.prepare(_request("when"))
        for _ in range(200):  # the pause: the steps ahead run until the first clause is written
            await asyncio.sleep(0.005)
        before_start = list(ahead.log)
        prepared = await _all_steps(await answering.start(_request("when")))
    # the first clause by the voice's rule: "The train to Boston" (3 words at least, not ending on a function word)
    first = split_clauses(ANSWER)[0]
    assert first == "The train to Boston" and before_start == ["start", "step 1", "step 2", "step 3", "step 4"]
    assert answering.steps_decoded_ahead == 4 and answering.prepared_used == 1
    assert prepared == unprepared and "".join(s.text for s in prepared) == ANSWER
    assert ahead.log == plain.log  # every step once, then the release


@pytest.mark.asyncio
async def test_steps_ahead_stop_at_the_cap_and_when_the_preparation_is_dropped():
    backend = _WordsBackend("one two three four five six seven eight")
    with DeviceWorker() as worker:
        answering = OnWorker(backend, worker, steps_ahead=2)
        answering.prepare(_request("count"))
        for _ in range(100):
            await asyncio.sleep(0.005)
        assert backend.log == ["start", "step 1", "step 2"]
        answering.drop_prepared()
        running = await answering.start(_request("count again"))
        await running.close()
    assert backend.log == ["start", "step 1", "step 2", "release", "start", "release"]


@pytest.mark.asyncio
async def test_a_step_ahead_that_fails_releases_and_the_start_begins_again():
    backend = _WordsBackend(ANSWER, fail_at=1)  # its second step fails
    with DeviceWorker() as worker:
        answering = OnWorker(backend, worker)
        answering.prepare(_request("when"))
        for _ in range(100):
            await asyncio.sleep(0.005)
        running = await answering.start(_request("when"))
        assert (await running.step()).text == "The "
        with pytest.raises(RuntimeError, match="step failed"):  # the fresh start's own error, at its own step
            await running.step()
        await running.close()
    assert backend.log == ["start", "step 1", "release", "start", "step 1", "release"]
    assert answering.prepared_used == 0


@pytest.mark.asyncio
async def test_a_start_cancelled_while_its_preparation_runs_still_releases_the_answer():
    backend = _WordsBackend(ANSWER)
    with DeviceWorker() as worker:
        answering = OnWorker(backend, worker)
        answering.prepare(_request("when"))
        start = asyncio.ensure_future(answering.start(_request("when")))
        await asyncio.sleep(0)  # the start is waiting for the preparation
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        for _ in range(200):
            if "release" in backend.log:
                break
            await asyncio.sleep(0.005)
    assert backend.log[0] == "start" and backend.log[-1] == "release" and backend.log.count("release") == 1


class _BusyAfterFirstStep(_WordsBackend):
    """Its answers' first step hands the worker a job that holds it until `free` is set (another conversation's
    clause being synthesised, say): the step ahead that follows waits in the queue behind it."""

    def __init__(self, text: str, worker: DeviceWorker) -> None:
        super().__init__(text)
        self.worker, self.free = worker, threading.Event()

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> _WordsAnswer:
        answer = super().start(context, question)
        step = answer.step

        def first_then_busy() -> AnswerStep:
            out = step()
            if answer.i == 1:
                self.worker.submit(Priority.SPEECH, self.free.wait)
            return out

        answer.step = first_then_busy  # type: ignore[method-assign]
        return answer


@pytest.mark.asyncio
async def test_a_step_ahead_still_queued_at_the_start_is_withdrawn_and_taken_at_the_openings_priority():
    with DeviceWorker() as worker:
        unprepared = await _all_steps(await OnWorker(_WordsBackend(ANSWER), worker).start(_request("when")))
        backend = _BusyAfterFirstStep(ANSWER, worker)
        answering = OnWorker(backend, worker)
        answering.prepare(_request("when"))
        for _ in range(200):  # step 1 ran; step 2 waits at DECODE behind the busy job
            if answering._prepared[1].queued is not None:  # noqa: SLF001 - the state this test is about
                break
            await asyncio.sleep(0.005)
        try:  # at once: it does not wait for the queued step (which waits for `free`)
            running = await asyncio.wait_for(answering.start(_request("when")), 5)
            assert answering.steps_withdrawn == 1 and answering.prepared_used == 1
            first = await running.step()  # replayed
            second = asyncio.ensure_future(running.step())  # step 2 again, now at OPENING
            await asyncio.sleep(0.05)
            other = worker.submit(Priority.PREFILL, backend.log.append, "another conversation's prefill")
        finally:
            backend.free.set()
        steps = [first, await second]
        while not steps[-1].done:
            steps.append(await running.step())
        await running.close()
        other.result(timeout=5)
    assert steps == unprepared
    assert backend.log[:3] == ["start", "step 1", "step 2"]  # the opening's step before the other's prefill
    assert "another conversation's prefill" in backend.log[3:]
    assert backend.log.count("step 2") == 1 and backend.log[-1] == "release"


class _Recording:
    """An answerer that can prepare: records what it was asked to prepare and to start."""

    def __init__(self) -> None:
        self.prepared: list[AnswerRequest] = []
        self.started: list[AnswerRequest] = []
        self.dropped = 0

    def prepare(self, request: AnswerRequest) -> None:
        self.prepared.append(request)

    def drop_prepared(self) -> None:
        self.dropped += 1

    async def start(self, request: AnswerRequest) -> TextAnswer:
        self.started.append(request)
        return TextAnswer("ok")


def _turn(instructions: str = "Be brief.") -> Question:
    return Question(None, 4.0, 4.0, instructions=instructions, max_tokens=32)


async def _answer_turn(conversation: Conversation, answering: _Recording, prepare: tuple[str, str]) -> None:
    """Prepare the turn as the pause would, complete the item as the commit does, then answer the turn."""
    channel: BlockingChannel[Question] = BlockingChannel(2, "questions")
    heard, activity = HeardClock(), AnswerActivity()
    await heard.finish()

    async def emit(event) -> None:
        pass

    with DeviceWorker():
        answers = QuestionProcessor(channel, answering, emit, conversation, heard, activity, ContextChanges())
        answers.prepare(_turn(), *prepare)
        conversation.apply(TranscriptUpdate("u1", "", "", 1.0, 3.0, completed=True, transcript=prepare[1]))
        activity.asked()
        await channel.put(_turn())
        channel.close()
        await answers.run()


def _talk() -> Conversation:
    """Earlier talk, a user turn being spoken, and a screen line read while it was spoken (which the context shows
    after the open turn, and before it once the turn completes)."""
    conversation = Conversation()
    conversation.add(Item("u0", 0.0, 0.5, stable="Hello.", completed=True))
    conversation.apply(TranscriptUpdate("u1", "What is the", " plan", 1.0, 2.5))
    conversation.add(Item("s1", 2.0, 2.0, audio=False, role="system", label="On screen", stable="Plan: ship it",
                          in_api=False))
    return conversation


@pytest.mark.asyncio
async def test_the_prepared_request_is_the_one_the_turn_asks_after_the_commit():
    answering = _Recording()
    await _answer_turn(_talk(), answering, ("u1", "What is the plan?"))
    assert len(answering.prepared) == 1 and answering.started == answering.prepared
    assert "What is the plan?" in answering.started[0].question and "Be brief." in answering.started[0].question
    assert answering.started[0].context.index("What is the plan?") < answering.started[0].context.index("ship it")


@pytest.mark.asyncio
async def test_a_screen_question_is_not_prepared():
    answering = _Recording()
    await _answer_turn(_talk(), answering, ("u1", "What is on the screen?"))
    assert answering.prepared == [] and len(answering.started) == 1


@pytest.mark.asyncio
async def test_the_screen_notes_wrapper_prepares_the_request_its_start_makes():
    backend = _Backend()
    with DeviceWorker() as worker:
        notes = ScreenNotes(Conversation(), max_tokens=0, selected_tokens=64, count=lambda text: len(text.split()))
        answering = NotesWithQuestion(OnWorker(backend, worker), notes)
        assert isinstance(answering, Preparing)
        answering.prepare(_request("what is the plan"))
        running = await answering.start(_request("what is the plan"))
        await running.close()
        assert answering.inner.prepared_used == 1  # type: ignore[attr-defined]
    assert backend.log == [("start", "what is the plan"), ("release", "what is the plan")]


@pytest.mark.asyncio
async def test_a_prepared_engine_answer_says_what_an_answer_started_after_the_commit_says():
    """The real engine (the tiny checkpoint): an answer prepared on the context the commit will leave, while the
    stream's context goes on changing as the prefiller sets it (the streamed words, then the final ones), gives the
    very tokens of an answer started afresh at the end."""
    from runtime.config import LMConfig
    from runtime.models.lm.engine_answerer import EngineAnswerer
    from runtime.worker import Priority

    answerer = EngineAnswerer.load(LMConfig(max_new_tokens=12, prefill_chunk_tokens=16), device="cpu",
                                   dtype="float32")
    final = "[00:00.5] Hello there.\n[00:01.0] What is the plan for the launch?"
    streamed = "[00:00.5] Hello there.\n[00:01.0] What is the plan for the lunch"
    request = AnswerRequest(final, "What is the plan for the launch?", 12)

    async def prefill(stream, context: str) -> None:  # as the prefiller does
        await worker.run(Priority.PREFILL, stream.set_context, context)
        while await worker.run(Priority.PREFILL, stream.prefill_step):
            pass

    async def words(running) -> list[str]:
        out = []
        while not (step := await running.step()).done:
            out.append(step.text)
        await running.close()
        return [*out, step.text]

    with DeviceWorker() as worker:
        stream = answerer.open_stream()
        answering = OnWorker(answerer, worker, stream)
        await prefill(stream, streamed)
        answering.prepare(request)
        await prefill(stream, streamed + " and")  # the stream wrote on during the pause
        await prefill(stream, final)  # the commit
        prepared = await words(await answering.start(request))
        assert answering.prepared_used == 1
        fresh_stream = answerer.open_stream()
        await prefill(fresh_stream, final)
        fresh = await words(await OnWorker(answerer, worker, fresh_stream).start(request))
    assert prepared == fresh and "".join(fresh).strip()
