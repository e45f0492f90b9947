"""The audio and video processors alone, and what an answer with video reports, with stand-ins whose behaviour
is worked out by hand: what each hands on and when, and what a failure costs."""

import asyncio

import numpy as np
import pytest
import torch
from session_fakes import TwoStepAnswer, closed_segment

from runtime.channels import BlockingChannel, LatestChannel
from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.memory.conversation import Conversation
from runtime.models.asr.base import TranscriptUpdate
from runtime.pipeline.answers import QuestionProcessor
from runtime.pipeline.audio import AudioProcessor
from runtime.pipeline.local_answers import OnWorker
from runtime.pipeline.questions import Question
from runtime.pipeline.video import VideoProcessor
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock
from runtime.worker import DeviceWorker


class _ScriptedStream:
    """An ASR stream that returns scripted updates per chunk index, raises on `fail_on`, and records how far the
    heard clock was when each call came (calls run on the worker, the clock is only read)."""

    def __init__(self, heard: HeardClock, by_chunk: dict, final: list, fail_on: set) -> None:
        self.heard, self.by_chunk, self.final, self.fail_on = heard, by_chunk, final, fail_on
        self.heard_at_call: list[float] = []
        self.closed = False

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        pass

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

    def close(self) -> None:
        self.closed = True


