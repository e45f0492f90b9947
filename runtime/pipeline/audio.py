"""Audio into the session's ASR stream, in order; transcript updates out as events and into the transcript.

Audio is never dropped: the channel in front of this processor blocks its producer when full. One chunk is one
worker job at ASR priority (the highest after control: captions are the latency budget), so the loop never
runs the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime.channels import BlockingChannel
from runtime.chunks import AudioChunk
from runtime.events import Event, TranscriptionCompleted, TranscriptionDelta, error_event
from runtime.memory.transcript import TranscriptMemory
from runtime.models.asr.base import ASRStream, TranscriptUpdate
from runtime.pipeline import Emit
from runtime.session_state import ContextChanges, HeardClock
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)


def transcript_event(update: TranscriptUpdate) -> Event:
    if update.completed:
        return TranscriptionCompleted(item_id=update.item_id, transcript=update.transcript, start=update.start,
                                      end=update.end, media_time=update.end)
    return TranscriptionDelta(item_id=update.item_id, delta=update.delta, unstable=update.unstable,
                              start=update.start, end=update.end, media_time=update.end)


class AudioProcessor:
    """Feeds chunks to the ASR stream; publishes how far it has heard (`heard`) and that the context changed."""

    def __init__(self, channel: BlockingChannel[AudioChunk], stream: ASRStream, worker: DeviceWorker, emit: Emit,
                 transcript: TranscriptMemory, heard: HeardClock, changes: ContextChanges) -> None:
        self.channel, self.stream, self.worker, self.emit = channel, stream, worker, emit
        self.transcript, self.heard, self.changes = transcript, heard, changes

    async def run(self) -> None:
        try:
            async for chunk in self.channel:
                updates = await self._step(self.stream.accept, chunk, chunk.start)
                await self._publish(updates, chunk.end)
            updates = await self._step(self.stream.finish, None, self.heard.until)
            await self._publish(updates, self.heard.until)
        finally:
            await self.heard.finish()

    async def _step(self, fn: Callable[..., list[TranscriptUpdate]], chunk: AudioChunk | None,
                    at: float) -> list[TranscriptUpdate]:
        try:
            return await self.worker.run(Priority.ASR, fn, *([chunk] if chunk is not None else []))
        except Exception as err:  # one bad chunk costs its own words, not the session
            log.exception("ASR failed")
            await self.emit(error_event(f"speech recognition failed: {err}", code="asr_failed",
                                        type="server_error", media_time=at))
            return []

    async def _publish(self, updates: list[TranscriptUpdate], heard_until: float) -> None:
        for update in updates:
            self.transcript.apply(update)
            if update.completed or update.delta or update.unstable:
                await self.emit(transcript_event(update))
        if updates:
            self.changes.mark()
        await self.heard.advance(heard_until)
