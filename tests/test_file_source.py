"""FileSource and the threaded handoff under it: exact audio, timed frames, pacing, bounded memory, clean
shutdown, and one-line errors for files that cannot be played."""

import asyncio
import threading
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.errors import MediaError
from runtime.io.file_source import FileSource, scaled_size
from runtime.io.sample import render_frame, write_media_file
from runtime.io.source import Source, ThreadedSource, available_time


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.4 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)


def frames(seconds: float, fps: int = 10, size: tuple[int, int] = (160, 120)):
    return [(i / fps, render_frame(i / fps, *size)) for i in range(int(seconds * fps))]


async def collect(source) -> list:
    return [item async for item in source]


def split(items: list) -> tuple[list[AudioChunk], list[VideoFrame]]:
    return [i for i in items if isinstance(i, AudioChunk)], [i for i in items if isinstance(i, VideoFrame)]


def source_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("source-")]


@pytest.mark.asyncio
async def test_wav_audio_is_exact_and_contiguous(tmp_path: Path) -> None:
    audio = tone(1.23)
    path = write_media_file(tmp_path / "a.wav", audio, None)
    source = FileSource(path, speed=0, chunk_ms=100)
    assert isinstance(source, Source)
    assert source.description == f"file {path}" and source.duration == pytest.approx(1.23, abs=0.01)
    chunks, video = split(await collect(source))
    assert not video
    assert [len(c.samples) for c in chunks[:-1]] == [1600] * 12 and len(chunks[-1].samples) == 480
    assert chunks[0].start_sample == 0
    assert all(a.end_sample == b.start_sample for a, b in zip(chunks, chunks[1:], strict=False))
    decoded = np.concatenate([c.samples for c in chunks])
    np.testing.assert_allclose(decoded, audio, atol=1 / 32768 + 1e-7)  # pcm_s16le quantisation
    assert source.position == pytest.approx(1.23)


@pytest.mark.asyncio
async def test_video_only_mp4(tmp_path: Path) -> None:
    path = write_media_file(tmp_path / "v.mp4", None, frames(2.0, size=(320, 240)))
    source = FileSource(path, speed=0, max_side=160)
    chunks, video = split(await collect(source))
    assert not chunks and len(video) == 20
    assert {(f.width, f.height) for f in video} == {(160, 120)}
    np.testing.assert_allclose([f.time for f in video], np.arange(20) / 10, atol=1e-3)


@pytest.mark.asyncio
async def test_audio_and_video_interleave_in_time_order(tmp_path: Path) -> None:
    path = write_media_file(tmp_path / "av.mp4", tone(2.0), frames(2.0), audio_codec="aac")
    items = await collect(FileSource(path, speed=0))
    chunks, video = split(items)
    assert len(video) == 20 and chunks
    times = [available_time(i) for i in items]
    assert times == sorted(times)
    assert chunks[0].start_sample == 0
    assert all(a.end_sample == b.start_sample for a, b in zip(chunks, chunks[1:], strict=False))
    assert abs(chunks[-1].end - 2.0) < 0.07  # AAC pads its last 1024-sample frame


@pytest.mark.asyncio
async def test_fps_thins_frames_and_video_off_skips_them(tmp_path: Path) -> None:
    path = write_media_file(tmp_path / "av.mkv", tone(2.0), frames(2.0))
    _, video = split(await collect(FileSource(path, speed=0, fps=2)))
    np.testing.assert_allclose([f.time for f in video], [0.0, 0.5, 1.0, 1.5], atol=1e-3)
    chunks, video = split(await collect(FileSource(path, speed=0, video=False)))
    assert chunks and not video


@pytest.mark.asyncio
async def test_speed_paces_release_to_the_wall_clock(tmp_path: Path) -> None:
    path = write_media_file(tmp_path / "a.flac", tone(1.0), None)
    start = time.monotonic()
    await collect(FileSource(path, speed=4.0))
    paced = time.monotonic() - start
    assert 0.2 < paced < 0.8  # 1 s of media at 4x: ~0.25 s
    start = time.monotonic()
    await collect(FileSource(path, speed=0))
    assert time.monotonic() - start < paced


@pytest.mark.parametrize("name", ["missing.mp4", "garbage.mp4", "dir"])
def test_unreadable_files_fail_on_construction(tmp_path: Path, name: str) -> None:
    (tmp_path / "garbage.mp4").write_bytes(b"this is not a video" * 100)
    (tmp_path / "dir").mkdir()
    with pytest.raises(MediaError) as info:
        FileSource(tmp_path / name)
    message = str(info.value)
    assert message.startswith(f"cannot read {tmp_path / name}: ") and "\n" not in message


