"""The note writer alone (pipeline/notes.py), with a stand-in model worked out by hand: it never delays an
answer, asks about the segment's keyframe alone, keeps one line with its own embedding, stops at its token
cap, and a failed or empty note costs only itself."""

import asyncio

import pytest
import torch
from session_fakes import TwoStepAnswer, closed_segment

from runtime.models.lm import AnswerStep
from runtime.models.lm.pieces import Visual
from runtime.models.lm.prompt import HEADINGS, NOTE_QUESTION
from runtime.pipeline.notes import NoteWriter
from runtime.session_state import AnswerActivity
from runtime.worker import DeviceWorker


class _NoteModel:
    """Writes the note 'a note' in two steps and logs when it was asked to."""

    name = "notes"

    def __init__(self) -> None:
        self.log: list[str] = []
        self.asked: list[tuple] = []

    def open_stream(self) -> None:
        return None

    def start(self, context: str, question: str, *, seed=None, stream=None, suffix=None,
              max_tokens=None) -> TwoStepAnswer:
        self.log.append("start")
        self.asked.append((context, question, suffix))
        return TwoStepAnswer(self.log)

    def embed_text(self, text: str) -> torch.Tensor:
        return torch.full((8,), float(len(text)))


class _Memory:
    def __init__(self) -> None:
        self.notes: dict[int, str] = {}
        self.embeddings: dict[int, torch.Tensor | None] = {}

    def set_note(self, segment_id: int, text: str, embedding: torch.Tensor | None = None) -> bool:
        self.notes[segment_id], self.embeddings[segment_id] = text, embedding
        return True


@pytest.mark.asyncio
async def test_the_note_writer_waits_while_a_question_is_open_then_writes_the_newest_pending():
    model, memory, activity, emitted = _NoteModel(), _Memory(), AnswerActivity(), []

    async def emit(event) -> None:
        emitted.append(event)

    with DeviceWorker() as worker:
        writer = NoteWriter(model, worker, memory, emit, activity, pending=2)
        task = asyncio.create_task(writer.run())
        activity.asked()  # a question is waiting: no note may start
        writer.add([closed_segment(0), closed_segment(1), closed_segment(2)])  # two fit: the oldest goes
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

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None):
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
    segment = closed_segment(3)
    writer, out = await _write_notes(model, memory, [segment])
    (context, question, suffix), = model.calls
    assert context == "" and question == NOTE_QUESTION
    assert suffix[:3] == [MEMORY_INTRO, HEADINGS["retrieved"], " [0:03-0:04]"] and len(suffix) == 4
    assert isinstance(suffix[3], Visual) and suffix[3].embeds is segment.keyframe
    assert model.embedded == ["a red ball"] and memory.notes == [(3, "a red ball", 1.0)]
    assert writer.written == 1 and model.released == 1
    assert [(e.type, e.segment_id, e.text, e.start, e.end, e.media_time) for e in out] == [
        ("runtime.video.note", 3, "a red ball", 3.0, 4.0, 4.0)]


@pytest.mark.asyncio
async def test_a_note_stops_at_max_tokens_and_an_empty_or_refused_note_is_not_counted():
    model = _ScriptedNoteModel([], [" ", "  "], ["kept?"])
    segments = [closed_segment(0), closed_segment(1), closed_segment(2)]
    writer, out = await _write_notes(model, _NoteMemory(accept=False), segments,
                                     max_tokens=3)
    assert model.steps == 3 + 2 + 1  # the endless note is cut after max_tokens steps
    assert model.embedded == ["xxx", "kept?"]  # the blank note is not embedded nor stored
    assert writer.written == 0 and out == [] and model.released == 3


@pytest.mark.asyncio
async def test_a_failed_note_costs_only_itself():
    model = _ScriptedNoteModel(["second"], fail={1})
    writer, out = await _write_notes(model, _NoteMemory(), [closed_segment(0), closed_segment(1)])
    assert writer.written == 1 and [(e.segment_id, e.text) for e in out] == [(1, "second")]


def test_the_note_writer_keeps_at_most_four_pending_segments_by_default():
    writer = NoteWriter(_ScriptedNoteModel(), None, _NoteMemory(), None, AnswerActivity())
    writer.add([closed_segment(i) for i in range(6)])
    assert [s.id for s in writer.pending] == [2, 3, 4, 5] and writer.max_tokens == 24
