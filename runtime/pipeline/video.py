"""Frames into the vision tower and the video memory, a batch at a time, on the device worker.

    video channel --> VideoProcessor --(worker, VISION: encode the queued frames as one batch, write memory)
                         |--> ContextChanges (the prefiller takes the new memory suffix)
                         |--> closed segments --> a SegmentSink (the NoteWriter, notes.py)
                         '--> the frames, once encoded --> a FrameSink (the ScreenReader, screen.py)

The memory (`runtime.memory.video.VideoMemory`) is written only on the device worker and read through
snapshots, so a question never waits for a frame and never sees half a write (Flash-VStream's frame handler
and question handler). Frames arrive through a keep-latest channel: when encoding falls behind, the oldest
queued frames are dropped (counted in `metrics`), never the stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from runtime.channels import LatestChannel
from runtime.chunks import VideoFrame
from runtime.events import error_event
from runtime.memory.video import Segment, VideoMemory
from runtime.models.vlm.base import FrameEncoder
from runtime.pipeline import Emit
from runtime.session_state import ContextChanges
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)


class SegmentSink(Protocol):
    """Takes the memory segments a write closed (never waits: the note writer bounds what it keeps)."""

    def add(self, segments: list[Segment]) -> None: ...


class FrameSink(Protocol):
    """Takes frames after the memory has them (the screen reader: reads those worth reading)."""

    async def take(self, frames: list[VideoFrame]) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class VideoProcessor:
    """Encodes frames in batches on the worker and writes them into the memory; without an encoder (a
    text-only model) it only keeps the newest frame."""

    def __init__(self, channel: LatestChannel[VideoFrame], worker: DeviceWorker, emit: Emit,
                 changes: ContextChanges, *, encoder: FrameEncoder | None = None, memory: VideoMemory | None = None,
                 notes: SegmentSink | None = None, screen: FrameSink | None = None) -> None:
        self.channel, self.worker, self.emit, self.changes = channel, worker, emit, changes
        self.encoder, self.memory, self.notes, self.screen = encoder, memory, notes, screen
        self.latest: VideoFrame | None = None
        self.frames = 0  # frames taken from the channel
        self.settled = 0  # of those, frames whose batch is done with (in memory, failed, or only counted)
        self.encoded = 0
        self.batches = 0
        self._progress = asyncio.Condition()

    async def run(self) -> None:
        async for frame in self.channel:
            batch = [frame, *self.channel.drain_nowait()]
            self.latest = batch[-1]
            self.frames += len(batch)
            try:
                await self._take(batch)
            finally:
                async with self._progress:
                    self.settled += len(batch)
                    self._progress.notify_all()

    async def settled_to(self, frames: int) -> None:
        """Wait until `frames` frames have been taken and are done with: what a file played unpaced waits for
        before its next frame, so the memory is built the same way (frame by frame) on every machine."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.settled >= frames)

    async def _take(self, batch: list[VideoFrame]) -> None:
        await self._encode(batch)
        if self.screen is not None:
            await self.screen.take(batch)

    async def _encode(self, batch: list[VideoFrame]) -> None:
        if self.encoder is None or self.memory is None:
            return
        try:
            closed = await self.worker.run(Priority.VISION, self._ingest, batch)
        except Exception as err:  # one bad batch costs its frames, not the session
            log.exception("video encoding failed")
            await self.emit(error_event(f"video encoding failed: {err}", code="video_failed", type="server_error",
                                        media_time=batch[-1].time))
            return
        self.encoded += len(batch)
        self.batches += 1
        self.changes.mark()
        if closed and self.notes is not None:
            self.notes.add(closed)

    def _ingest(self, batch: list[VideoFrame]) -> list[Segment]:
        """On the worker: one forward of the vision tower for the whole batch, then one memory write."""
        assert self.encoder is not None and self.memory is not None
        features = self.encoder.encode([f.image for f in batch])
        return self.memory.write(features, [f.time for f in batch])