async def _run_audio(n_chunks: int, by_chunk: dict, final: list, fail_on: set = frozenset()):
    channel: BlockingChannel[AudioChunk] = BlockingChannel(n_chunks, "audio")
    for i in range(n_chunks):
        await channel.put(AudioChunk(np.zeros(SAMPLE_RATE // 10, np.float32), i * (SAMPLE_RATE // 10)))
    channel.close()
    heard, changes, transcript, emitted = HeardClock(), ContextChanges(), Conversation(), []

    async def emit(event) -> None:
        emitted.append(event)

    stream = _ScriptedStream(heard, by_chunk, final, set(fail_on))
    with DeviceWorker() as worker:
        await AudioProcessor(channel, lambda: stream, worker, emit, transcript, heard, changes,
                             first_stream=stream).run()
    return stream, heard, changes, transcript, emitted


@pytest.mark.asyncio
async def test_audio_processor_publishes_updates_advances_the_clock_to_each_chunk_end_and_survives_a_bad_chunk():
    by_chunk = {0: [TranscriptUpdate("i0", "a ", "", 0.0, 0.1)],
                2: [TranscriptUpdate("i0", "", "b", 0.0, 0.3), TranscriptUpdate("i0", "", "", 0.0, 0.3)]}
    final = [TranscriptUpdate("i0", "", "", 0.0, 0.3, True, "a b")]
    stream, heard, changes, transcript, out = await _run_audio(3, by_chunk, final, {1})
    assert stream.heard_at_call == pytest.approx([0.0, 0.1, 0.2, 0.3])  # a failed chunk still counts as heard
    assert heard.finished and heard.until == pytest.approx(0.3)
    # the update with nothing new is applied, not emitted; the end of input commits the buffer: its user item
    # is added, its transcript completes with the backend's final text, and the item is done
    assert [e.type for e in out] == [
        "conversation.item.input_audio_transcription.delta", "error",
        "conversation.item.input_audio_transcription.delta", "input_audio_buffer.committed",
        "conversation.item.added", "conversation.item.input_audio_transcription.delta",
        "conversation.item.input_audio_transcription.completed", "conversation.item.done"]
    delta, error, tail, committed, added, last, done, item_done = out
    assert last.delta == " b"  # what the final text adds to the streamed deltas: they add up to it
    item = delta.item_id  # the buffer's item, not the backend's "i0"
    assert item.startswith("item_") and {e.item_id for e in (tail, committed, done)} == {item}
    assert committed.previous_item_id is None and added.item["id"] == item_done.item["id"] == item
    assert added.item["content"] == [{"type": "input_audio", "transcript": None}]
    assert item_done.item["content"] == [{"type": "input_audio", "transcript": "a b"}]
    assert stream.closed
    assert (delta.delta, delta.unstable, delta.start, delta.end, delta.media_time) == ("a ", "", 0.0, 0.1, 0.1)
    assert error.error["code"] == "asr_failed" and error.error["type"] == "server_error"
    assert error.error["message"] == "speech recognition failed: corrupt 1" and error.media_time == pytest.approx(0.1)
    assert (tail.delta, tail.unstable, tail.media_time) == ("", "b", 0.3)
    assert (done.transcript, done.start, done.end, done.media_time) == ("a b", 0.0, 0.3, 0.3)
    assert done.usage == {"type": "duration", "seconds": 0.3}
    assert transcript.final_text() == "a b"
    await asyncio.wait_for(changes.wait(), 1)  # the context changed


@pytest.mark.asyncio
async def test_audio_processor_without_words_commits_an_empty_item_and_a_failed_finish_is_reported_at_its_end():
    stream, heard, changes, transcript, out = await _run_audio(2, {}, [], {"finish"})
    assert heard.finished and heard.until == pytest.approx(0.2)
    errors = [e for e in out if e.type == "error"]
    assert [(e.error["code"], e.error["message"]) for e in errors] == [("asr_failed", "speech recognition failed: "
                                                                                      "corrupt end")]
    assert errors[0].media_time == pytest.approx(0.2)
    assert [it.text for it in transcript.items] == [""] and transcript.context() == ""


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
    encoder, memory, sink = _Encoder(), _WrittenMemory([closed_segment(0), closed_segment(1)]), _Sink()
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
    video, changes, out = await _run_video([0.5, 1.5], _Encoder(fail=True), _WrittenMemory([closed_segment(0)]), sink)
    assert [(e.error["code"], e.error["type"], e.error["message"], e.media_time) for e in out] == [
        ("video_failed", "server_error", "video encoding failed: bad pixels", 1.5)]
    assert (video.frames, video.settled, video.encoded, video.batches) == (2, 2, 0, 0)
    assert sink.added == [] and not changes._dirty.is_set()


@pytest.mark.asyncio
async def test_video_processor_without_an_encoder_only_counts_and_keeps_the_newest_frame():
    video, changes, out = await _run_video([0.0, 1.0], None, None, None)
    assert (video.frames, video.settled, video.encoded, video.batches) == (2, 2, 0, 0)
    assert video.latest.time == 1.0 and out == [] and not changes._dirty.is_set()


class _SelectingPrefiller:
    """Stands in for the prefiller of a session with video: the question selected two memory spans."""

    sees_video = True

    def __init__(self) -> None:
        self.selected, self.log = [], []

    async def catch_up(self, question: str | None = None) -> None:
        self.log.append(("catch_up", question))
        self.selected = [(1.23456, 2.34567), (10.0, 12.5)]

    def end_question(self) -> None:
        self.log.append(("end",))


class _OneWordModel:
    name = "one"

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> TwoStepAnswer:
        return TwoStepAnswer([])


async def _answer_one(prefiller, question: Question) -> tuple[list, QuestionProcessor, AnswerActivity]:
    """Answer `question` alone, its audio already heard; returns the events, the processor and the activity."""
    channel: BlockingChannel[Question] = BlockingChannel(2, "questions")
    heard, activity, emitted = HeardClock(), AnswerActivity(), []
    await heard.finish()

    async def emit(event) -> None:
        emitted.append(event)

    activity.asked()
    await channel.put(question)
    channel.close()
    with DeviceWorker() as worker:
        answers = QuestionProcessor(channel, OnWorker(_OneWordModel(), worker), emit, Conversation(), heard,
                                    activity, ContextChanges(), prefiller=prefiller)
        await answers.run()
    return emitted, answers, activity


@pytest.mark.asyncio
async def test_an_answer_with_video_reports_the_segments_its_question_selected():
    prefiller = _SelectingPrefiller()
    emitted, answers, activity = await _answer_one(prefiller, Question("what moved?", 3.0, 0.0))
    done = emitted[-1].response
    assert done["video"] == {"selected_segments": [[1.235, 2.346], [10.0, 12.5]]}
    assert prefiller.log == [("catch_up", "what moved?"), ("end",)]
    assert done["output"][0]["content"][0]["text"] == "a note" and answers.answered == 1 and activity.open == 0


class _FailingPrefiller(_SelectingPrefiller):
    async def catch_up(self, question: str | None = None) -> None:
        raise RuntimeError("prefill failed")


@pytest.mark.asyncio
async def test_an_answer_whose_prefill_fails_is_failed_and_reports_no_segment():
    prefiller = _FailingPrefiller()
    emitted, _, _ = await _answer_one(prefiller, Question("q", 0.0, 0.0))
    done = emitted[-1].response
    assert done["status"] == "failed" and done["video"] == {"selected_segments": []}
    assert prefiller.log == [("end",)]


@pytest.mark.asyncio
async def test_a_response_is_no_longer_active_when_its_done_is_sent():
    """A client may ask again the moment it reads response.done: that request must not be refused as
    `conversation_already_has_active_response` by the response that just ended (the browser page once waited for
    a done that had already come)."""
    from runtime.events import ResponseDone
    from runtime.pipeline.response_requests import ResponseRequests
    from runtime.session_config import SessionConfig
    from runtime.session_state import SessionSettings

    channel: BlockingChannel[Question] = BlockingChannel(2, "questions")
    heard, activity, active_at_done = HeardClock(), AnswerActivity(), []
    await heard.finish()

    async def emit(event) -> None:
        if isinstance(event, ResponseDone):
            active_at_done.append(requests.active_response())

    requests = ResponseRequests(channel, None, activity, heard, SessionSettings(SessionConfig()), emit)  # type: ignore[arg-type]
    question = Question("what moved?", 1.0, 0.0)
    assert await requests.request(question) and requests.active_response() == question.response_id
    channel.close()
    with DeviceWorker() as worker:
        answers = QuestionProcessor(channel, OnWorker(_OneWordModel(), worker), emit, Conversation(), heard,
                                    activity, ContextChanges())
        await answers.run()
    assert active_at_done == [None]
