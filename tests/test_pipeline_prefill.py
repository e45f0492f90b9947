"""The prefiller alone (pipeline/prefill.py): the memory after the transcript, a question's selection held until
its answer ends, rounds that never interleave and coalesce changes, every token counted."""

import asyncio
import threading

import pytest
import torch
from session_fakes import closed_segment

from runtime.memory.conversation import Conversation
from runtime.memory.snapshot import MemorySizes
from runtime.memory.video import VideoMemory
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.vlm.prompt import memory_pieces
from runtime.pipeline.prefill import ContextPrefiller
from runtime.session_state import ContextChanges
from runtime.worker import DeviceWorker, Priority


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
    memory, stream, transcript, changes = _memory_with_a_planted_segment(q), _RecordingStream(), Conversation(), \
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
    stream, transcript = _RecordingStream(), Conversation()
    transcript.apply(TranscriptUpdate("item_1", "w0 ", "w1", 0.0, 0.2))
    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, transcript, ContextChanges(), embed_text=lambda t: None)
        await prefiller.catch_up("anything?")
    assert stream.calls == [("[00:00.0] w0 w1",)] and prefiller.selected == []


class _LMStream:
    """Logs set_context and prefill steps; each context prefills in steps of 3 tokens then 2."""

    def __init__(self) -> None:
        self.log: list = []
        self._left: list[int] = []

    def set_context(self, text: str, *suffix) -> None:
        self.log.append(("set", text, *suffix))
        self._left = [3, 2, 0]

    def prefill_step(self) -> int:
        n = self._left.pop(0)
        self.log.append(("step", n))
        return n


class _Snap:
    def __init__(self, segments: list) -> None:
        self.segments, self.queries = segments, []

    def select(self, query: torch.Tensor) -> list:
        return self.segments[1:]

    def blocks(self, query: torch.Tensor | None) -> list:
        self.queries.append(query)
        return []


class _VideoMem:
    def __init__(self, snap: _Snap) -> None:
        self.snap = snap

    def snapshot(self) -> _Snap:
        return self.snap


def _transcript(text: str) -> Conversation:
    transcript = Conversation()
    transcript.apply(TranscriptUpdate("i0", text, "", 0.0, 1.0))
    return transcript


@pytest.mark.asyncio
async def test_prefill_without_video_sets_the_transcript_alone_and_counts_every_token():
    stream, changes = _LMStream(), ContextChanges()
    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, _transcript("hello"), changes)
        await prefiller.catch_up()
        await prefiller.catch_up("a question")
    assert stream.log == [("set", "[00:00.0] hello"), ("step", 3), ("step", 2), ("step", 0)] * 2
    assert prefiller.prefilled_tokens == 10 and prefiller.selected == []


@pytest.mark.asyncio
async def test_a_question_selects_the_memory_until_its_answer_ends():
    snap, embedded = _Snap([closed_segment(0), closed_segment(1), closed_segment(2)]), []

    def embed(text: str) -> torch.Tensor:
        embedded.append(text)
        return torch.ones(8)

    stream, changes = _LMStream(), ContextChanges()
    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, _transcript("hi"), changes, video=_VideoMem(snap),
                                     embed_text=embed)
        await prefiller.catch_up()
        assert prefiller.selected == [] and embedded == [] and snap.queries == [None]
        await prefiller.catch_up("what?")
        assert prefiller.question == "what?" and prefiller.selected == [(1.0, 2.0), (2.0, 3.0)]
        await prefiller.catch_up()  # a background round while the answer runs keeps the question's selection
        assert embedded == ["what?", "what?"] and prefiller.selected == [(1.0, 2.0), (2.0, 3.0)]
        prefiller.end_question()
        assert prefiller.question is None
        await asyncio.wait_for(changes.wait(), 1)  # the memory goes back to its own selection: a new round
        await prefiller.catch_up()
        assert prefiller.selected == [] and embedded == ["what?", "what?"]
    assert [entry[0] for entry in stream.log if entry[0] == "set"] == ["set"] * 4
    assert stream.log[0] == ("set", "[00:00.0] hi", [])  # with video the (empty) memory suffix is passed
    assert prefiller.prefilled_tokens == 20


@pytest.mark.asyncio
async def test_prefill_rounds_never_interleave():
    stream, changes = _LMStream(), ContextChanges()
    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, _transcript("x"), changes)
        await asyncio.gather(prefiller.catch_up(), prefiller.catch_up("q"), prefiller.catch_up())
    one_round = [("set", "[00:00.0] x"), ("step", 3), ("step", 2), ("step", 0)]
    assert stream.log == one_round * 3


@pytest.mark.asyncio
async def test_the_prefiller_runs_a_round_per_coalesced_change():
    stream, changes = _LMStream(), ContextChanges()
    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, _transcript("x"), changes)
        task = asyncio.create_task(prefiller.run())
        changes.mark()
        changes.mark()
        for _ in range(100):
            if len(stream.log) == 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(stream.log) == 4 and prefiller.prefilled_tokens == 5


@pytest.mark.asyncio
async def test_background_rounds_wait_behind_decode_steps_and_a_question_does_not():
    """In a server another session's answer is decoding: a background round's jobs queue behind its steps
    (`Priority.CONTEXT`), a round a question waits for goes ahead of them (`PREFILL`), from its next job on."""
    order: list[str] = []
    gate = threading.Event()

    class _Stream(_LMStream):
        def set_context(self, text: str, *suffix) -> None:
            order.append("set")
            super().set_context(text, *suffix)

        def prefill_step(self) -> int:
            order.append("prefill")
            return super().prefill_step()

    stream, changes = _Stream(), ContextChanges()
    with DeviceWorker() as worker:
        prefiller = ContextPrefiller(stream, worker, _transcript("x"), changes)
        worker.submit(Priority.CONTROL, gate.wait)  # the worker busy while both are queued
        background = asyncio.create_task(prefiller.catch_up())
        await asyncio.sleep(0.05)
        decode = asyncio.ensure_future(worker.run(Priority.DECODE, order.append, "decode"))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(background, decode)
        assert order == ["decode", "set", "prefill", "prefill", "prefill"]
        order.clear()
        gate.clear()
        worker.submit(Priority.CONTROL, gate.wait)
        asking = asyncio.create_task(prefiller.catch_up("a question?"))
        await asyncio.sleep(0.05)
        decode = asyncio.ensure_future(worker.run(Priority.DECODE, order.append, "decode"))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(asking, decode)
        # the question's job queued beside the decode step went first (what follows it races the step: each of the
        # round's jobs is submitted when the one before it is done)
        assert order[0] == "set" and "decode" in order and prefiller.priority == Priority.CONTEXT
