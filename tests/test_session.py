"""The session's pipeline with stand-in models whose behaviour the assertions can predict: ordering,
waiting for the words heard before a question, errors that cost nothing else, cancel, backpressure,
video sampling and clean shutdown. The real tiny models run end to end in test_end_to_end.py."""

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.config import load_profile, with_overrides
from runtime.loaded_models import Models
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.lm import AnswerStep, NoAnswerer
from runtime.session import Session
from runtime.session_builder import open_session
from runtime.session_state import TransportStats
from runtime.worker import DeviceWorker

CHUNK = SAMPLE_RATE // 10  # 100 ms


class WordASR:
    """Hears one word per chunk: 'w<index>'; completes an item every `per_item` chunks."""

    name = "words"

    def __init__(self, per_item: int = 5, delay_s: float = 0.0, fail_on: int | None = None) -> None:
        self.per_item, self.delay_s, self.fail_on = per_item, delay_s, fail_on
        self.streams: list[WordStream] = []

    def open_stream(self) -> "WordStream":
        self.streams.append(WordStream(self))
        return self.streams[-1]


@dataclass
class WordStream:
    model: WordASR
    chunks: list[int] = field(default_factory=list)
    item: int = 0
    words: list[str] = field(default_factory=list)
    item_start: float = 0.0
    closed: bool = False
    threads: set[str] = field(default_factory=set)

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        self.threads.add(threading.current_thread().name)
        index = chunk.start_sample // CHUNK
        if index == self.model.fail_on:
            raise RuntimeError("corrupt chunk")
        time.sleep(self.model.delay_s)
        self.chunks.append(index)
        self.words.append(f"w{index}")
        out = [TranscriptUpdate(f"item{self.item}", f"w{index} ", "", self.item_start, chunk.end)]
        if len(self.words) == self.model.per_item:
            out.append(self._complete(chunk.end))
        return out

    def _complete(self, end: float) -> TranscriptUpdate:
        update = TranscriptUpdate(f"item{self.item}", "", "", self.item_start, end, True, " ".join(self.words))
        self.item, self.words, self.item_start = self.item + 1, [], end
        return update

    def finish(self) -> list[TranscriptUpdate]:
        return [self._complete(len(self.chunks) * CHUNK / SAMPLE_RATE)] if self.words else []

    def close(self) -> None:
        self.closed = True


class EchoAnswerer:
    """Answers by spelling back the last word of its context, one character per step."""

    name = "echo"

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.contexts: list[str] = []
        self.released = 0

    def open_stream(self) -> None:
        return None

    def start(self, context: str, question: str, *, seed=None, stream=None, suffix=None) -> "EchoAnswer":
        self.contexts.append(context)
        last = context.split()[-1] if context.split() else "nothing"
        return EchoAnswer(self, f"{question}->{last}")

    def embed_text(self, text: str) -> None:
        return None


class EchoAnswer:
    def __init__(self, answerer: EchoAnswerer, text: str) -> None:
        self.answerer, self.text, self.i = answerer, text, 0

    def step(self) -> AnswerStep:
        time.sleep(self.answerer.step_s)
        ch = self.text[self.i]
        self.i += 1
        done = self.i == len(self.text)
        return AnswerStep(ch, done, "stop" if done else None)

    def release(self) -> None:
        self.answerer.released += 1

    def stats(self) -> None:
        return None


class StreamingEchoAnswerer(EchoAnswerer):
    """Keeps per-stream state like the engine: records every context it was handed and prefills it in
    pieces of 5 characters (one worker job each)."""

    def open_stream(self) -> "StreamState":
        return StreamState()

    def start(self, context, question, *, seed=None, stream=None, suffix=None) -> "EchoAnswer":
        assert stream is not None and stream.pending() == 0, "the pipeline must prefill before answering"
        stream.prefilled_at_question.append(stream.prefilled)
        return super().start(context, question)


