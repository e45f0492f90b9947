"""The remote answerer's warm-ups (`pipeline/prefix_warming.py`) as a session drives them: changes coalesce, the rate
is bounded, nothing is sent while an answer streams, a failure is counted and the next change tries again. The
server side is tests/test_remote_answerer.py's (llama.cpp's real server); here a recorder stands in for it, since
what is checked is when requests are sent, not what a server does with them."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.memory.conversation import Conversation, Item
from runtime.pipeline.prefix_warming import PrefixWarmer
from runtime.session_state import AnswerActivity, ContextChanges


class Recorder:
    def __init__(self, fail: int = 0) -> None:
        self.sent: list[tuple[float, str]] = []
        self.fail = fail

    async def warm(self, context: str, tools: object = None) -> None:
        self.sent.append((time.monotonic(), context))
        if self.fail:
            self.fail -= 1
            raise ConnectionError("server down")


def say(conversation: Conversation, changes: ContextChanges, i: int) -> None:
    conversation.add(Item(f"item_{i}", i, i, audio=False, stable=f"line {i}", completed=True))
    changes.mark()


async def settle(warmer: PrefixWarmer, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not warmer.caught_up and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_burst_of_changes_is_warmed_at_the_bounded_rate_and_ends_caught_up():
    conversation, changes, remote = Conversation(), ContextChanges(), Recorder()
    warmer = PrefixWarmer(remote, conversation, changes, AnswerActivity(), interval_s=0.2)
    task = asyncio.create_task(warmer.run())
    started = time.monotonic()
    for i in range(30):  # 30 changes over ~0.6 s
        say(conversation, changes, i)
        await asyncio.sleep(0.02)
    await settle(warmer)
    task.cancel()
    elapsed = time.monotonic() - started
    assert warmer.caught_up and remote.sent[-1][1] == conversation.context()
    assert len(remote.sent) <= elapsed / 0.2 + 1  # coalesced: far fewer requests than changes
    gaps = [b - a for (a, _), (b, _) in zip(remote.sent, remote.sent[1:], strict=False)]
    assert all(gap >= 0.2 - 0.01 for gap in gaps), gaps


@pytest.mark.asyncio
async def test_nothing_is_sent_while_an_answer_streams():
    conversation, changes, remote, activity = Conversation(), ContextChanges(), Recorder(), AnswerActivity()
    warmer = PrefixWarmer(remote, conversation, changes, activity, interval_s=0.01)
    task = asyncio.create_task(warmer.run())
    activity.asked()
    say(conversation, changes, 0)
    await asyncio.sleep(0.2)
    assert remote.sent == []  # the answer holds the server's slot
    activity.ended()
    await settle(warmer)
    task.cancel()
    assert [context for _, context in remote.sent] == [conversation.context()]


@pytest.mark.asyncio
async def test_a_failed_warm_up_is_counted_and_the_next_change_tries_again():
    conversation, changes, remote = Conversation(), ContextChanges(), Recorder(fail=1)
    warmer = PrefixWarmer(remote, conversation, changes, AnswerActivity(), interval_s=0.01)
    task = asyncio.create_task(warmer.run())
    say(conversation, changes, 0)
    for _ in range(100):
        if warmer.failed:
            break
        await asyncio.sleep(0.01)
    assert warmer.failed == 1 and not warmer.caught_up
    say(conversation, changes, 1)
    await settle(warmer)
    task.cancel()
    assert warmer.caught_up and warmer.sent == 2


@pytest.mark.asyncio
async def test_an_interval_of_zero_never_warms():
    conversation, changes, remote = Conversation(), ContextChanges(), Recorder()
    warmer = PrefixWarmer(remote, conversation, changes, AnswerActivity(), interval_s=0.0)
    say(conversation, changes, 0)
    await asyncio.wait_for(warmer.run(), 1.0)  # returns at once
    assert remote.sent == []


class Hanging(Recorder):
    """A server slow to prefill: each warm-up waits until it is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0

    async def warm(self, context: str, tools: object = None) -> None:
        self.sent.append((time.monotonic(), context))
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@pytest.mark.asyncio
async def test_a_warm_up_in_flight_is_given_up_when_a_question_comes():
    conversation, changes, remote, activity = Conversation(), ContextChanges(), Hanging(), AnswerActivity()
    warmer = PrefixWarmer(remote, conversation, changes, activity, interval_s=0.01)
    task = asyncio.create_task(warmer.run())
    say(conversation, changes, 0)
    while not remote.sent:
        await asyncio.sleep(0.01)
    activity.asked()  # the question's request must not queue behind the warm-up
    for _ in range(100):
        if remote.cancelled:
            break
        await asyncio.sleep(0.01)
    assert remote.cancelled == 1 and warmer.cancelled == 1 and not warmer.caught_up and warmer.failed == 0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Slow(Recorder):
    """A server whose warm-ups take `delay_s`: the session's prefix was not in its cache, or it is busy."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.done: list[float] = []

    async def warm(self, context: str, tools: object = None) -> None:
        await super().warm(context, tools)
        await asyncio.sleep(self.delay_s)
        self.done.append(time.monotonic())


@pytest.mark.asyncio
async def test_slow_warm_ups_take_at_most_their_duty_share_of_the_time():
    """Warm-ups of 0.1 s at an interval of 0.05 s: each next one waits 0.9 s (DUTY = 0.1), not the interval."""
    from runtime.pipeline.prefix_warming import DUTY

    conversation, changes, remote = Conversation(), ContextChanges(), Slow(0.1)
    warmer = PrefixWarmer(remote, conversation, changes, AnswerActivity(), interval_s=0.05)
    task = asyncio.create_task(warmer.run())
    for i in range(40):  # changes keep coming for 2 s
        say(conversation, changes, i)
        await asyncio.sleep(0.05)
    task.cancel()
    assert 2 <= len(remote.sent) <= 3  # at 0.05 s apart it would have been about 13
    rests = [start - end for end, (start, _) in zip(remote.done, remote.sent[1:], strict=False)]
    assert rests and all(rest >= 0.1 * (1 / DUTY - 1) - 0.02 for rest in rests), rests