def test_video_off_on_a_video_only_file_is_an_error(tmp_path: Path) -> None:
    path = write_media_file(tmp_path / "v.mp4", None, frames(0.5))
    with pytest.raises(MediaError, match="no audio stream"):
        FileSource(path, video=False)


def test_scaled_size() -> None:
    assert scaled_size(1920, 1080, 640) == (640, 360)
    assert scaled_size(480, 640, 320) == (240, 320)
    assert scaled_size(320, 240, 640) == (320, 240)


class Counting(ThreadedSource):
    """Produces numbered audio chunks forever (or fails after `fail_after`), counting what it produced."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__(queue_size=4)
        self.description, self.produced, self.fail_after = "counting", 0, fail_after

    def _producers(self):
        def produce(emit):
            while True:
                if self.fail_after is not None and self.produced >= self.fail_after:
                    raise MediaError("broken at 3")
                self.produced += 1
                if not emit(AudioChunk(np.zeros(16, np.float32), 16 * self.produced)):
                    return

        return [produce]


@pytest.mark.asyncio
async def test_slow_consumer_blocks_the_producer() -> None:
    source = Counting()
    iterator = aiter(source)
    for _ in range(3):
        await anext(iterator)
    await asyncio.sleep(0.3)
    assert source.produced <= 3 + 4 + 1  # taken + queue + one blocked in emit: memory stays bounded
    await source.aclose()
    assert not source_threads()


@pytest.mark.asyncio
async def test_break_stops_the_thread() -> None:
    source = Counting()
    async for item in source:
        if item.start_sample > 100:
            break
    deadline = time.monotonic() + 2
    while source_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not source_threads()
    with pytest.raises(RuntimeError):
        aiter(source)  # single use


@pytest.mark.asyncio
async def test_producer_error_reaches_the_consumer() -> None:
    with pytest.raises(MediaError, match="broken at 3"):
        await collect(Counting(fail_after=3))
    assert not source_threads()


@pytest.mark.asyncio
async def test_aclose_before_iteration_and_twice(tmp_path: Path) -> None:
    source = FileSource(write_media_file(tmp_path / "a.wav", tone(0.2), None))
    await source.aclose()
    await source.aclose()
    async with FileSource(tmp_path / "a.wav", speed=0) as again:
        assert len(await collect(again)) == 2


@pytest.mark.asyncio
async def test_aclose_from_another_task_ends_a_waiting_consumer(tmp_path: Path) -> None:
    source = FileSource(write_media_file(tmp_path / "a.wav", tone(3.0), None), speed=1.0)
    received = []

    async def consume() -> None:
        async for item in source:
            received.append(item)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.25)
    await source.aclose()
    await asyncio.wait_for(task, 1.0)
    assert 1 <= len(received) <= 4 and not source_threads()


def write_late_audio_mkv(path: Path, audio: np.ndarray, late_s: float) -> Path:
    """A Matroska file whose only audio stream starts at `late_s` (as an MP3's encoder delay, or a track that
    begins after the video): PCM frames with their pts shifted."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=SAMPLE_RATE, layout="mono")
        pcm = (audio * 32767).astype(np.int16)
        for i in range(0, len(pcm), 1600):
            frame = av.AudioFrame.from_ndarray(pcm[None, i : i + 1600], format="s16", layout="mono")
            frame.sample_rate, frame.pts = SAMPLE_RATE, round(late_s * SAMPLE_RATE) + i
            frame.time_base = stream.time_base = Fraction(1, SAMPLE_RATE)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


@pytest.mark.asyncio
async def test_audio_that_starts_late_is_silence_until_then(tmp_path: Path) -> None:
    audio = tone(1.0)
    path = write_late_audio_mkv(tmp_path / "late.mkv", audio, 0.5)
    chunks, _ = split(await collect(FileSource(path, speed=0)))
    assert chunks[0].start_sample == 0  # what a session requires of the first chunk
    assert all(a.end_sample == b.start_sample for a, b in zip(chunks, chunks[1:], strict=False))
    decoded = np.concatenate([c.samples for c in chunks])
    assert len(decoded) == pytest.approx(1.5 * SAMPLE_RATE, abs=2)
    assert not decoded[:7990].any()  # the first half second is silence
    np.testing.assert_allclose(decoded[8000:], audio[: len(decoded) - 8000], atol=2 / 32768)
