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


@pytest.mark.asyncio
async def test_cover_art_is_not_video(tmp_path: Path) -> None:
    """An mp3's album picture is a one-frame video stream marked as an attached picture: the file is audio only
    (no frame to remember, no screen to read), and plays as such."""
    import av

    path = tmp_path / "song.mp3"
    with av.open(str(path), "w") as out:
        audio = out.add_stream("mp3", rate=SAMPLE_RATE, layout="mono")
        cover = out.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 64, 64, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        picture = av.VideoFrame.from_ndarray(render_frame(0.0, 64, 64), format="rgb24").reformat(format="yuvj420p")
        for packet in [*cover.encode(picture), *cover.encode()]:
            out.mux(packet)
        frame = av.AudioFrame.from_ndarray(tone(1.0)[None], format="fltp", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        for packet in [*audio.encode(frame), *audio.encode()]:
            out.mux(packet)
    with av.open(str(path)) as container:  # the file holds the picture, marked as such
        assert [s.type for s in container.streams] == ["audio", "video"]
        assert container.streams.video[0].disposition & av.stream.Disposition.attached_pic
    source = FileSource(path, speed=0)
    assert source.has_audio and not source.has_video
    chunks, video = split(await collect(source))
    assert chunks and not video


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


def write_timed_mkv(path: Path, pieces: list[tuple[float, np.ndarray]], video_s: float = 0.0) -> Path:
    """A Matroska file of PCM audio pieces, each at its own start time (gaps, late starts, clocks that jump
    back), with `video_s` seconds of 10 fps video from time 0 when asked."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=SAMPLE_RATE, layout="mono")
        if video_s:
            video = out.add_stream("mpeg4", rate=10)
            video.width, video.height, video.pix_fmt = 160, 120, "yuv420p"
            for i in range(int(video_s * 10)):
                image = av.VideoFrame.from_ndarray(render_frame(i / 10, 160, 120), format="rgb24")
                image.pts, image.time_base = i, Fraction(1, 10)
                out.mux(video.encode(image))
            out.mux(video.encode(None))
        for start, audio in pieces:
            pcm = (audio * 32767).astype(np.int16)
            for i in range(0, len(pcm), 1600):
                frame = av.AudioFrame.from_ndarray(pcm[None, i : i + 1600], format="s16", layout="mono")
                frame.sample_rate, frame.pts = SAMPLE_RATE, round(start * SAMPLE_RATE) + i
                frame.time_base = Fraction(1, SAMPLE_RATE)  # the muxer rescales packets to its own time base
                out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path


async def decoded_audio(path: Path, **kwargs) -> np.ndarray:
    chunks, _ = split(await collect(FileSource(path, speed=0, **kwargs)))
    assert chunks[0].start_sample == 0  # what a session requires of the first chunk
    assert all(a.end_sample == b.start_sample for a, b in zip(chunks, chunks[1:], strict=False))
    return np.concatenate([c.samples for c in chunks])


@pytest.mark.asyncio
async def test_audio_that_starts_after_the_video_is_silence_until_then(tmp_path: Path) -> None:
    audio = tone(1.0)
    decoded = await decoded_audio(write_timed_mkv(tmp_path / "late.mkv", [(0.5, audio)], video_s=1.5), video=False)
    assert len(decoded) == pytest.approx(1.5 * SAMPLE_RATE, abs=2)
    assert not decoded[:7990].any()  # the first half second is silence
    np.testing.assert_allclose(decoded[8000:], audio[: len(decoded) - 8000], atol=2 / 32768)


@pytest.mark.asyncio
async def test_media_time_starts_at_the_containers_start(tmp_path: Path) -> None:
    """A capture whose clock starts 600 s in (MPEG-TS from a broadcast) plays from 0, not after 10 minutes of
    silence, as players show it."""
    audio = tone(1.0)
    decoded = await decoded_audio(write_timed_mkv(tmp_path / "offset.mkv", [(600.0, audio)]))
    assert len(decoded) == pytest.approx(SAMPLE_RATE, abs=2)
    np.testing.assert_allclose(decoded, audio[: len(decoded)], atol=2 / 32768)


@pytest.mark.asyncio
async def test_a_gap_in_the_audio_is_silence(tmp_path: Path) -> None:
    a, b = tone(1.0), tone(0.5)
    gap = await decoded_audio(write_timed_mkv(tmp_path / "gap.mkv", [(0.0, a), (2.5, b)]))
    assert len(gap) == pytest.approx(3.0 * SAMPLE_RATE, abs=2)  # 1 s, 1.5 s of silence, 0.5 s
    assert not gap[16010:39990].any() and gap[40000:].any()


def write_ts(path: Path, seconds: float) -> bytes:
    """An MPEG-TS file of `seconds` of 10 fps video and AAC audio, both clocks from 0."""
    import av

    with av.open(str(path), "w", format="mpegts") as out:
        video = out.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 160, 120, "yuv420p"
        audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        wave = tone(seconds)
        for i in range(int(seconds * 10)):
            image = av.VideoFrame.from_ndarray(render_frame(i / 10, 160, 120), format="rgb24")
            image.pts, image.time_base = i, Fraction(1, 10)
            out.mux(video.encode(image))
            block = wave[i * 1600 : (i + 1) * 1600]
            frame = av.AudioFrame.from_ndarray(block[None], format="flt", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = SAMPLE_RATE, i * 1600, Fraction(1, SAMPLE_RATE)
            out.mux(audio.encode(frame))
        out.mux(video.encode(None))
        out.mux(audio.encode(None))
    return path.read_bytes()


@pytest.mark.asyncio
async def test_files_joined_end_to_end_play_on_in_both_streams(tmp_path: Path) -> None:
    """Two captures concatenated byte for byte: the second restarts its clocks at 0. Video carries on after
    the first (its frames were all skipped by the fps sampler as "already seen" before), audio alike."""
    joined = tmp_path / "joined.ts"
    joined.write_bytes(write_ts(tmp_path / "a.ts", 2.0) + write_ts(tmp_path / "b.ts", 2.0))
    chunks, video = split(await collect(FileSource(joined, speed=0, fps=2.0)))
    times = [f.time for f in video]
    assert times == sorted(times) and times[-1] > 3.4 and len(times) >= 7, times
    assert chunks[-1].end == pytest.approx(4.0, abs=0.3)  # AAC adds priming and padding to each file


@pytest.mark.asyncio
async def test_more_channels_are_mixed_to_mono_without_clipping(tmp_path: Path) -> None:
    import soundfile

    for channels in (2, 6):
        path = tmp_path / f"c{channels}.wav"
        soundfile.write(path, np.repeat(tone(0.5)[:, None] / 0.4 * 0.5, channels, axis=1), SAMPLE_RATE)
        peak = np.abs(await decoded_audio(path)).max()
        assert peak == pytest.approx(0.5, abs=0.01), channels  # the default downmix gave 0.71 and 1.8


def write_mp3(path: Path, seconds: float, rate: int, layout: str) -> bytes:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libmp3lame", rate=rate, layout=layout)
        t = np.arange(int(seconds * rate)) / rate
        channels = 2 if layout == "stereo" else 1
        wave = np.tile((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), (channels, 1))
        for i in range(0, wave.shape[1], 1152):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, i : i + 1152]), format="fltp",
                                               layout=layout)
            frame.sample_rate, frame.pts, frame.time_base = rate, i, Fraction(1, rate)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path.read_bytes()


@pytest.mark.asyncio
async def test_a_format_change_mid_file_and_a_corrupt_packet_do_not_end_the_audio(tmp_path: Path, caplog) -> None:
    joined = tmp_path / "joined.mp3"  # two MP3s end to end: 44.1 kHz mono, then 22.05 kHz stereo
    joined.write_bytes(write_mp3(tmp_path / "a.mp3", 2.0, 44100, "mono")
                       + write_mp3(tmp_path / "b.mp3", 2.0, 22050, "stereo"))
    assert len(await decoded_audio(joined)) == pytest.approx(4.0 * SAMPLE_RATE, rel=0.03)
    damaged = bytearray(write_mp3(tmp_path / "c.mp3", 4.0, 44100, "mono"))
    middle = len(damaged) // 2
    damaged[middle : middle + 60] = bytes(60)  # a damaged stretch mid-file
    (tmp_path / "damaged.mp3").write_bytes(bytes(damaged) + np.random.default_rng(0).bytes(20000))
    decoded = await decoded_audio(tmp_path / "damaged.mp3")
    assert len(decoded) >= 3.8 * SAMPLE_RATE  # the audio after the damage is there too


@pytest.mark.asyncio
async def test_an_empty_audio_track_or_a_text_file_is_a_clear_error(tmp_path: Path) -> None:
    import soundfile

    soundfile.write(tmp_path / "empty.wav", np.zeros(0, np.float32), SAMPLE_RATE)
    with pytest.raises(MediaError, match="holds no samples"):
        await collect(FileSource(tmp_path / "empty.wav", speed=0, video=False))
    (tmp_path / "notes.txt").write_text("hello this is not media\n" * 100)  # FFmpeg's tty format reads it
    with pytest.raises(MediaError, match="not an audio or video file"):
        FileSource(tmp_path / "notes.txt")
