"""A session's life and what it reports: built in one place (channel sizes, streams opened on the worker and
closed when the build fails), started, finished or stopped once, described in `session.created`, and measured
in `metrics`, with stand-in models whose numbers the assertions can predict."""

import asyncio

import numpy as np
import pytest
import torch
from session_fakes import (
    CHUNK,
    EchoAnswerer,
    StreamingEchoAnswerer,
    WordASR,
    WordStream,
    audio_chunks,
    collect,
    profile_for,
)

from runtime.chunks import AudioChunk, VideoFrame
from runtime.config import with_overrides
from runtime.loaded_models import Models
from runtime.models.lm import NoAnswerer
from runtime.session_builder import open_session
from runtime.session_config import SessionConfig
from runtime.session_state import TransportStats


@pytest.mark.asyncio
async def test_final_metrics_report_the_numbers_measured(worker):
    transport = TransportStats(audio_buffered_s=0.25006, audio_dropped_s=0.50049, rate_limited={"audio": 2.0})
    session = await (await open_session(profile_for(), Models(WordASR(), EchoAnswerer()), worker,
                                        transport=transport)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(5):
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
    assert final.type == "runtime.metrics" and final.media_time == 1.2
    m = final.metrics
    # heard all 0.5000625 s pushed and the transport holds 0.25006 s more (reported to the millisecond)
    assert m["asr"] == {"pushed_until": 0.5, "heard_until": 0.5, "lag_s": 0.25, "dropped_s": 0.5}
    assert m["answers"] == {"answered": 1, "prefilled_tokens": 0}
    assert m["rate_limited"] == {"audio": 2.0}
    assert m["video"] == {"frames_in": 4, "fps_skipped": 2, "dropped_full": 0, "processed": 2, "encoded": 0,
                          "batches": 0}
    assert list(m["channels"]) == ["audio", "video", "questions", "events"]
    assert (m["channels"]["audio"]["got"], m["channels"]["questions"]["got"]) == (6, 1)
    assert [e.type for e in out].count("runtime.metrics") == 1  # metrics_interval_s = 0: only the final report


@pytest.mark.asyncio
async def test_session_created_describes_the_models_and_settings(worker):
    profile = with_overrides(profile_for(), video={"fps": 2.0})
    session = await (await open_session(profile, Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
    await session.finish()
    created = (await events)[0]
    assert created.type == "session.created" and session.id.startswith("sess_")
    ga = SessionConfig(turn_detection=None).to_api()  # no turn models loaded: the client commits by hand
    assert ga["audio"]["input"]["turn_detection"] is None and ga["type"] == "realtime"
    assert created.session == {
        "id": session.id, "object": "realtime.session", **ga, "profile": "tiny", "device": "cpu",
        "dtype": "float32", "random_weights": profile.random_weights,
        "asr": {"backend": "causal-whisper", "model": "tiny:whisper", "language": "en"},
        "lm": {"backend": "engine", "model": "tiny:llava-onevision", "max_new_tokens": 24},
        "video": {"fps": 2.0, "max_side": 320, "memory_tokens": 0},
    }
    transcribe = await (await open_session(profile, Models(WordASR(), NoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(transcribe))
    await transcribe.finish()
    assert (await events)[0].session["lm"] == {"backend": "none"}


@pytest.mark.asyncio
async def test_finish_and_stop_run_once(worker):
    asr = WordASR()
    session = await (await open_session(profile_for(), Models(asr, EchoAnswerer()), worker)).start()
    assert await session.start() is session  # a second start starts nothing more
    events = asyncio.create_task(collect(session))
    await session.finish()
    await session.finish()
    await session.stop()
    out = await events
    assert [e.type for e in out] == ["session.created", "runtime.metrics"] and asr.streams[0].closes == 1
    assert out[-1].media_time == 0.0  # no media came
    assert out[-1].metrics["asr"] == {"pushed_until": 0.0, "heard_until": 0.0, "lag_s": 0.0, "dropped_s": 0.0}
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_leaving_the_session_with_an_error_stops_it_and_a_clean_exit_finishes_it(worker):
    answerer = EchoAnswerer(step_s=0.05)
    with pytest.raises(RuntimeError, match="the caller failed"):
        async with await open_session(profile_for(), Models(WordASR(), answerer), worker) as session:
            events = asyncio.create_task(collect(session))
            await session.ask("a question that takes a while to answer")
            await asyncio.sleep(0.1)
            raise RuntimeError("the caller failed")
    out = await events
    assert "response.done" not in [e.type for e in out] and answerer.released == 1  # stopped, not drained
    async with await open_session(profile_for(), Models(WordASR(), EchoAnswerer()), worker) as session:
        events = asyncio.create_task(collect(session))
        await session.ask("q")
    assert [e.response["status"] for e in await events if e.type == "response.done"] == ["completed"]
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_video_settled_waits_for_the_frames_kept_minus_those_dropped(worker):
    session = await (await open_session(profile_for(), Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
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
    session = await (await open_session(profile_for(audio_queue_chunks=1), Models(asr, EchoAnswerer()),
                                        worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(3):
        await session.push_audio(chunk)
    pending = asyncio.create_task(session.push_audio(audio_chunks(1, start=3)[0]))  # waits for room
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
        await open_session(profile_for(), Models(asr, _NoLM()), worker)
    assert len(asr.streams) == 1 and asr.streams[0].closed


@pytest.mark.asyncio
async def test_the_builder_sizes_the_channels_from_the_profile(worker):
    profile = profile_for(audio_queue_chunks=3, video_queue_frames=4, question_queue=5, event_queue=6)
    session = await open_session(profile, Models(WordASR(), StreamingEchoAnswerer()), worker)
    channels = (session.audio_in, session.video_in, session.questions, session.events)
    assert [(c.name, c.capacity) for c in channels] == [("audio", 3), ("video", 4), ("questions", 5), ("events", 6)]
    assert session.sampler.period == 1.0 and session.video_memory is None and session.notes is None
    assert session.prefiller is not None and session.answers.prefiller is session.prefiller
    assert session.answers.answering.stream is session.prefiller.stream
    await session.start()
    events = asyncio.create_task(collect(session))
    await session.finish()
    await events


@pytest.mark.asyncio
async def test_finish_closes_the_session_even_when_a_processor_crashed(worker):
    asr = WordASR()
    session = await open_session(profile_for(), Models(asr, EchoAnswerer()), worker)

    async def crash(*_):
        raise RuntimeError("processor bug")

    session.audio._publish = crash
    session.answers._answer = crash
    await session.start()
    events = asyncio.create_task(collect(session))
    await session.push_audio(audio_chunks(1)[0])
    await session.ask("q")
    await session.finish()  # the crashed tasks' errors do not stop the close
    out = await events
    assert out[-1].type == "runtime.metrics" and asr.streams[0].closed and session.activity.open == 0
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
        await open_session(profile_for(), Models(asr, _NoLM()), worker)
    assert asr.streams[0].closed


@pytest.mark.asyncio
async def test_a_session_never_started_can_still_be_stopped_or_finished(worker):
    for end in ("stop", "finish"):
        asr = WordASR()
        session = await open_session(profile_for(), Models(asr, EchoAnswerer()), worker)
        events = asyncio.create_task(collect(session))
        await getattr(session, end)()
        assert [e.type for e in await events] == ["runtime.metrics"] and asr.streams[0].closed


class _BrokenVision:
    """A vision tower that cannot encode: each batch is an error event, the session goes on."""

    dim, dtype = 8, torch.float32

    def encode(self, images):
        raise RuntimeError("no vision today")


@pytest.mark.asyncio
async def test_a_failing_vision_tower_is_an_error_event_in_a_session(worker):
    models = Models(WordASR(), EchoAnswerer(), vision=_BrokenVision())
    session = await (await open_session(profile_for(), models, worker)).start()
    events = asyncio.create_task(collect(session))
    session.push_video(VideoFrame(np.zeros((8, 8, 3), np.uint8), 0.0))
    await session.video_settled()
    await session.finish()
    errors = [e for e in await events if e.type == "error"]
    assert [(e.error["code"], e.media_time) for e in errors] == [("video_failed", 0.0)]
    assert session.video.encoded == 0 and session.video.settled == 1


@pytest.mark.asyncio
async def test_an_asr_stream_that_fails_to_close_costs_nothing_else(worker):
    asr = WordASR(fail_close=True)
    session = await (await open_session(profile_for(), Models(asr, EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(2):
        await session.push_audio(chunk)
    await session.finish()  # the close fails on the worker; the session still ends with its final metrics
    out = await events
    assert asr.streams[0].closes == 1 and out[-1].type == "runtime.metrics" and session.events.closed
    assert asyncio.all_tasks() == {asyncio.current_task()}
