"""Where a response's items land and what they say (`pipeline/response_output.py`, driven by the question
processor): an answer slow to start (a remote server's queue) still goes right after the turn it answers, so speech
that began meanwhile is the next turn; text and several function calls in one response get their own output
indexes; an empty answer still has its message."""

from __future__ import annotations

import asyncio

import pytest

from runtime.channels import BlockingChannel
from runtime.memory.conversation import Conversation, Item
from runtime.models.lm.answering import AnswerRequest, CallDelta, Step
from runtime.pipeline.answers import QuestionProcessor
from runtime.pipeline.questions import Question
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock


class Scripted:
    """The answering seam, scripted: `start` waits for `go`, then the steps come one per await."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps, self.go, self.requests = steps, asyncio.Event(), []
        self.go.set()

    async def start(self, request: AnswerRequest) -> Scripted:
        self.requests.append(request)
        await self.go.wait()
        self.left = list(self.steps)
        return self

    prompt_tokens = 3

    async def step(self) -> Step:
        return self.left.pop(0) if self.left else Step(done=True, finish_reason="stop")

    async def close(self) -> None:
        return None


def processor_for(answering: Scripted, conversation: Conversation):
    """A question processor on `answering`, its question channel and the list its events go to."""
    events: list = []

    async def emit(event) -> None:
        events.append(event)

    channel: BlockingChannel[Question] = BlockingChannel(4, "questions")
    processor = QuestionProcessor(channel, answering, emit, conversation, HeardClock(), AnswerActivity(),
                                  ContextChanges())
    return processor, channel, events


async def run(answering: Scripted, conversation: Conversation, *questions: Question,
              meanwhile: callable = None) -> list:
    processor, channel, events = processor_for(answering, conversation)
    task = asyncio.create_task(processor.run())
    for q in questions:
        await channel.put(q)
        if meanwhile is not None:
            await asyncio.sleep(0.05)
            meanwhile()
            answering.go.set()
        await asyncio.wait_for(q.answered.wait(), 5)
    channel.close()
    await task
    return events


def spoken(item_id: str, text: str, completed: bool = True) -> Item:
    return Item(item_id, 0.0, 1.0, stable=text, completed=completed, status="completed" if completed else "in_progress")


@pytest.mark.asyncio
async def test_a_slow_answer_goes_after_its_turn_not_after_speech_that_began_meanwhile():
    conversation = Conversation([spoken("u1", "When is the meeting?")])
    answering = Scripted([Step(text="Thursday.", tokens=1), Step(done=True, finish_reason="stop")])
    answering.go.clear()  # the server is busy: the answer starts late
    await run(answering, conversation, Question(None, 1.0, 0.0),
              meanwhile=lambda: conversation.items.append(spoken("u2", "And where", completed=False)))
    assert [(it.item_id, it.role) for it in conversation.items][0::2] == [("u1", "user"), ("u2", "user")]
    assert conversation.items[1].role == "assistant" and conversation.items[1].text == "Thursday."
    assert conversation.pending_user_text() == "And where"  # the next turn is the one that began meanwhile


@pytest.mark.asyncio
async def test_text_and_two_calls_get_their_own_items_and_output_indexes():
    conversation = Conversation([spoken("u1", "Weather in Paris and Rome?")])
    steps = [Step(text="Checking.", tokens=1),
             Step(call=CallDelta(0, "call_a", "get_weather", '{"city":'), tokens=1),
             Step(call=CallDelta(1, "call_b", "get_weather", '{"city":"Rome"}'), tokens=1),
             Step(call=CallDelta(0, "call_a", "", '"Paris"}'), tokens=1),
             Step(done=True, finish_reason="stop")]
    events = await run(Scripted(steps), conversation, Question(None, 1.0, 0.0))
    done = next(e for e in events if e.type == "response.done").response
    assert [(o["type"], o.get("call_id"), o.get("arguments")) for o in done["output"]] == [
        ("message", None, None), ("function_call", "call_a", '{"city":"Paris"}'),
        ("function_call", "call_b", '{"city":"Rome"}')]
    finished = {e.call_id: e for e in events if e.type == "response.function_call_arguments.done"}
    assert (finished["call_a"].output_index, finished["call_b"].output_index) == (1, 2)
    assert finished["call_a"].name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.call_id == "call_a"]
    assert "".join(deltas) == '{"city":"Paris"}'
    # the calls join the conversation after the message, in order: the next response continues them
    assert [it.type for it in conversation.items] == ["message", "message", "function_call", "function_call"]
    assert [c.call_id for c in conversation.calls_since_user()] == ["call_a", "call_b"]


@pytest.mark.asyncio
async def test_an_answer_that_says_nothing_still_has_its_message():
    conversation = Conversation([spoken("u1", "Hm?")])
    events = await run(Scripted([Step(done=True, finish_reason="stop")]), conversation, Question(None, 1.0, 0.0))
    done = next(e for e in events if e.type == "response.done").response
    assert done["status"] == "completed" and [o["type"] for o in done["output"]] == ["message"]
    assert [e.type for e in events].count("response.output_item.added") == 1


class Closing(Scripted):
    """Starts only when let go; counts its closes."""

    closed = 0

    async def close(self) -> None:
        Closing.closed += 1


@pytest.mark.asyncio
async def test_a_cancel_while_the_answer_is_starting_ends_the_response_at_once_and_closes_the_late_start():
    conversation = Conversation([spoken("u1", "Tell me a story.")])
    answering = Closing([Step(text="Once", tokens=1)])
    answering.go.clear()  # a server still connecting
    processor, channel, events = processor_for(answering, conversation)
    task = asyncio.create_task(processor.run())
    q = Question(None, 1.0, 0.0)
    await channel.put(q)
    while not answering.requests:  # the start is in flight
        await asyncio.sleep(0.01)
    assert processor.cancel()
    await asyncio.wait_for(q.answered.wait(), 2)  # not held by the start that has not finished
    done = next(e for e in events if e.type == "response.done").response
    assert done["status"] == "cancelled" and not any(e.type == "response.output_text.delta" for e in events)
    assert Closing.closed == 0
    answering.go.set()  # the start completes after all: what it opened is closed
    for _ in range(100):
        if Closing.closed:
            break
        await asyncio.sleep(0.01)
    assert Closing.closed == 1
    channel.close()
    await task
