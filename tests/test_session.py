"""The session's pipeline with stand-in models whose behaviour the assertions can predict: ordering,
waiting for the words heard before a question, errors that cost nothing else, cancel, backpressure,
video sampling and clean shutdown. The real tiny models run end to end in test_end_to_end.py."""

import asyncio
import time

import numpy as np
import pytest
from session_fakes import (
    CHUNK,
    EchoAnswerer,
    StreamingEchoAnswerer,
    WordASR,
    audio_chunks,
    collect,
    profile_for,
    types_of,
)

from runtime.chunks import AudioChunk, VideoFrame
from runtime.config import with_overrides
from runtime.loaded_models import Models
from runtime.session_builder import open_session


@pytest.mark.asyncio
async def test_transcript_then_answer_in_order_with_no_task_left(worker):
    asr, answerer = WordASR(), EchoAnswerer()
    session = await (await open_session(profile_for(), Models(asr, answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(12):
        await session.push_audio(chunk)
    await session.ask("q", media_time=1.2)
    await session.finish()
    out = await events
    types = types_of(out)
    assert types[0] == "session.created" and types[-1] == "runtime.metrics"
    completed = [e.transcript for e in out if e.type.endswith("transcription.completed")]
    # no turn detection and no commit: the input is one buffer, so one user item, however the ASR cut it
    assert completed == ["w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11"]
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
    session = await (await open_session(profile_for(), Models(WordASR(per_item=100), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(5):
        await session.push_audio(chunk)
    await session.ask("mid")  # media time 0.5 s: words w0..w4
    for chunk in audio_chunks(5, start=5):
        await session.push_audio(chunk)
    await session.finish()
    await events
    assert answerer.contexts[0].split()[-1] == "w4"


@pytest.mark.asyncio
async def test_media_times_line_up(worker):
    session = await (await open_session(profile_for(), Models(WordASR(per_item=3), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(9):
        await session.push_audio(chunk)
        if chunk.end_sample % (3 * CHUNK) == 0 and chunk.end_sample < 9 * CHUNK:
            await session.commit_audio()  # a buffer of three chunks: one user item each
    await session.finish()
    out = [e for e in await events if e.type.startswith("conversation.item.input_audio_transcription")]
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
    session = await (await open_session(profile_for(), Models(asr, EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
    assert await session.ask("   ", client_event_id="evt_client", media_time=1.5) is None
    with pytest.raises(ValueError, match="contiguous"):
        await session.push_audio(AudioChunk(np.zeros(10, np.float32), 999))
    for chunk in audio_chunks(4):
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
    session = await (await open_session(profile_for(), Models(WordASR(), answerer), worker)).start()
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
    session = await (await open_session(profile_for(audio_queue_chunks=3), Models(asr, EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
    started = time.perf_counter()
    for chunk in audio_chunks(40):
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
    profile = with_overrides(profile_for(), video={"fps": 2.0})
    session = await (await open_session(profile, Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
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
    session = await (await open_session(profile_for(), Models(asr, answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(3):
        await session.push_audio(chunk)
    await session.ask("something long enough to still be answering")
    await asyncio.sleep(0.2)
    await session.stop()
    out = await events
    assert out[-1].type == "runtime.metrics"
    assert asr.streams[0].closed and answerer.released == 1
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert await worker.run(0, lambda: "alive") == "alive"


@pytest.mark.asyncio
async def test_full_question_queue_is_refused_with_an_error(worker):
    session = await (await open_session(profile_for(question_queue=1), Models(WordASR(), EchoAnswerer(step_s=0.05)),
                                        worker)).start()
    events = asyncio.create_task(collect(session))
    ids = [await session.ask(f"q{i}") for i in range(4)]
    await session.stop()
    out = await events
    assert ids[0] is not None and None in ids
    assert any(e.type == "error" and e.error["code"] == "question_queue_full" for e in out)


@pytest.mark.asyncio
async def test_metrics_are_emitted_periodically(worker):
    models = Models(WordASR(), EchoAnswerer())
    session = await (await open_session(profile_for(metrics_interval_s=0.05), models, worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(3):
        await session.push_audio(chunk)
    await asyncio.sleep(0.3)
    await session.finish()
    reports = [e for e in await events if e.type == "runtime.metrics"]
    assert len(reports) >= 3
    assert all(r.media_time == pytest.approx(0.3) for r in reports)  # stamped with the media reached
    metrics = [r.metrics for r in reports]
    keys = {"loop_lag", "channels", "video", "asr", "worker", "answers", "rate_limited"}
    assert all(set(m) == keys for m in metrics)  # the periodic reports as well as the final one
    assert metrics[-1]["loop_lag"]["samples"] > 0
    assert metrics[-1]["asr"]["pushed_until"] == 0.3 and metrics[-1]["asr"]["heard_until"] == 0.3
    assert metrics[-1]["channels"]["audio"]["depth"] == 0 and metrics[-1]["answers"]["answered"] == 0


@pytest.mark.asyncio
async def test_transcript_is_prefilled_as_it_arrives(worker):
    answerer = StreamingEchoAnswerer()
    session = await (await open_session(profile_for(), Models(WordASR(per_item=4), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(8):
        await session.push_audio(chunk)
    stream = session.answers.answering.stream
    for _ in range(500):  # idle: the prefiller catches up in the background, with no question asked
        if "w7" in session.conversation.context() and stream.prefilled == session.conversation.context():
            break
        await asyncio.sleep(0.01)
    assert stream.prefilled == session.conversation.context() and "w7" in stream.prefilled
    assert stream.threads == {worker.name}  # prefill ran on the device worker
    heard = session.conversation.context()
    await session.ask("q")
    await session.finish()
    out = await events
    assert "".join(e.delta for e in out if e.type == "response.output_text.delta") == "q->w7"
    assert stream.prefilled_at_question == [heard]  # what was heard; the question and answer joined after
    assert out[-1].metrics["answers"]["prefilled_tokens"] == len(stream.prefilled)
    assert asyncio.all_tasks() == {asyncio.current_task()}
