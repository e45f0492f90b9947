"""Video memory in a live session with the tiny LLaVA-OneVision: frames land in memory while questions are
answered, notes are written when idle, and a text-only model or a bad size is handled clearly."""

import asyncio

import numpy as np
import pytest

from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.config import ConfigError, with_overrides
from runtime.events import VideoNote
from runtime.loaded_models import load_models
from runtime.profile_files import load_profile
from runtime.session_builder import open_session
from runtime.worker import DeviceWorker

CHUNK = SAMPLE_RATE // 10


@pytest.fixture(scope="module")
def worker():
    with DeviceWorker() as w:
        yield w


def profile(**video):
    return with_overrides(load_profile("tiny"), pipeline={"metrics_interval_s": 0.0},
                          lm={"max_new_tokens": 4}, video=video)


@pytest.fixture(scope="module")
def models(worker):
    return load_models(profile(), worker)


def frame(t: float, seed: int) -> VideoFrame:
    rng = np.random.default_rng(seed)
    return VideoFrame(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), t)


async def push_seconds(session, start: int, stop: int) -> None:
    """One frame and ten silent audio chunks per media second, letting the pipeline run between them."""
    for s in range(start, stop):
        session.push_video(frame(float(s), s))
        for i in range(10):
            await session.push_audio(AudioChunk(np.zeros(CHUNK, np.float32), (s * 10 + i) * CHUNK))
        await asyncio.sleep(0.02)


async def wait_for(cond, timeout=30.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.mark.asyncio
async def test_question_while_frames_arrive_and_frames_after_it_land(models, worker):
    session = await (await open_session(profile(notes=False), models, worker)).start()
    events = []
    collector = asyncio.create_task(_collect(session, events))
    await push_seconds(session, 0, 6)
    await wait_for(lambda: session.video.encoded + session.video_in.stats.dropped >= 6)
    memory = session.video_memory
    assert memory is not None
    await session.ask("what was on screen?", media_time=6.0)
    seen_at_question = memory.snapshot().frames_seen
    await push_seconds(session, 6, 12)  # frames keep arriving while the answer is decoded
    await session.finish()
    await collector
    done = [e for e in events if e.type == "response.done"]
    assert len(done) == 1 and done[0].response["status"] in ("completed", "incomplete")
    assert "selected_segments" in done[0].response["video"]
    snap = memory.snapshot()
    # the frame queue holds 2 and drops the oldest when full (while the worker decodes, on a loaded machine):
    # every frame is either in memory or counted as dropped, and the newest one is never lost
    dropped = session.video_in.stats.dropped
    assert snap.frames_seen + dropped == 12 and snap.frames_seen > seen_at_question
    assert snap.tokens == memory.sizes.budget()
    metrics = [e for e in events if e.type == "runtime.metrics"][-1].metrics["video"]
    assert metrics["encoded"] == snap.frames_seen and metrics["dropped_full"] == dropped
    assert metrics["memory_tokens"] == metrics["memory_budget"] == memory.sizes.budget()
    assert metrics["segments"] == len(snap.segments) and metrics["notes"] == 0  # notes are off in this profile
    assert session.prefiller.prefilled_tokens > memory.sizes.budget()  # the memory was prefilled as it came


@pytest.mark.asyncio
async def test_notes_are_written_for_closed_segments_when_idle(models, worker):
    session = await (await open_session(profile(notes=True), models, worker)).start()
    events = []
    collector = asyncio.create_task(_collect(session, events))
    # segments of 4 s: three close. Two notes are waited for: a note the random tiny model happens to leave empty
    # (its first token an end) is only a missing note, and how the prefill was cut (machine load) can change it
    await push_seconds(session, 0, 14)
    await wait_for(lambda: session.notes.written >= 2)
    await session.finish()
    await collector
    assert session.notes.max_tokens == 8  # the profile's video.note_tokens
    created = events[0].session
    assert created["video"] == {"fps": 1.0, "max_side": 320, "memory_tokens": 84}  # 16 + 8*4 + 4 + 2*16
    notes = [e for e in events if isinstance(e, VideoNote)]
    assert len(notes) >= 2
    final = [e for e in events if e.type == "runtime.metrics"][-1].metrics["video"]
    assert final["notes"] == session.notes.written
    assert final["segments"] == len(session.video_memory.snapshot().segments) >= 2
    by_id = {s.id: s for s in session.video_memory.snapshot().segments}
    for note in notes:
        assert note.end <= 14 and note.start < note.end
        if note.segment_id in by_id:
            assert by_id[note.segment_id].note == note.text


@pytest.mark.asyncio
async def test_text_only_model_counts_frames_and_remembers_nothing(worker):
    p = with_overrides(load_profile("tiny"), lm={"model": "tiny:qwen2"}, pipeline={"metrics_interval_s": 0.0})
    messages = []
    models = load_models(p, worker, progress=messages.append)
    assert models.vision is None and any("text-only" in m for m in messages)
    session = await (await open_session(p, models, worker)).start()
    collector = asyncio.create_task(_collect(session, []))
    await push_seconds(session, 0, 3)
    await session.finish()
    await collector
    assert session.video_memory is None and session.video.frames == 3
    assert session.prefiller is not None and session.notes is None  # no memory: nothing to note


def test_memory_larger_than_the_window_is_refused(worker):
    p = with_overrides(load_profile("tiny"), video={"grid": 8, "temporal_slots": 25, "temporal_grid": 4,
                                                    "abstract_tokens": 25, "retrieved_frames": 3})
    with pytest.raises(ConfigError, match="window"):
        load_models(p, worker)
    with pytest.raises(ConfigError, match="video"):
        with_overrides(load_profile("tiny"), video={"temporal_grid": 3})


async def _collect(session, out):
    async for event in session.events:
        out.append(event)


@pytest.mark.asyncio
async def test_an_unpaced_video_file_loses_no_frame_and_answers_the_same_every_run(models, worker, tmp_path):
    """Played as fast as the pipeline takes it, a video-only file (no audio to slow the feed) must not drop
    frames as timing falls, nor batch them differently: the memory, and so the answer, is the same each run."""
    from runtime.feed import ScheduledQuestion, feed
    from runtime.io.file_source import FileSource
    from runtime.io.sample import render_frame, write_media_file

    path = write_media_file(tmp_path / "v.mp4", None, [(i / 2, render_frame((i / 2) % 13, 64, 48))
                                                       for i in range(60)])
    runs = []
    for _ in range(2):
        session = await (await open_session(profile(), models, worker)).start()
        events: list = []

        async def drain(session=session, events=events):
            async for event in session.events:
                events.append(event)

        consumer = asyncio.create_task(drain())
        await feed(FileSource(path, speed=0, fps=1.0), session, [ScheduledQuestion("what moves?", at=25.0)])
        await session.finish()
        await consumer
        video = [e for e in events if e.type == "runtime.metrics"][-1].metrics["video"]
        done = next(e for e in events if e.type == "response.done")
        answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        runs.append((video["dropped_full"], video["processed"], video["batches"], done.response["video"], answer))
    assert runs[0] == runs[1]
    dropped, processed, batches, _, _ = runs[0]
    assert dropped == 0 and processed == batches == 30  # one frame a batch, each waited for