class StreamState:
    def __init__(self) -> None:
        self.target, self.prefilled, self.contexts, self.prefilled_at_question = "", "", [], []
        self.threads: set[str] = set()

    def set_context(self, text: str) -> None:
        self.contexts.append(text)
        keep = 0
        while keep < min(len(text), len(self.prefilled)) and text[keep] == self.prefilled[keep]:
            keep += 1
        self.target, self.prefilled = text, self.prefilled[:keep]  # update mode: keep the common prefix

    def pending(self) -> int:
        return len(self.target) - len(self.prefilled)

    def prefill_step(self) -> int:
        self.threads.add(threading.current_thread().name)
        n = min(5, self.pending())
        self.prefilled = self.target[: len(self.prefilled) + n]
        return n


def _profile(**pipeline):
    return with_overrides(load_profile("tiny"), pipeline={"metrics_interval_s": 0.0, **pipeline})


def _audio(n_chunks: int, start: int = 0) -> list[AudioChunk]:
    return [AudioChunk(np.zeros(CHUNK, np.float32), (start + i) * CHUNK) for i in range(n_chunks)]


async def _collect(session: Session) -> list:
    return [event async for event in session.events]


def _types(events) -> list[str]:
    return [e.type for e in events]


@pytest.fixture
def worker():
    with DeviceWorker() as w:
        yield w


@pytest.mark.asyncio
async def test_transcript_then_answer_in_order_with_no_task_left(worker):
    asr, answerer = WordASR(), EchoAnswerer()
    session = await (await open_session(_profile(), Models(asr, answerer), worker)).start()
    events = asyncio.create_task(_collect(session))
    for chunk in _audio(12):
        await session.push_audio(chunk)
    await session.ask("q", media_time=1.2)
    await session.finish()
    out = await events
    types = _types(out)
    assert types[0] == "session.created" and types[-1] == "metrics"
    completed = [e.transcript for e in out if e.type.endswith("transcription.completed")]
    assert completed == ["w0 w1 w2 w3 w4", "w5 w6 w7 w8 w9", "w10 w11"]
    answer = "".join(e.delta for e in out if e.type == "response.output_text.delta")
    assert answer == "q->w11"  # the answer waited for every word heard before the question
    assert types.index("response.created") < types.index("response.output_text.done") < types.index("response.done")
    done = next(e for e in out if e.type == "response.done")
    assert done.response["status"] == "completed" and done.response["usage"]["output_tokens"] == len("q->w11")
    assert asr.streams[0].chunks == list(range(12)) and asr.streams[0].closed
    assert asr.streams[0].threads == {worker.name}  # model compute ran on the worker, not the loop
    assert answerer.released == 1
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_question_mid_stream_sees_only_what_was_heard(worker):
    answerer = EchoAnswerer()
    session = await (await open_session(_profile(), Models(WordASR(per_item=100), answerer), worker)).start()
    events = asyncio.create_task(_collect(session))
    for chunk in _audio(5):
        await session.push_audio(chunk)
    await session.ask("mid")  # media time 0.5 s: words w0..w4
    for chunk in _audio(5, start=5):
        await session.push_audio(chunk)
    await session.finish()
    await events
    assert answerer.contexts[0].split()[-1] == "w4"


