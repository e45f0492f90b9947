"""The video path of a session: frames into the vision tower and the video memory, notes when idle.

    video channel --> VideoProcessor --(worker, VISION: encode the queued frames as one batch, write memory)
                         |--> ContextPrefiller (memory changed: prefill the new suffix)
                         '--> NoteWriter --(worker, VISION, only while no question waits)--> video.note events

The memory (`runtime.memory.video.VideoMemory`) is written only on the device worker and read through
snapshots, so a question never waits for a frame and never sees half a write (Flash-VStream's frame handler
and question handler). Frames arrive through a keep-latest channel: when encoding falls behind, the oldest
queued frames are dropped (counted in `metrics`), never the stream.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable
from typing import Any

from runtime.channels import LatestChannel
from runtime.chunks import VideoFrame
from runtime.events import VideoNote, error_event
from runtime.memory.video import MemoryBlock, Segment, VideoMemory
from runtime.models.lm.prompt import NOTE_QUESTION
from runtime.models.vlm.llava_onevision import VisionEncoder
from runtime.models.vlm.prompt import memory_pieces
from runtime.pipeline import Emit
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)
_note_keys = itertools.count(1 << 40)  # keys for note prompts: never equal to a memory block's


class VideoProcessor:
    """Encodes frames in batches on the worker and writes them into the memory; without an encoder (a
    text-only model) it only keeps the newest frame."""

    def __init__(self, channel: LatestChannel[VideoFrame], worker: DeviceWorker | None = None,
                 encoder: VisionEncoder | None = None, memory: VideoMemory | None = None,
                 emit: Emit | None = None, on_memory: Callable[[], None] = lambda: None,
                 on_segments: Callable[[list[Segment]], None] = lambda segments: None) -> None:
        self.channel, self.worker, self.encoder, self.memory = channel, worker, encoder, memory
        self.emit, self.on_memory, self.on_segments = emit, on_memory, on_segments
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
        if self.encoder is None or self.memory is None or self.worker is None:
            return
        try:
            closed = await self.worker.run(Priority.VISION, self._ingest, batch)
        except Exception as err:  # one bad batch costs its frames, not the session
            log.exception("video encoding failed")
            if self.emit is not None:
                await self.emit(error_event(f"video encoding failed: {err}", code="video_failed",
                                            type="server_error", media_time=batch[-1].time))
            return
        self.encoded += len(batch)
        self.batches += 1
        self.on_memory()
        if closed:
            self.on_segments(closed)

    def _ingest(self, batch: list[VideoFrame]) -> list[Segment]:
        """On the worker: one forward of the vision tower for the whole batch, then one memory write."""
        assert self.encoder is not None and self.memory is not None
        features = self.encoder.encode([f.image for f in batch])
        return self.memory.write(features, [f.time for f in batch])


class NoteWriter:
    """Think While Watching's segment notes: while no question is waiting, the language model writes one short
    line per closed segment from its keyframe. Pending segments are bounded (oldest dropped first): notes are
    a bonus, never a backlog."""

    def __init__(self, answerer: Any, worker: DeviceWorker, memory: VideoMemory, emit: Emit,
                 busy: Callable[[], bool], *, max_tokens: int = 24, pending: int = 4) -> None:
        self.answerer, self.worker, self.memory, self.emit, self.busy = answerer, worker, memory, emit, busy
        self.max_tokens = max_tokens
        self.pending: collections.deque[Segment] = collections.deque(maxlen=pending)
        self._wake = asyncio.Event()
        self.written = 0

    def add(self, segments: list[Segment]) -> None:
        self.pending.extend(segments)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending:
                while self.busy():  # a question is waiting or being answered: it goes first
                    await asyncio.sleep(0.05)
                segment = self.pending.popleft()
                try:
                    await self._write(segment)
                except Exception:  # a failed note is only a missing note
                    log.exception("writing a video note failed")

    async def _write(self, segment: Segment) -> None:
        block = MemoryBlock(kind="retrieved", key=next(_note_keys), start=segment.start, end=segment.end,
                            embeds=segment.keyframe)
        state = await self.worker.run(Priority.VISION, self.answerer.start, "", NOTE_QUESTION,
                                      suffix=memory_pieces([block]))
        text = ""
        try:
            for _ in range(self.max_tokens):
                step = await self.worker.run(Priority.VISION, state.step)
                text += step.delta
                if step.done:
                    break
        finally:
            await self.worker.run(Priority.CONTROL, state.release)
        text = " ".join(text.split())
        if not text:
            return
        embedding = await self.worker.run(Priority.VISION, self.answerer.embed_text, text)
        if self.memory.set_note(segment.id, text, embedding):
            self.written += 1
            await self.emit(VideoNote(segment_id=segment.id, text=text, start=segment.start, end=segment.end,
                                      media_time=segment.end))
