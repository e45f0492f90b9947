"""The small parts a session is assembled from, each against values worked out by hand: the fps sampler's
grid, the signals processors coordinate through, and the note writer's promise never to delay an answer."""

import asyncio

import numpy as np
import pytest
import torch

from runtime.channels import BlockingChannel, LatestChannel
from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.memory.snapshot import Segment
from runtime.memory.transcript import TranscriptMemory
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.lm import AnswerStep
from runtime.pipeline.answers import Question, QuestionProcessor
from runtime.pipeline.audio import AudioProcessor
from runtime.pipeline.notes import NoteWriter
from runtime.pipeline.prefill import ContextPrefiller
from runtime.pipeline.video import VideoProcessor
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


class _ScriptedStream:
    """An ASR stream that returns scripted updates per chunk index, raises on `fail_on`, and records how far the
    heard clock was when each call came (calls run on the worker, the clock is only read)."""

    def __init__(self, heard: HeardClock, by_chunk: dict, final: list, fail_on: set) -> None:
        self.heard, self.by_chunk, self.final, self.fail_on = heard, by_chunk, final, fail_on
        self.heard_at_call: list[float] = []

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        self.heard_at_call.append(self.heard.until)
        index = chunk.start_sample // (SAMPLE_RATE // 10)
        if index in self.fail_on:
            raise RuntimeError(f"corrupt {index}")
        return self.by_chunk.get(index, [])

    def finish(self) -> list[TranscriptUpdate]:
        self.heard_at_call.append(self.heard.until)
        if "finish" in self.fail_on:
            raise RuntimeError("corrupt end")
        return self.final


