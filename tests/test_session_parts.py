"""The small parts a session is assembled from, each against values worked out by hand: the fps sampler's
grid and the signals processors coordinate through (session_state.py)."""

import asyncio

import numpy as np
import pytest

from runtime.chunks import VideoFrame
from runtime.session_parts import FrameSampler
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock


def _kept(fps: float, times: list[float]) -> list[float]:
    sampler, image = FrameSampler(fps), np.zeros((2, 2, 3), np.uint8)
    out = [t for t in times if sampler.keep(VideoFrame(image, t))]
    assert sampler.kept == len(out) and sampler.skipped == len(times) - len(out)
    return out


def test_the_sampler_keeps_one_frame_per_period_on_its_grid():
    five_fps = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2]
    assert _kept(1.0, five_fps) == [0.0, 1.0, 2.0]
    assert _kept(2.0, five_fps) == [0.0, 0.6, 1.0, 1.6, 2.0]  # due at 0.5, 1.0, 1.5, 2.0: the first frame at or after


def test_after_a_stall_the_grid_restarts_half_a_period_after_the_first_frame():
    """A camera that stops for seconds must not be owed a burst of frames, and the new grid starts half a period
    after the first frame back (not a whole one: that would skip the next frame a camera off the grid sends)."""
    times = [0.0, 1.0, 2.0, 10.3, 10.5, 10.7, 10.9, 11.1, 11.3, 11.5, 11.7, 11.9]
    assert _kept(1.0, times) == [0.0, 1.0, 2.0, 10.3, 10.9, 11.9]


@pytest.mark.asyncio
async def test_heard_clock_wakes_waiters_in_order_and_on_finish():
    clock = HeardClock()
    early, late = asyncio.create_task(clock.reached(1.0)), asyncio.create_task(clock.reached(5.0))
    await clock.advance(1.0)
    await asyncio.sleep(0)
    assert early.done() and not late.done()
    await clock.advance(0.5)  # never moves back
    assert clock.until == 1.0
    await clock.finish()
    await asyncio.wait_for(late, 1)


@pytest.mark.asyncio
async def test_context_changes_coalesce():
    changes = ContextChanges()
    changes.mark()
    changes.mark()
    await asyncio.wait_for(changes.wait(), 1)
    waiting = asyncio.create_task(changes.wait())
    await asyncio.sleep(0.01)
    assert not waiting.done()  # two marks were one change, already taken
    changes.mark()
    await asyncio.wait_for(waiting, 1)


def test_answer_activity_counts_open_questions_and_never_goes_below_zero():
    activity = AnswerActivity()
    assert not activity.busy and activity.open == 0
    activity.asked()
    activity.asked()
    activity.ended()
    assert activity.busy and activity.open == 1 and not activity._idle.is_set()
    activity.ended()
    assert not activity.busy and activity._idle.is_set()
    activity.ended()  # an extra end (a refused put) must not make the count negative
    assert activity.open == 0
    activity.asked()
    assert activity.open == 1 and activity.busy


@pytest.mark.asyncio
async def test_answer_activity_idle_waits_for_the_last_open_question():
    activity = AnswerActivity()
    await asyncio.wait_for(activity.idle(), 1)  # idle from the start
    activity.asked()
    activity.asked()
    waiting = asyncio.create_task(activity.idle())
    activity.ended()
    await asyncio.sleep(0.01)
    assert not waiting.done()
    activity.ended()
    await asyncio.wait_for(waiting, 1)


@pytest.mark.asyncio
async def test_heard_clock_reached_is_inclusive_and_finished_releases_every_waiter():
    clock = HeardClock()
    await clock.advance(0.3)
    await asyncio.wait_for(clock.reached(0.3), 1)  # exactly there counts as heard
    await asyncio.wait_for(clock.reached(0.1 + 0.2), 1)  # 0.30000000000000004: float noise is heard too
    short = asyncio.create_task(clock.reached(0.31))
    await asyncio.sleep(0.01)
    assert not short.done() and not clock.finished
    await clock.finish()
    await asyncio.wait_for(short, 1)
    assert clock.finished and clock.until == 0.3
