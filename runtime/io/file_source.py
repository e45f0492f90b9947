"""Play any audio or video file PyAV can read as a source, at real-time pace or faster.

The file is probed in the constructor, so a bad path fails before any model is loaded. Decoding runs in a
background thread (see `source.ThreadedSource`). Audio and video are decoded through two demuxers of the
same file and merged by time, so memory stays bounded even when a file interleaves its streams badly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.errors import MediaError
from runtime.io.rechunk import AudioRechunker
from runtime.io.source import Emit, Item, Producer, ThreadedSource, available_time


def error_reason(error: BaseException) -> str:
    """A one-line reason from a PyAV/OS error (its strerror when there is one)."""
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return " ".join(str(reason).split())


def scaled_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(width, height) shrunk, keeping the aspect ratio, so the longer side is at most `max_side`."""
    longest = max(width, height)
    if max_side <= 0 or longest <= max_side:
        return width, height
    scale = max_side / longest
    return max(1, round(width * scale)), max(1, round(height * scale))


class FileSource(ThreadedSource):
    """Audio chunks (float32 mono 16 kHz, `chunk_ms` long, sample-accurate) and RGB video frames of a file.

    `speed` 1.0 releases items at real-time pace (media time t at start + t/speed), N is N times faster,
    0 is as fast as the consumer takes them. `fps` keeps at most that many frames per media second (None:
    every frame); `video=False` skips video entirely. Raises `MediaError` in the constructor for a missing,
    unreadable or stream-less file, and from iteration if decoding fails part-way.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        chunk_ms: int = 100,
        speed: float = 1.0,
        video: bool = True,
        fps: float | None = None,
        max_side: int = 640,
        queue_size: int = 8,
    ) -> None:
        super().__init__(speed=speed, queue_size=queue_size)
        if chunk_ms <= 0:
            raise ValueError(f"chunk_ms must be > 0, got {chunk_ms}")
        if fps is not None and fps <= 0:
            raise ValueError(f"fps must be > 0 or None, got {fps}")
        self.path = str(path)
        self.description = f"file {self.path}"
        self.chunk_samples = max(1, round(chunk_ms * SAMPLE_RATE / 1000))
        self.fps = fps
        self.max_side = max_side
        try:
            with av.open(self.path) as container:
                self.has_audio = bool(container.streams.audio)
                self.has_video = video and bool(container.streams.video)
                self.duration = _duration(container)
        except MediaError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure to open is the user's file, not a bug
            raise MediaError(f"cannot read {self.path}: {error_reason(error)}") from None
        if not (self.has_audio or self.has_video):
            what = "no audio stream (video is off)" if not video else "no audio or video stream"
            raise MediaError(f"cannot read {self.path}: {what}")

    def _producers(self) -> list[Producer]:
        return [self._decode]

    def _wrap_error(self, error: BaseException) -> BaseException:
        if isinstance(error, (av.FFmpegError, OSError, ValueError)):
            return MediaError(f"cannot read {self.path}: {error_reason(error)}")
        return error

    def _decode(self, emit: Emit) -> None:
        streams: list[Iterator[Item]] = []
        if self.has_audio:
            streams.append(self._audio())
        if self.has_video:
            streams.append(self._video())
        try:
            for item in heapq.merge(*streams, key=available_time):
                if not emit(item):
                    return
        finally:
            for stream in streams:
                stream.close()  # type: ignore[attr-defined]  # generators: closes their containers

    def _audio(self) -> Iterator[AudioChunk]:
        with av.open(self.path) as container:
            stream = container.streams.audio[0]
            stream.thread_type = "AUTO"
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            rechunker: AudioRechunker | None = None
            skip = 0  # samples before media time 0 (a negative first pts) are dropped
            for frame in frames_then_flush(container.decode(stream)):
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    if rechunker is None:
                        first = round((frame.time or 0.0) * SAMPLE_RATE) if frame is not None else 0
                        skip = max(0, -first)
                        rechunker = AudioRechunker(self.chunk_samples)
                        # audio that starts late (an MP3 encoder's delay, a track that begins after the video)
                        # is silence until then: the stream starts at 0 and stays in step with the frames
                        for at in range(0, max(0, first), SAMPLE_RATE):
                            yield from rechunker.push(np.zeros(min(SAMPLE_RATE, first - at), np.float32))
                    if skip:
                        dropped = min(skip, len(samples))
                        samples, skip = samples[dropped:], skip - dropped
                    yield from rechunker.push(samples)
            if rechunker is not None:
                yield from rechunker.flush()

    def _video(self) -> Iterator[VideoFrame]:
        with av.open(self.path) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            last_slot = -1
            for index, frame in enumerate(container.decode(stream)):
                if frame.time is None:  # no timestamps: assume the nominal rate
                    time = index / float(stream.average_rate or stream.guessed_rate or 25)
                else:
                    time = max(0.0, float(frame.time))
                if self.fps is not None:
                    slot = math.floor(time * self.fps + 1e-6)
                    if slot <= last_slot:
                        continue  # thinned before conversion: skipped frames cost no RGB work
                    last_slot = slot
                width, height = scaled_size(frame.width, frame.height, self.max_side)
                image = frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
                yield VideoFrame(image=image, time=time)


def frames_then_flush(frames: Iterator[av.AudioFrame]) -> Iterator[av.AudioFrame | None]:
    """The decoded frames, then None (which flushes the resampler's buffered tail)."""
    yield from frames
    yield None


def _duration(container: av.container.InputContainer) -> float | None:
    if container.duration is not None:
        return container.duration / av.time_base
    durations = [float(s.duration * s.time_base) for s in container.streams if s.duration and s.time_base]
    return max(durations) if durations else None