@pytest.mark.asyncio
async def test_media_times_line_up(worker):
    session = await (await open_session(_profile(), Models(WordASR(per_item=3), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(session))
    for chunk in _audio(9):
        await session.push_audio(chunk)
    await session.finish()
    out = [e for e in await events if e.type.startswith("conversation.item")]
    ends = [e.end for e in out]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(0.9)
    completed = [e for e in out if e.type.endswith("completed")]
    spans = [(c.start, c.end) for c in completed]
    assert spans == [(0.0, pytest.approx(0.3)), (pytest.approx(0.3), pytest.approx(0.6)),
                     (pytest.approx(0.6), pytest.approx(0.9))]
    assert all(e.media_time == e.end for e in out)


@pytest.mark.asyncio
async def test_bad_input_is_an_error_event_and_the_session_goes_on(worker):
    asr = WordASR(fail_on=2)
    session = await (await open_session(_profile(), Models(asr, EchoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(session))
    assert await session.ask("   ", client_event_id="evt_client", media_time=1.5) is None
    with pytest.raises(ValueError, match="contiguous"):
        await session.push_audio(AudioChunk(np.zeros(10, np.float32), 999))
    for chunk in _audio(4):
        await session.push_audio(chunk)
    await session.ask("still there?")
    await session.finish()
    out = await events
    errors = [e.error for e in out if e.type == "error"]
    assert [e["code"] for e in errors] == ["empty_question", "asr_failed"]
    assert errors[0]["event_id"] == "evt_client" and errors[0]["param"] == "text"
    assert errors[0]["message"] == "the question is empty"
    assert next(e for e in out if e.type == "error").media_time == 1.5
    assert asr.streams[0].chunks == [0, 1, 3]  # only the bad chunk was lost
    assert "".join(e.delta for e in out if e.type == "response.output_text.delta") == "still there?->w3"


@pytest.mark.asyncio
async def test_cancel_stops_the_answer_within_a_step(worker):
    answerer = EchoAnswerer(step_s=0.02)
    session = await (await open_session(_profile(), Models(WordASR(), answerer), worker)).start()
    seen: list = []

    async def consume():
        async for event in session.events:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) < 100:
                session.cancel_response()

    consumer = asyncio.create_task(consume())
    await session.ask("a long question that would take many steps")
    await session.finish()
    await consumer
    deltas = [e for e in seen if e.type == "response.output_text.delta"]
    done = next(e for e in seen if e.type == "response.done")
    assert done.response["status"] == "cancelled"
    assert len(deltas) <= 2 and answerer.released == 1


@pytest.mark.asyncio
async def test_slow_asr_slows_the_source_and_loses_no_audio(worker):
    asr = WordASR(per_item=1000, delay_s=0.01)
    session = await (await open_session(_profile(audio_queue_chunks=3), Models(asr, EchoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(session))
    started = time.perf_counter()
    for chunk in _audio(40):
        await session.push_audio(chunk)
        assert len(session.audio_in) <= 3
    pushing_s = time.perf_counter() - started
    await session.finish()
    out = await events
    assert asr.streams[0].chunks == list(range(40))
    assert pushing_s >= 0.01 * (40 - 3 - 2)  # the producer was held back by the consumer
    final = out[-1].metrics["channels"]["audio"]
    assert final["dropped"] == 0 and final["blocked_s"] > 0 and final["max_depth"] == 3


@pytest.mark.asyncio
async def test_video_is_sampled_at_the_configured_fps(worker):
    profile = with_overrides(_profile(), video={"fps": 2.0})
    session = await (await open_session(profile, Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(session))
    image = np.zeros((8, 8, 3), np.uint8)
    kept = [session.push_video(VideoFrame(image, i / 30)) for i in range(90)]  # 3 s at 30 fps
    await session.finish()
    out = await events
    assert sum(kept) == 6
    video = out[-1].metrics["video"]
    assert video["frames_in"] == 90 and video["fps_skipped"] == 84
    assert video["processed"] + video["dropped_full"] == 6


@pytest.mark.asyncio
async def test_stop_mid_answer_leaves_nothing_behind(worker):
    asr, answerer = WordASR(), EchoAnswerer(step_s=0.05)
    session = await (await open_session(_profile(), Models(asr, answerer), worker)).start()
    events = asyncio.create_task(_collect(session))
    for chunk in _audio(3):
        await session.push_audio(chunk)
    await session.ask("something long enough to still be answering")
    await asyncio.sleep(0.2)
    await session.stop()
    out = await events
    assert out[-1].type == "metrics"
    assert asr.streams[0].closed and answerer.released == 1
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert await worker.run(0, lambda: "alive") == "alive"


@pytest.mark.asyncio
async def test_full_question_queue_is_refused_with_an_error(worker):
    session = await (await open_session(_profile(question_queue=1), Models(WordASR(), EchoAnswerer(step_s=0.05)),
                                        worker)).start()
    events = asyncio.create_task(_collect(session))
    ids = [await session.ask(f"q{i}") for i in range(4)]
    await session.stop()
    out = await events
    assert ids[0] is not None and None in ids
    assert any(e.type == "error" and e.error["code"] == "question_queue_full" for e in out)


@pytest.mark.asyncio
async def test_metrics_are_emitted_periodically(worker):
    models = Models(WordASR(), EchoAnswerer())
    session = await (await open_session(_profile(metrics_interval_s=0.05), models, worker)).start()
    events = asyncio.create_task(_collect(session))
    await session.push_audio(_audio(1)[0])
    await asyncio.sleep(0.3)
    await session.finish()
    reports = [e for e in await events if e.type == "metrics"]
    assert [e.media_time for e in reports] == [pytest.approx(0.1)] * len(reports)  # the newest media time pushed
    metrics = [e.metrics for e in reports]
    assert len(metrics) >= 3 and metrics[0]["asr"]["pushed_until"] == 0.1
    assert {"loop_lag", "channels", "video", "asr", "worker"} <= set(metrics[-1])
    assert metrics[-1]["loop_lag"]["samples"] > 0


@pytest.mark.asyncio
async def test_transcript_is_prefilled_as_it_arrives(worker):
    answerer = StreamingEchoAnswerer()
    session = await (await open_session(_profile(), Models(WordASR(per_item=4), answerer), worker)).start()
    events = asyncio.create_task(_collect(session))
    for chunk in _audio(8):
        await session.push_audio(chunk)
    await asyncio.sleep(0.2)  # idle: the prefiller catches up in the background
    stream = session.answers.lm_stream
    assert stream.prefilled == session.memory.context() and "w7" in stream.prefilled
    assert stream.threads == {worker.name}  # prefill ran on the device worker
    await session.ask("q")
    await session.finish()
    out = await events
    assert "".join(e.delta for e in out if e.type == "response.output_text.delta") == "q->w7"
    assert stream.prefilled_at_question == [session.memory.context()]
    assert out[-1].metrics["answers"]["prefilled_tokens"] == len(stream.prefilled)
    assert asyncio.all_tasks() == {asyncio.current_task()}


class ScriptedAnswerer:
    """Plays a script of steps per answer (one script per question, in order); `fail_start` raises in `start`,
    `fail_step` raises at that step index. Counts releases; `stats` returns `decoding`."""

    name = "scripted"

    def __init__(self, *scripts: list[AnswerStep], fail_start: bool = False, fail_step: int | None = None,
                 decoding: dict | None = None) -> None:
        self.scripts, self.fail_start, self.fail_step, self.decoding = list(scripts), fail_start, fail_step, decoding
        self.released = 0
        self.steps_taken = 0

    def open_stream(self) -> None:
        return None

    def start(self, context, question, *, seed=None, stream=None, suffix=None) -> "ScriptedAnswer":
        if self.fail_start:
            raise RuntimeError("out of memory")
        return ScriptedAnswer(self, self.scripts.pop(0))

    def embed_text(self, text: str) -> None:
        return None


class ScriptedAnswer:
    def __init__(self, model: ScriptedAnswerer, script: list[AnswerStep]) -> None:
        self.model, self.script, self.i = model, script, 0

    def step(self) -> AnswerStep:
        if self.i == self.model.fail_step:
            raise RuntimeError("bad step")
        self.i += 1
        self.model.steps_taken += 1
        return self.script[self.i - 1]

    def release(self) -> None:
        self.model.released += 1

    def stats(self) -> dict | None:
        return self.model.decoding


async def _answer_events(worker, answerer, *questions: tuple[str, float]) -> list:
    session = await (await open_session(_profile(), Models(WordASR(), answerer), worker)).start()
    events = asyncio.create_task(_collect(session))
    for text, at in questions:
        await session.ask(text, media_time=at, wait=True)
    await session.finish()
    return await events


@pytest.mark.asyncio
async def test_an_answer_cut_at_max_tokens_is_incomplete_with_its_usage(worker):
    steps = [AnswerStep("ab", False, None, tokens=2), AnswerStep("", False, None, tokens=1),
             AnswerStep("c", True, "length", tokens=3)]
    out = await _answer_events(worker, ScriptedAnswerer(steps, decoding={"target_forwards": 3}), ("  why?  ", 0.7))
    created = next(e for e in out if e.type == "response.created")
    deltas = [e for e in out if e.type == "response.output_text.delta"]
    text_done = next(e for e in out if e.type == "response.output_text.done")
    done = next(e for e in out if e.type == "response.done")
    rid = created.response["id"]
    assert created.response == {"id": rid, "object": "realtime.response", "status": "in_progress",
                                "question": "why?"}
    assert [d.delta for d in deltas] == ["ab", "c"]  # an empty delta (a partial character) is not emitted
    item = deltas[0].item_id
    assert item.startswith("item_") and rid.startswith("resp_")
    assert {d.item_id for d in deltas} == {item} and text_done.item_id == item and text_done.text == "abc"
    assert {d.response_id for d in deltas} == {rid} and text_done.response_id == rid and done.response["id"] == rid
    r = done.response
    assert r["status"] == "incomplete" and r["status_details"] == {"reason": "max_output_tokens"}
    assert r["usage"] == {"output_tokens": 6, "decode_steps": 3}
    assert r["output"] == [{"id": item, "type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "abc"}]}]
    assert r["decoding"] == {"target_forwards": 3} and "video" not in r
    assert 0 <= r["timing"]["first_token_s"] <= r["timing"]["total_s"]
    assert {e.media_time for e in (created, *deltas, text_done, done)} == {0.7}
    assert out[-1].metrics["answers"]["answered"] == 1


@pytest.mark.asyncio
async def test_a_completed_answer_has_no_status_details_and_no_decoding_stats(worker):
    out = await _answer_events(worker, ScriptedAnswerer([AnswerStep("ok", True, "stop")]), ("q", 0.0))
    r = next(e for e in out if e.type == "response.done").response
    assert r["status"] == "completed" and r["status_details"] is None and "decoding" not in r
    assert r["usage"] == {"output_tokens": 1, "decode_steps": 1}


@pytest.mark.asyncio
async def test_an_answer_that_fails_to_start_is_failed_and_the_next_question_is_answered(worker):
    answerer = ScriptedAnswerer([AnswerStep("fine", True, "stop")], fail_start=True)
    session = await (await open_session(_profile(), Models(WordASR(), answerer), worker)).start()
    events = asyncio.create_task(_collect(session))
    await session.ask("first", media_time=0.3, client_event_id="c1", wait=True)
    answerer.fail_start = False
    await session.ask("second", wait=True)
    await session.finish()
    out = await events
    errors = [e for e in out if e.type == "error"]
    assert len(errors) == 1 and errors[0].media_time == 0.3
    assert errors[0].error == {"type": "server_error", "code": "response_failed", "event_id": "c1", "param": None,
                               "message": "answering failed: out of memory"}
    first, second = [e.response for e in out if e.type == "response.done"]
    assert first["status"] == "failed" and first["status_details"] == {"reason": "error"}
    assert first["usage"] == {"output_tokens": 0, "decode_steps": 0} and first["timing"]["first_token_s"] is None
    assert first["output"][0]["content"][0]["text"] == ""
    assert second["status"] == "completed" and second["output"][0]["content"][0]["text"] == "fine"
    assert answerer.released == 1  # only the answer that started holds state to release
    assert out[-1].metrics["answers"]["answered"] == 2 and session.activity.open == 0


@pytest.mark.asyncio
async def test_an_answer_failing_mid_decode_keeps_its_text_and_releases_its_state(worker):
    steps = [AnswerStep("ab", False, None), AnswerStep("cd", False, None), AnswerStep("e", True, "stop")]
    answerer = ScriptedAnswerer(steps, fail_step=2)
    out = await _answer_events(worker, answerer, ("q", 0.0))
    assert "".join(e.delta for e in out if e.type == "response.output_text.delta") == "abcd"
    assert next(e for e in out if e.type == "response.output_text.done").text == "abcd"
    r = next(e for e in out if e.type == "response.done").response
    assert r["status"] == "failed" and r["usage"] == {"output_tokens": 2, "decode_steps": 2}
    assert answerer.released == 1


@pytest.mark.asyncio
async def test_the_question_queue_takes_exactly_its_capacity(worker):
    session = await (await open_session(_profile(question_queue=2), Models(WordASR(), EchoAnswerer(step_s=0.01)),
                                        worker)).start()
    events = asyncio.create_task(_collect(session))
    ids = [await session.ask(f"q{i}", client_event_id=f"c{i}") for i in range(4)]  # no yield: none taken yet
    assert [i is not None for i in ids] == [True, True, False, False]
    assert session.activity.open == 2  # a refused question is not waited for
    await session.finish()
    assert await session.ask("late", client_event_id="c-late") is None
    out = await events
    refused = [e.error for e in out if e.type == "error"]
    assert [(e["code"], e["event_id"]) for e in refused] == [("question_queue_full", "c2"),
                                                             ("question_queue_full", "c3")]
    assert [e.media_time for e in out if e.type == "error"] == [0.0, 0.0]
    assert refused[0]["message"] == "question queue is full (2 waiting); ask again after the current answer"
    assert [e.response["id"] for e in out if e.type == "response.done"] == ids[:2]
    assert session.activity.open == 0


@pytest.mark.asyncio
async def test_a_question_after_the_end_is_refused_as_closed(worker):
    session = await (await open_session(_profile(), Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(session))
    session.questions.close()
    assert await session.ask("late", media_time=2.5, client_event_id="c9") is None
    await session.finish()
    err = next(e for e in await events if e.type == "error")
    assert err.error["message"] == "question queue is closed; ask again after the current answer"
    assert err.error["event_id"] == "c9" and err.media_time == 2.5 and session.activity.open == 0


@pytest.mark.asyncio
async def test_final_metrics_report_the_numbers_measured(worker):
    transport = TransportStats(audio_buffered_s=0.25006, audio_dropped_s=0.5, rate_limited={"audio": 2.0})
    session = await (await open_session(_profile(), Models(WordASR(), EchoAnswerer()), worker,
                                        transport=transport)).start()
    events = asyncio.create_task(_collect(session))
    for chunk in _audio(5):
        await session.push_audio(chunk)
    await session.push_audio(AudioChunk(np.zeros(1, np.float32), 5 * CHUNK))  # ends at 0.5000625 s
    image = np.zeros((8, 8, 3), np.uint8)
    kept = [session.push_video(VideoFrame(image, t)) for t in (0.0, 0.5, 1.0, 1.2)]  # 1 fps: 0.0 and 1.0
    assert kept == [True, False, True, False] and session.media_time == 1.2
    await session.ask("q", wait=True)  # asked at media time 1.2, after 0.5 s of audio
    await session.finish()
    out = await events
    created = next(e for e in out if e.type == "response.created")
    assert created.media_time == 1.2
    final = out[-1]
    assert final.type == "metrics" and final.media_time == 1.2
    m = final.metrics
    # heard all 0.5000625 s pushed and the transport holds 0.25006 s more (reported to the millisecond)
    assert m["asr"] == {"pushed_until": 0.5, "heard_until": 0.5, "lag_s": 0.25, "dropped_s": 0.5}
    assert m["answers"] == {"answered": 1, "prefilled_tokens": 0}
    assert m["rate_limited"] == {"audio": 2.0}
    assert m["video"] == {"frames_in": 4, "fps_skipped": 2, "dropped_full": 0, "processed": 2, "encoded": 0,
                          "batches": 0}
    assert list(m["channels"]) == ["audio", "video", "questions", "events"]
    assert (m["channels"]["audio"]["got"], m["channels"]["questions"]["got"]) == (6, 1)
    assert [e.type for e in out].count("metrics") == 1  # metrics_interval_s = 0: only the final report


@pytest.mark.asyncio
async def test_session_created_describes_the_models_and_settings(worker):
    profile = with_overrides(_profile(), video={"fps": 2.0})
    session = await (await open_session(profile, Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(session))
    await session.finish()
    created = (await events)[0]
    assert created.type == "session.created" and session.id.startswith("sess_")
    assert created.session == {
        "id": session.id, "object": "realtime.session", "profile": "tiny", "device": "cpu", "dtype": "float32",
        "random_weights": profile.random_weights,
        "asr": {"backend": "causal-whisper", "model": "tiny:whisper", "language": "en"},
        "lm": {"backend": "engine", "model": "tiny:llava-onevision", "max_new_tokens": 24},
        "video": {"fps": 2.0, "max_side": 320, "memory_tokens": 0},
    }
    transcribe = await (await open_session(profile, Models(WordASR(), NoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(transcribe))
    await transcribe.finish()
    assert (await events)[0].session["lm"] == {"backend": "none"}


@pytest.mark.asyncio
async def test_cancel_names_the_current_answer_only(worker):
    answerer = EchoAnswerer(step_s=0.02)
    session = await (await open_session(_profile(), Models(WordASR(), answerer), worker)).start()
    events = asyncio.create_task(_collect(session))
    assert not session.cancel_response()  # nothing is being answered
    rid = await session.ask("a question long enough to cancel")
    for _ in range(100):
        if session.answers.current is not None:
            break
        await asyncio.sleep(0.01)
    assert not session.cancel_response("resp_someone_else")
    assert session.cancel_response(rid)
    await session.finish()
    out = await events
    done = next(e for e in out if e.type == "response.done")
    assert done.response["status"] == "cancelled" and done.response["status_details"] == {
        "reason": "client_cancelled"}
    assert done.response["usage"]["decode_steps"] <= 2 and answerer.released == 1
    assert not session.cancel_response(rid)  # over


@pytest.mark.asyncio
async def test_finish_and_stop_run_once(worker):
    asr = WordASR()
    session = await (await open_session(_profile(), Models(asr, EchoAnswerer()), worker)).start()
    assert await session.start() is session  # a second start starts nothing more
    events = asyncio.create_task(_collect(session))
    await session.finish()
    await session.finish()
    await session.stop()
    out = await events
    assert [e.type for e in out] == ["session.created", "metrics"] and asr.streams[0].closed
    assert out[-1].media_time == 0.0  # no media came
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_leaving_the_session_with_an_error_stops_it_and_a_clean_exit_finishes_it(worker):
    answerer = EchoAnswerer(step_s=0.05)
    with pytest.raises(RuntimeError, match="the caller failed"):
        async with await open_session(_profile(), Models(WordASR(), answerer), worker) as session:
            events = asyncio.create_task(_collect(session))
            await session.ask("a question that takes a while to answer")
            await asyncio.sleep(0.1)
            raise RuntimeError("the caller failed")
    out = await events
    assert "response.done" not in [e.type for e in out] and answerer.released == 1  # stopped, not drained
    async with await open_session(_profile(), Models(WordASR(), EchoAnswerer()), worker) as session:
        events = asyncio.create_task(_collect(session))
        await session.ask("q")
    assert [e.response["status"] for e in await events if e.type == "response.done"] == ["completed"]
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_video_settled_waits_for_the_frames_kept_minus_those_dropped(worker):
    session = await (await open_session(_profile(), Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(_collect(session))
    image = np.zeros((8, 8, 3), np.uint8)
    for t in (0.0, 1.0, 2.0):  # no yield in between: the queue of 2 drops the oldest
        assert session.push_video(VideoFrame(image, t))
    await asyncio.wait_for(session.video_settled(), 2)
    assert session.video_in.stats.dropped == 1 and session.video.settled == 2 and session.video.latest.time == 2.0
    await session.finish()
    await events


@pytest.mark.asyncio
async def test_pushed_until_counts_only_audio_in_the_queue_and_a_question_waits_for_no_more(worker):
    asr = WordASR(per_item=100, delay_s=0.03)
    session = await (await open_session(_profile(audio_queue_chunks=1), Models(asr, EchoAnswerer()),
                                        worker)).start()
    events = asyncio.create_task(_collect(session))
    for chunk in _audio(3):
        await session.push_audio(chunk)
    pending = asyncio.create_task(session.push_audio(_audio(1, start=3)[0]))  # waits for room
    await asyncio.sleep(0)
    assert session.received_until == pytest.approx(0.4) and session.pushed_until == pytest.approx(0.3)
    await pending
    assert session.pushed_until == pytest.approx(0.4)
    await session.ask("q", media_time=0.2)  # heard up to 0.2 s is enough: w0 w1
    await session.finish()
    out = await events
    assert "".join(e.delta for e in out if e.type == "response.output_text.delta") in ("q->w1", "q->w2", "q->w3")


class _NoLM(EchoAnswerer):
    def open_stream(self) -> None:
        raise RuntimeError("out of memory")


@pytest.mark.asyncio
async def test_a_failed_lm_stream_closes_the_asr_stream_already_opened(worker):
    asr = WordASR()
    with pytest.raises(RuntimeError, match="out of memory"):
        await open_session(_profile(), Models(asr, _NoLM()), worker)
    assert len(asr.streams) == 1 and asr.streams[0].closed


@pytest.mark.asyncio
async def test_the_builder_sizes_the_channels_from_the_profile(worker):
    profile = _profile(audio_queue_chunks=3, video_queue_frames=4, question_queue=5, event_queue=6)
    session = await open_session(profile, Models(WordASR(), StreamingEchoAnswerer()), worker)
    channels = (session.audio_in, session.video_in, session.questions, session.events)
    assert [(c.name, c.capacity) for c in channels] == [("audio", 3), ("video", 4), ("questions", 5), ("events", 6)]
    assert session.sampler.period == 1.0 and session.video_memory is None and session.notes is None
    assert session.prefiller is not None and session.answers.prefiller is session.prefiller
    assert session.answers.lm_stream is session.prefiller.stream
    await session.start()
    events = asyncio.create_task(_collect(session))
    await session.finish()
    await events


@pytest.mark.asyncio
async def test_finish_closes_the_session_even_when_a_processor_crashed(worker):
    asr = WordASR()
    session = await open_session(_profile(), Models(asr, EchoAnswerer()), worker)

    async def crash(*_):
        raise RuntimeError("processor bug")

    session.audio._publish = crash
    session.answers._answer = crash
    await session.start()
    events = asyncio.create_task(_collect(session))
    await session.push_audio(_audio(1)[0])
    await session.ask("q")
    await session.finish()  # the crashed tasks' errors do not stop the close
    out = await events
    assert out[-1].type == "metrics" and asr.streams[0].closed and session.activity.open == 0
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


class _BadClose(WordASR):
    def open_stream(self) -> "WordStream":
        stream = super().open_stream()

        def close() -> None:
            stream.closed = True
            raise OSError("close failed too")

        stream.close = close
        return stream


@pytest.mark.asyncio
async def test_when_the_lm_stream_fails_its_error_is_raised_not_the_asr_close_error(worker):
    asr = _BadClose()
    with pytest.raises(RuntimeError, match="out of memory"):
        await open_session(_profile(), Models(asr, _NoLM()), worker)
    assert asr.streams[0].closed


@pytest.mark.asyncio
async def test_a_session_never_started_can_still_be_stopped_or_finished(worker):
    for end in ("stop", "finish"):
        asr = WordASR()
        session = await open_session(_profile(), Models(asr, EchoAnswerer()), worker)
        events = asyncio.create_task(_collect(session))
        await getattr(session, end)()
        assert [e.type for e in await events] == ["metrics"] and asr.streams[0].closed


class _BrokenVision:
    """A vision tower that cannot encode: each batch is an error event, the session goes on."""

    dim, dtype = 8, torch.float32

    def encode(self, images):
        raise RuntimeError("no vision today")


@pytest.mark.asyncio
async def test_a_failing_vision_tower_is_an_error_event_in_a_session(worker):
    models = Models(WordASR(), EchoAnswerer(), vision=_BrokenVision())
    session = await (await open_session(_profile(), models, worker)).start()
    events = asyncio.create_task(_collect(session))
    session.push_video(VideoFrame(np.zeros((8, 8, 3), np.uint8), 0.0))
    await session.video_settled()
    await session.finish()
    errors = [e for e in await events if e.type == "error"]
    assert [(e.error["code"], e.media_time) for e in errors] == [("video_failed", 0.0)]
    assert session.video.encoded == 0 and session.video.settled == 1