async def _run_audio(n_chunks: int, by_chunk: dict, final: list, fail_on: set = frozenset()):
    channel: BlockingChannel[AudioChunk] = BlockingChannel(n_chunks, "audio")
    for i in range(n_chunks):
        await channel.put(AudioChunk(np.zeros(SAMPLE_RATE // 10, np.float32), i * (SAMPLE_RATE // 10)))
    channel.close()
    heard, changes, transcript, emitted = HeardClock(), ContextChanges(), TranscriptMemory(), []

    async def emit(event) -> None:
        emitted.append(event)

    stream = _ScriptedStream(heard, by_chunk, final, set(fail_on))
    with DeviceWorker() as worker:
        await AudioProcessor(channel, stream, worker, emit, transcript, heard, changes).run()
    return stream, heard, changes, transcript, emitted


@pytest.mark.asyncio
async def test_audio_processor_publishes_updates_advances_the_clock_to_each_chunk_end_and_survives_a_bad_chunk():
    by_chunk = {0: [TranscriptUpdate("i0", "a ", "", 0.0, 0.1)],
                2: [TranscriptUpdate("i0", "", "b", 0.0, 0.3), TranscriptUpdate("i0", "", "", 0.0, 0.3)]}
    final = [TranscriptUpdate("i0", "", "", 0.0, 0.3, True, "a b")]
    stream, heard, changes, transcript, out = await _run_audio(3, by_chunk, final, {1})
    assert stream.heard_at_call == pytest.approx([0.0, 0.1, 0.2, 0.3])  # a failed chunk still counts as heard
    assert heard.finished and heard.until == pytest.approx(0.3)
    assert [e.type.rsplit(".", 1)[-1] if e.type != "error" else "error" for e in out] == [
        "delta", "error", "delta", "completed"]  # the update with nothing new is applied, not emitted
    delta, error, tail, done = out
    assert (delta.item_id, delta.delta, delta.unstable, delta.start, delta.end, delta.media_time) == (
        "i0", "a ", "", 0.0, 0.1, 0.1)
    assert error.error["code"] == "asr_failed" and error.error["type"] == "server_error"
    assert error.error["message"] == "speech recognition failed: corrupt 1" and error.media_time == pytest.approx(0.1)
    assert (tail.delta, tail.unstable, tail.media_time) == ("", "b", 0.3)
    assert (done.item_id, done.transcript, done.start, done.end, done.media_time) == ("i0", "a b", 0.0, 0.3, 0.3)
    assert transcript.final_text() == "a b"
    await asyncio.wait_for(changes.wait(), 1)  # the context changed


@pytest.mark.asyncio
async def test_audio_processor_without_words_marks_no_change_and_a_failed_finish_is_reported_at_the_heard_time():
    stream, heard, changes, transcript, out = await _run_audio(2, {}, [], {"finish"})
    assert heard.finished and heard.until == pytest.approx(0.2)
    assert [(e.error["code"], e.error["message"]) for e in out] == [("asr_failed", "speech recognition failed: "
                                                                                   "corrupt end")]
    assert out[0].media_time == pytest.approx(0.2)
    assert not changes._dirty.is_set() and transcript.items == []


class _Encoder:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.batches = fail, []

    def encode(self, images: list) -> torch.Tensor:
        self.batches.append(len(images))
        if self.fail:
            raise RuntimeError("bad pixels")
        return torch.zeros(len(images), 2)


class _WrittenMemory:
    def __init__(self, closed: list) -> None:
        self.closed, self.times = closed, []

    def write(self, features: torch.Tensor, times: list[float]) -> list:
        self.times.append(list(times))
        return self.closed


class _Sink:
    def __init__(self) -> None:
        self.added: list = []

    def add(self, segments: list) -> None:
        self.added.append([s.id for s in segments])


async def _run_video(times: list[float], encoder, memory, notes):
    channel: LatestChannel[VideoFrame] = LatestChannel(8, "video")
    for t in times:
        channel.put_nowait(VideoFrame(np.zeros((2, 2, 3), np.uint8), t))
    channel.close()
    changes, emitted = ContextChanges(), []

    async def emit(event) -> None:
        emitted.append(event)

    with DeviceWorker() as worker:
        video = VideoProcessor(channel, worker, emit, changes, encoder=encoder, memory=memory, notes=notes)
        reached = asyncio.create_task(video.settled_to(len(times)))
        beyond = asyncio.create_task(video.settled_to(len(times) + 1))
        await video.run()
        await asyncio.wait_for(reached, 1)
        assert not beyond.done()
        beyond.cancel()
    return video, changes, emitted


@pytest.mark.asyncio
async def test_video_processor_encodes_what_queued_as_one_batch_and_hands_closed_segments_to_the_notes():
    encoder, memory, sink = _Encoder(), _WrittenMemory([_segment(0), _segment(1)]), _Sink()
    video, changes, out = await _run_video([0.0, 1.0, 2.0], encoder, memory, sink)
    assert encoder.batches == [3] and memory.times == [[0.0, 1.0, 2.0]]
    assert (video.frames, video.settled, video.encoded, video.batches) == (3, 3, 3, 1)
    assert video.latest.time == 2.0 and sink.added == [[0, 1]] and out == []
    await asyncio.wait_for(changes.wait(), 1)


@pytest.mark.asyncio
async def test_video_processor_hands_nothing_to_the_notes_when_no_segment_closed():
    sink = _Sink()
    video, _, _ = await _run_video([0.0], _Encoder(), _WrittenMemory([]), sink)
    assert sink.added == [] and video.encoded == 1


@pytest.mark.asyncio
async def test_a_failed_video_batch_is_an_error_at_its_newest_frame_and_its_frames_still_settle():
    sink = _Sink()
    video, changes, out = await _run_video([0.5, 1.5], _Encoder(fail=True), _WrittenMemory([_segment(0)]), sink)
    assert [(e.error["code"], e.error["type"], e.error["message"], e.media_time) for e in out] == [
        ("video_failed", "server_error", "video encoding failed: bad pixels", 1.5)]
    assert (video.frames, video.settled, video.encoded, video.batches) == (2, 2, 0, 0)
    assert sink.added == [] and not changes._dirty.is_set()


@pytest.mark.asyncio
async def test_video_processor_without_an_encoder_only_counts_and_keeps_the_newest_frame():
    video, changes, out = await _run_video([0.0, 1.0], None, None, None)
    assert (video.frames, video.settled, video.encoded, video.batches) == (2, 2, 0, 0)
    assert video.latest.time == 1.0 and out == [] and not changes._dirty.is_set()


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


def _transcript(text: str) -> TranscriptMemory:
    transcript = TranscriptMemory()
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
    snap, embedded = _Snap([_segment(0), _segment(1), _segment(2)]), []

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


class _ScriptedNoteModel:
    """Plays one list of deltas per note (an empty list of steps never finishes: it says 'x' forever); records
    what each note was asked with, what it embedded, and releases."""

    name = "notes"

    def __init__(self, *notes, fail: set = frozenset()) -> None:
        self.notes, self.fail = list(notes), set(fail)
        self.calls: list = []
        self.embedded: list[str] = []
        self.released = 0
        self.steps = 0

    def start(self, context, question, *, seed=None, stream=None, suffix=None):
        self.calls.append((context, question, suffix))
        if len(self.calls) in self.fail:
            raise RuntimeError("note failed")
        return _ScriptedNote(self, self.notes.pop(0))

    def embed_text(self, text: str) -> torch.Tensor:
        self.embedded.append(text)
        return torch.full((8,), float(len(self.embedded)))


class _ScriptedNote:
    def __init__(self, model: _ScriptedNoteModel, deltas: list[str]) -> None:
        self.model, self.deltas, self.i = model, deltas, 0

    def step(self) -> AnswerStep:
        self.model.steps += 1
        if not self.deltas:
            return AnswerStep("x", False, None)
        self.i += 1
        done = self.i == len(self.deltas)
        return AnswerStep(self.deltas[self.i - 1], done, "stop" if done else None)

    def release(self) -> None:
        self.model.released += 1


class _NoteMemory:
    def __init__(self, accept: bool = True) -> None:
        self.accept, self.notes = accept, []

    def set_note(self, segment_id: int, text: str, embedding: torch.Tensor | None = None) -> bool:
        self.notes.append((segment_id, text, None if embedding is None else embedding[0].item()))
        return self.accept


async def _write_notes(model, memory, segments, **kwargs):
    emitted: list = []

    async def emit(event) -> None:
        emitted.append(event)

    with DeviceWorker() as worker:
        writer = NoteWriter(model, worker, memory, emit, AnswerActivity(), **kwargs)
        task = asyncio.create_task(writer.run())
        writer.add(segments)
        for _ in range(200):
            if not writer.pending and len(model.calls) >= len(segments) and model.released + len(
                    getattr(model, "fail", ())) >= len(segments):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return writer, emitted


@pytest.mark.asyncio
async def test_a_note_is_asked_about_the_segment_keyframe_collapsed_to_one_line_and_stored_with_its_embedding():
    from runtime.models.lm.pieces import Visual
    from runtime.models.lm.prompt import HEADINGS, MEMORY_INTRO, NOTE_QUESTION

    model, memory = _ScriptedNoteModel(["  a ", "\n red  ", "ball "]), _NoteMemory()
    segment = _segment(3)
    writer, out = await _write_notes(model, memory, [segment])
    (context, question, suffix), = model.calls
    assert context == "" and question == NOTE_QUESTION
    assert suffix[:3] == [MEMORY_INTRO, HEADINGS["retrieved"], " [0:03-0:04]"] and len(suffix) == 4
    assert isinstance(suffix[3], Visual) and suffix[3].embeds is segment.keyframe
    assert model.embedded == ["a red ball"] and memory.notes == [(3, "a red ball", 1.0)]
    assert writer.written == 1 and model.released == 1
    assert [(e.type, e.segment_id, e.text, e.start, e.end, e.media_time) for e in out] == [
        ("video.note", 3, "a red ball", 3.0, 4.0, 4.0)]


@pytest.mark.asyncio
async def test_a_note_stops_at_max_tokens_and_an_empty_or_refused_note_is_not_counted():
    model = _ScriptedNoteModel([], [" ", "  "], ["kept?"])
    writer, out = await _write_notes(model, _NoteMemory(accept=False), [_segment(0), _segment(1), _segment(2)],
                                     max_tokens=3)
    assert model.steps == 3 + 2 + 1  # the endless note is cut after max_tokens steps
    assert model.embedded == ["xxx", "kept?"]  # the blank note is not embedded nor stored
    assert writer.written == 0 and out == [] and model.released == 3


@pytest.mark.asyncio
async def test_a_failed_note_costs_only_itself():
    model = _ScriptedNoteModel(["second"], fail={1})
    writer, out = await _write_notes(model, _NoteMemory(), [_segment(0), _segment(1)])
    assert writer.written == 1 and [(e.segment_id, e.text) for e in out] == [(1, "second")]


def test_the_note_writer_keeps_at_most_four_pending_segments_by_default():
    writer = NoteWriter(_ScriptedNoteModel(), None, _NoteMemory(), None, AnswerActivity())
    writer.add([_segment(i) for i in range(6)])
    assert [s.id for s in writer.pending] == [2, 3, 4, 5] and writer.max_tokens == 24


class _SelectingPrefiller:
    """Stands in for the prefiller of a session with video: the question selected two memory spans."""

    def __init__(self) -> None:
        self.video, self.selected, self.log = object(), [], []

    async def catch_up(self, question: str | None = None) -> None:
        self.log.append(("catch_up", question))
        self.selected = [(1.23456, 2.34567), (10.0, 12.5)]

    def end_question(self) -> None:
        self.log.append(("end",))


class _OneWordModel:
    name = "one"

    def start(self, context, question, *, seed=None, stream=None, suffix=None) -> _NoteAnswer:
        return _NoteAnswer([])


@pytest.mark.asyncio
async def test_an_answer_with_video_reports_the_segments_its_question_selected():
    channel: BlockingChannel[Question] = BlockingChannel(2, "questions")
    heard, activity, prefiller, emitted = HeardClock(), AnswerActivity(), _SelectingPrefiller(), []
    await heard.finish()

    async def emit(event) -> None:
        emitted.append(event)

    class _Context:
        def context(self) -> str:
            return ""

    activity.asked()
    await channel.put(Question("what moved?", 3.0, 0.0))
    channel.close()
    with DeviceWorker() as worker:
        answers = QuestionProcessor(channel, _OneWordModel(), worker, emit, _Context(), heard, activity,
                                    prefiller=prefiller)
        await answers.run()
    done = emitted[-1].response
    assert done["video"] == {"selected_segments": [[1.235, 2.346], [10.0, 12.5]]}
    assert prefiller.log == [("catch_up", "what moved?"), ("end",)]
    assert done["output"][0]["content"][0]["text"] == "a note" and answers.answered == 1 and activity.open == 0


class _FailingPrefiller(_SelectingPrefiller):
    async def catch_up(self, question: str | None = None) -> None:
        raise RuntimeError("prefill failed")


@pytest.mark.asyncio
async def test_an_answer_whose_prefill_fails_is_failed_and_reports_no_segment():
    channel: BlockingChannel[Question] = BlockingChannel(2, "questions")
    heard, activity, prefiller, emitted = HeardClock(), AnswerActivity(), _FailingPrefiller(), []
    await heard.finish()

    async def emit(event) -> None:
        emitted.append(event)

    class _Context:
        def context(self) -> str:
            return ""

    await channel.put(Question("q", 0.0, 0.0))
    channel.close()
    with DeviceWorker() as worker:
        await QuestionProcessor(channel, _OneWordModel(), worker, emit, _Context(), heard, activity,
                                prefiller=prefiller).run()
    done = emitted[-1].response
    assert done["status"] == "failed" and done["video"] == {"selected_segments": []}
    assert prefiller.log == [("end",)]
