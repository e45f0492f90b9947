"""The small parts a session is assembled from, each against values worked out by hand: the fps sampler's
grid, the signals processors coordinate through, and the note writer's promise never to delay an answer."""

import asyncio

import numpy as np
import pytest
import torch

from runtime.chunks import VideoFrame
from runtime.memory.snapshot import Segment
from runtime.models.lm import AnswerStep
from runtime.pipeline.notes import NoteWriter
from runtime.session import FrameSampler
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock
from runtime.worker import DeviceWorker


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


class _NoteAnswer:
    def __init__(self, log: list[str]) -> None:
        self.log, self.i = log, 0

    def step(self) -> AnswerStep:
        self.i += 1
        return AnswerStep(["a ", "note"][self.i - 1], self.i == 2, "stop" if self.i == 2 else None)

    def release(self) -> None:
        self.log.append("release")

    def stats(self) -> None:
        return None


class _NoteModel:
    """Writes the note 'a note' in two steps and logs when it was asked to."""

    name = "notes"

    def __init__(self) -> None:
        self.log: list[str] = []

    def open_stream(self) -> None:
        return None

    def start(self, context: str, question: str, *, seed=None, stream=None, suffix=None) -> _NoteAnswer:
        self.log.append("start")
        return _NoteAnswer(self.log)

    def embed_text(self, text: str) -> torch.Tensor:
        return torch.ones(8)


class _Memory:
    def __init__(self) -> None:
        self.notes: dict[int, str] = {}

    def set_note(self, segment_id: int, text: str, embedding: torch.Tensor | None = None) -> bool:
        self.notes[segment_id] = text
        return True


def _segment(i: int) -> Segment:
    z = torch.zeros(4, 8)
    return Segment(id=i, start=float(i), end=i + 1.0, frames=1, mean=z[0], keyframe=z, keyframe_time=float(i),
                   closed=True)


@pytest.mark.asyncio
async def test_the_note_writer_waits_while_a_question_is_open_then_writes_the_newest_pending():
    model, memory, activity, emitted = _NoteModel(), _Memory(), AnswerActivity(), []

    async def emit(event) -> None:
        emitted.append(event)

    with DeviceWorker() as worker:
        writer = NoteWriter(model, worker, memory, emit, activity, pending=2)
        task = asyncio.create_task(writer.run())
        activity.asked()  # a question is waiting: no note may start
        writer.add([_segment(0), _segment(1), _segment(2)])  # two fit: the oldest goes
        await asyncio.sleep(0.2)
        assert model.log == [] and writer.written == 0
        activity.ended()
        for _ in range(100):
            if writer.written == 2:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert memory.notes == {1: "a note", 2: "a note"}
    assert model.log == ["start", "release", "start", "release"]
    assert [(e.segment_id, e.text, e.start, e.end) for e in emitted] == [(1, "a note", 1.0, 2.0),
                                                                        (2, "a note", 2.0, 3.0)]
