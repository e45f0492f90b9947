"""Play any audio or video file PyAV can read as a source, at real-time pace or faster.

The file is probed in the constructor, so a bad path fails before any model is loaded. Decoding runs in a
background thread (see `source.ThreadedSource`). Audio and video are decoded through two demuxers of the
same file and merged by time, so memory stays bounded even when a file interleaves its streams badly.

Media time is what a player shows: seconds from the container's start (an MPEG-TS capture that starts 600 s
into its clock starts at 0 here). The audio's sample count is its clock, so a stretch the file has no audio
for becomes silence, and a clock that jumps back (files joined end to end) carries on where it was, in
both streams alike. A packet that does not decode is skipped, as players do, and counted in a warning.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.errors import MediaError
from runtime.io.rechunk import AudioRechunker
from runtime.io.source import Emit, Item, Producer, ThreadedSource, available_time

log = logging.getLogger(__name__)
MIN_AUDIO_GAP_S = 0.05  # timestamps this far past the audio so far: the file has no audio there (silence)
BACKWARD_JUMP_S = 0.5  # a clock this far behind the stream's own end: a reset, not jitter
NOT_MEDIA = {"tty"}  # FFmpeg formats that turn any text file into "video"


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
                if container.format.name in NOT_MEDIA:
                    raise MediaError(f"cannot read {self.path}: not an audio or video file")
                self.has_audio = bool(container.streams.audio)
                self.has_video = video and _moving_picture(container) is not None
                self.duration = _duration(container)
                self.origin = _origin(container)
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
            clock, rechunker = _StreamClock(self.origin), AudioRechunker(self.chunk_samples)
            resampler: av.AudioResampler | None = None
            setup: tuple | None = None
            written = 0  # samples out so far: the audio clock
            skip = 0  # samples before media time 0 (a negative first pts: an encoder's priming) are dropped
            for frame in self._decoded(container, stream):
                if frame.time is not None:
                    start = round(clock.time(float(frame.time), frame.samples / frame.sample_rate) * SAMPLE_RATE)
                    if written == 0 and start < 0:
                        skip = -start
                    elif start - written > MIN_AUDIO_GAP_S * SAMPLE_RATE:  # late start, or a gap: silence
                        for at in range(written, start, SAMPLE_RATE):
                            silence = np.zeros(min(SAMPLE_RATE, start - at), np.float32)
                            written += len(silence)
                            yield from rechunker.push(silence)
                if (frame.format.name, frame.layout.name, frame.sample_rate) != setup:  # a new format mid-file
                    if resampler is not None:
                        for samples in _mono(resampler.resample(None)):
                            written += len(samples)
                            yield from rechunker.push(samples)
                    setup = (frame.format.name, frame.layout.name, frame.sample_rate)
                    # the frame's own channels, mixed below by their mean: libswresample's mono downmix
                    # adds them at -3 dB each, which lifts stereo by 1.4x and 5.1 past full scale
                    resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=SAMPLE_RATE)
                for samples in _mono(resampler.resample(frame)):  # type: ignore[union-attr]
                    if skip:
                        dropped = min(skip, len(samples))
                        samples, skip = samples[dropped:], skip - dropped
                    written += len(samples)
                    yield from rechunker.push(samples)
            if resampler is not None:
                for samples in _mono(resampler.resample(None)):
                    yield from rechunker.push(samples)
            if written == 0 and not self.has_video:
                raise MediaError(f"cannot read {self.path}: its audio stream holds no samples")
            yield from rechunker.flush()

    def _decoded(self, container: av.container.InputContainer, stream: av.stream.Stream) -> Iterator:
        """The stream's frames; a packet that does not decode is skipped, and unreadable data past the last
        good packet (a damaged or padded end) ends the stream, each said once in a warning."""
        skipped, packets = 0, container.demux(stream)
        while True:
            try:
                packet = next(packets)
            except StopIteration:
                break
            except av.FFmpegError as error:
                log.warning("%s: stopped reading %s at unreadable data (%s)", self.path, stream.type,
                            error_reason(error))
                break
            try:
                yield from packet.decode()
            except av.FFmpegError:
                skipped += 1
        if skipped:
            log.warning("%s: skipped %d %s packet(s) that did not decode", self.path, skipped, stream.type)

    def _video(self) -> Iterator[VideoFrame]:
        with av.open(self.path) as container:
            stream = _moving_picture(container)
            assert stream is not None, "has_video said there was one"
            stream.thread_type = "AUTO"
            last_slot = -1
            interval = 1 / float(stream.average_rate or stream.guessed_rate or 25)
            clock = _StreamClock(self.origin)
            for index, frame in enumerate(self._decoded(container, stream)):
                # no timestamps: assume the nominal rate
                time = index * interval if frame.time is None else max(0.0, clock.time(float(frame.time), interval))
                if self.fps is not None:
                    slot = math.floor(time * self.fps + 1e-6)
                    if slot <= last_slot:
                        continue  # thinned before conversion: skipped frames cost no RGB work
                    last_slot = slot
                width, height = scaled_size(frame.width, frame.height, self.max_side)
                image = frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
                yield VideoFrame(image=image, time=time)


def _moving_picture(container: av.container.InputContainer) -> av.video.stream.VideoStream | None:
    """The file's first video stream that is not cover art (an mp3's or m4a's album picture is a one-frame "video"
    stream marked as an attached picture: neither something to watch nor a screen to read)."""
    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:
            return stream
    return None


class _StreamClock:
    """A stream's media time: its timestamps from the container's start, continued where it stopped when they
    jump back (files joined end to end restart their clocks)."""

    def __init__(self, origin: float) -> None:
        self.shift = -origin
        self.end: float | None = None  # where the last frame ended

    def time(self, stamp: float, duration: float) -> float:
        t = stamp + self.shift
        if self.end is not None and t < self.end - BACKWARD_JUMP_S:
            self.shift += self.end - t
            t = self.end
        self.end = t + duration
        return t


def _mono(frames: list[av.AudioFrame]) -> Iterator[np.ndarray]:
    """Planar float frames as mono: the mean of their channels, so the level stays within full scale."""
    for frame in frames:
        yield frame.to_ndarray().mean(axis=0, dtype=np.float32)


def _origin(container: av.container.InputContainer) -> float:
    """Where media time 0 is on the file's clock: the container's start (never before 0, so an encoder's
    negative priming samples stay before it and are dropped)."""
    return max(0.0, container.start_time / av.time_base) if container.start_time is not None else 0.0


def _duration(container: av.container.InputContainer) -> float | None:
    if container.duration is not None:
        return container.duration / av.time_base
    durations = [float(s.duration * s.time_base) for s in container.streams if s.duration and s.time_base]
    return max(durations) if durations else None
