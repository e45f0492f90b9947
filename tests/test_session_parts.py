"""The small parts a session is assembled from, each against values worked out by hand: the fps sampler's
grid, the signals processors coordinate through, and the note writer's promise never to delay an answer."""

import asyncio

import numpy as np
import pytest
import torch

from runtime.chunks import VideoFrame
from runtime.memory.snapshot import MemorySizes, Segment
from runtime.memory.transcript import TranscriptMemory
from runtime.memory.video import VideoMemory
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.lm import AnswerStep
from runtime.models.lm.pieces import Visual
from runtime.models.lm.prompt import HEADINGS, NOTE_QUESTION
from runtime.models.vlm.prompt import memory_pieces
from runtime.pipeline.notes import NoteWriter
from runtime.pipeline.prefill import ContextPrefiller
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
        self.asked: list[tuple] = []

    def open_stream(self) -> None:
        return None

    def start(self, context: str, question: str, *, seed=None, stream=None, suffix=None) -> _NoteAnswer:
        self.log.append("start")
        self.asked.append((context, question, suffix))
        return _NoteAnswer(self.log)

    def embed_text(self, text: str) -> torch.Tensor:
        return torch.full((8,), float(len(text)))


class _Memory:
    def __init__(self) -> None:
        self.notes: dict[int, str] = {}
        self.embeddings: dict[int, torch.Tensor | None] = {}

    def set_note(self, segment_id: int, text: str, embedding: torch.Tensor | None = None) -> bool:
        self.notes[segment_id], self.embeddings[segment_id] = text, embedding
        return True


def _segment(i: int) -> Segment:
    z = torch.full((4, 8), float(i))
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
    assert memory.notes == {1: "a note", 2: "a note"} and writer.written == 2
    assert all(torch.equal(e, torch.full((8,), 6.0)) for e in memory.embeddings.values())  # the note's own vector
    assert model.log == ["start", "release", "start", "release"]
    for (context, question, suffix), segment in zip(model.asked, (1, 2), strict=True):
        assert (context, question) == ("", NOTE_QUESTION)  # the keyframe alone, no transcript
        visual = [p for p in suffix if isinstance(p, Visual)]
        assert len(visual) == 1 and torch.equal(visual[0].embeds, torch.full((4, 8), float(segment)))
        assert HEADINGS["retrieved"] in suffix  # shown as a moment, with its time
    assert [e.media_time for e in emitted] == [2.0, 3.0]
    assert [(e.segment_id, e.text, e.start, e.end) for e in emitted] == [(1, "a note", 1.0, 2.0),
                                                                        (2, "a note", 2.0, 3.0)]


class _RecordingStream:
    """An LM stream that records what it was handed and prefills 4 tokens a job."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.pending = 0

    def set_context(self, text: str, *suffix) -> None:
        self.calls.append((text, *suffix))
        self.pending = 10

    def prefill_step(self) -> int:
        n = min(4, self.pending)
        self.pending -= n
        return n


def _memory_with_a_planted_segment(query: torch.Tensor) -> VideoMemory:
    memory = VideoMemory(MemorySizes(segment_s=2.0, retrieved_frames=1), 16)
    gen = torch.Generator().manual_seed(3)
    for seg in range(3):
        x = torch.randn(2, 64, 16, generator=gen) * 3.0
        if seg == 1:
            x = x * 0.1 + 2.0 * query  # the segment from 2 s to 3 s shows what the question asks about
        memory.write(x, [seg * 2.0, seg * 2.0 + 1.0])
    return memory


@pytest.mark.asyncio
async def test_the_prefiller_puts_the_memory_after_the_transcript_and_lets_a_question_select_it():
    q = torch.zeros(16)
    q[5] = 1.0
    memory, stream, transcript, changes = _memory_with_a_planted_segment(q), _RecordingStream(), TranscriptMemory(), \
        ContextChanges()
    transcript.apply(TranscriptUpdate("item_1", "hello there", "", 61.0, 62.0, True, "hello there"))
    asked: list[str] = []

    def embed(text: str) -> torch.Tensor:
        asked.append(text)
        return q

    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, transcript, changes, video=memory, embed_text=embed)
        await prefiller.catch_up()
        snapshot = memory.snapshot()
        assert stream.calls[-1] == ("[01:01.0] hello there", memory_pieces(snapshot.blocks(None)))
        assert prefiller.selected == [] and asked == [] and prefiller.prefilled_tokens == 10

        await prefiller.catch_up("where is the car?")
        assert asked == ["where is the car?"]
        assert prefiller.selected == [(2.0, 3.0)]
        assert stream.calls[-1] == ("[01:01.0] hello there", memory_pieces(snapshot.blocks(q)))
        assert stream.calls[-1] != stream.calls[-2]  # the question chose other full-resolution frames
        await prefiller.catch_up()  # a background round while the answer runs keeps the question's selection
        assert prefiller.selected == [(2.0, 3.0)] and asked[-1] == "where is the car?"

        prefiller.end_question()
        await asyncio.wait_for(changes.wait(), 1)  # the memory goes back to its own selection at once
        await prefiller.catch_up()
        assert prefiller.selected == [] and stream.calls[-1] == stream.calls[0]
        assert prefiller.prefilled_tokens == 40


@pytest.mark.asyncio
async def test_the_prefiller_without_video_hands_the_transcript_alone():
    stream, transcript = _RecordingStream(), TranscriptMemory()
    transcript.apply(TranscriptUpdate("item_1", "w0 ", "w1", 0.0, 0.2))
    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, transcript, ContextChanges(), embed_text=lambda t: None)
        await prefiller.catch_up("anything?")
    assert stream.calls == [("[00:00.0] w0 w1",)] and prefiller.selected == []
