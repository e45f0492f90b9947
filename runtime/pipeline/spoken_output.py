"""A response spoken aloud: the answer's text deltas in, `response.output_audio.delta` events out, clause by clause
while the model still decodes the rest.

The flow for one spoken message (`SpokenAudio`, opened by the session's `Speaker`):

    text deltas --ClauseSplitter (on the loop: string work)--> clause queue (bounded) --> speaking task
    speaking task --job at Priority.SPEECH (the first clause: OPENING): voice.synthesize + AudioEncoder --> bytes
                  --> response.output_audio.delta events (at most `delta_ms` of audio each) --> event channel

Synthesis and encoding are one device-worker job a clause, never event-loop work, and SPEECH runs ahead of the
next decode step: the text is already ahead of the voice, so sound comes first. Clauses are spoken one at a time,
in order; the encoder keeps its resampler's state across them (`output_audio.py`), so the audio's sample count is
its clock.

Bounded, and what a slow reader does: the audio leaves through the session's event channel, which blocks when
full (events are never dropped). A client that reads slowly fills it; the speaking task then waits to emit, the
clause queue (`clause_queue` clauses) fills, and `push` waits, which holds the answer's decode loop: the model
decodes no faster than the client takes the audio. Held in memory at most: the event channel, the clause queue
and one clause's audio. On the websocket audio goes out as fast as it is made (as the API sends it); the client
buffers and plays it.

Barge-in (`heard_ms`): the server cannot see the client's speaker, so it counts what was heard on the client's
own clock, its input audio: the client is taken to play the audio as it arrives, in real time, from the first
delta. Heard = the input media time when speech was detected minus that when the first audio delta was emitted,
at most the audio sent. Both instants are read off the same clock (`HeardClock.until`: the input audio the server
had processed), so a steady pipeline lag cancels out.

A transport that plays the voice out itself (`Playout`: WebRTC's audio track, `runtime/web/voice_track.py`) takes the
audio instead of the deltas, in its own format, and waits while its buffer is full (so synthesis waits too); what it
played out is what was heard, which replaces the rule above.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Protocol

import numpy as np

from runtime.channels import BlockingChannel, ChannelClosed
from runtime.events import ResponseAudioDelta, error_event
from runtime.io.audio_formats import AudioFormat
from runtime.memory.spoken import SpokenTrack
from runtime.models.tts.clauses import ClauseSplitter
from runtime.models.tts.output_audio import AudioEncoder
from runtime.models.tts.voice import Voice
from runtime.pipeline import Emit
from runtime.session_config import OutputAudio
from runtime.session_state import HeardClock
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)

CLAUSE_QUEUE = 4  # clauses decoded and waiting for the voice, per response
DELTA_MS = 200  # the most audio one response.output_audio.delta carries


class Playout(Protocol):
    """Where the audio goes when the transport plays it out at real time itself (WebRTC): `play` takes one piece in
    `format` (waiting while the transport's buffer is full), `end` says no more comes for the item, and `played_ms`
    is how much of the item's audio has played out."""

    format: AudioFormat

    async def play(self, response_id: str, item_id: str, audio: bytes) -> None: ...

    def end(self, response_id: str, item_id: str) -> None: ...

    def played_ms(self, item_id: str) -> int: ...


class Speaker:
    """The session's voice on the device worker; `open` starts speaking one response's message. `playout`: set by a
    transport that plays the voice itself (None: the audio goes out as response.output_audio.delta events)."""

    def __init__(self, voice: Voice, worker: DeviceWorker, emit: Emit, heard: HeardClock, *,
                 clause_queue: int = CLAUSE_QUEUE, delta_ms: int = DELTA_MS) -> None:
        self.voice, self.worker, self.emit, self.heard = voice, worker, emit, heard
        self.clause_queue, self.delta_ms = clause_queue, delta_ms
        self.playout: Playout | None = None

    def open(self, response_id: str, item_id: str, output_index: int, speech: OutputAudio,
             media_time: float) -> SpokenAudio:
        return SpokenAudio(self, response_id, item_id, output_index, speech, media_time)


class SpokenAudio:
    """One message spoken: `push` its text deltas, then `finish()` (speak the rest, wait for it) or `stop()` (cut
    short: what is queued is dropped, a synthesis in flight is discarded). `track` is what the client was sent."""

    def __init__(self, speaker: Speaker, response_id: str, item_id: str, output_index: int, speech: OutputAudio,
                 media_time: float) -> None:
        self.speaker, self.speech = speaker, speech
        self.response_id, self.item_id, self.output_index, self.media_time = (response_id, item_id, output_index,
                                                                              media_time)
        self.splitter = ClauseSplitter()
        self.playout = speaker.playout
        fmt = self.playout.format if self.playout is not None else speech.format
        self.encoder = AudioEncoder(fmt, speaker.voice.sample_rate)
        self.track = SpokenTrack(fmt.rate)
        self.first_at: float | None = None  # HeardClock.until when the first audio delta was emitted
        self.failed = False
        self._clauses: BlockingChannel[str] = BlockingChannel(speaker.clause_queue, "clauses")
        self._task = asyncio.create_task(self._speak(), name=f"{response_id}:speech")

    async def push(self, delta: str) -> None:
        """The answer's next text: each clause it completes is queued for the voice (waits while the queue is full)."""
        for clause in self.splitter.push(delta):
            await self._queue(clause)

    async def finish(self) -> None:
        """The answer ended: speak what the splitter holds and wait until every clause's audio is emitted."""
        for clause in self.splitter.finish():
            await self._queue(clause)
        self._clauses.close()
        await self._task

    async def stop(self) -> None:
        """Cut short: no further audio (a clause being synthesised is dropped when its job ends)."""
        self._clauses.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def abort(self) -> None:
        """`stop` without waiting, for a task that is being cancelled itself."""
        self._clauses.close()
        self._task.cancel()

    def heard_ms(self, at: float) -> int:
        """Milliseconds of this audio the client had played by input media time `at` (the module's rule), or, with a
        `Playout`, that it has played out now."""
        if self.playout is not None:
            return min(self.track.duration_ms, self.playout.played_ms(self.item_id))
        if self.first_at is None:
            return 0
        return max(0, min(self.track.duration_ms, round((at - self.first_at) * 1000)))

    async def _queue(self, clause: str) -> None:
        try:
            await self._clauses.put(clause)
        except ChannelClosed:  # stopped meanwhile: nothing more is spoken
            pass

    async def _speak(self) -> None:
        try:
            await self._speak_clauses()
        finally:  # finished, failed or stopped: no more audio comes for this item
            if self.playout is not None:
                self.playout.end(self.response_id, self.item_id)

    async def _speak_clauses(self) -> None:
        worker = self.speaker.worker
        priority = Priority.OPENING  # the first clause is the answer's opening: what the user waits for
        async for clause in self._clauses:
            if self.failed:
                continue  # the voice failed once: the rest of the answer stays text (its transcript)
            try:
                audio = await worker.run(priority, self._synthesize, clause)
                priority = Priority.SPEECH
            except Exception as err:
                log.exception("speech synthesis failed")
                self.failed = True
                await self.speaker.emit(error_event(f"speaking the answer failed: {err}", code="speech_failed",
                                                    type="server_error", media_time=self.media_time))
                continue
            self.track.plan(clause, len(audio) // self.encoder.bytes_per_sample)
            await self._send(audio)
        if not self.failed:
            tail = await worker.run(Priority.SPEECH, self.encoder.flush)
            self.track.extend_last(len(tail) // self.encoder.bytes_per_sample)
            await self._send(tail)

    def _synthesize(self, clause: str) -> bytes:
        """On the worker: the clause spoken and encoded in the session's output format."""
        speech = self.speaker.voice.synthesize(clause, self.speech.speed)
        return self.encoder.encode(np.asarray(speech.samples, dtype=np.float32))

    async def _send(self, audio: bytes) -> None:
        if self.playout is not None:
            if self.first_at is None:
                self.first_at = self.speaker.heard.until
            await self.playout.play(self.response_id, self.item_id, audio)
            self.track.sent(len(audio) // self.encoder.bytes_per_sample)
            return
        step = self.encoder.format.rate * self.speaker.delta_ms // 1000 * self.encoder.bytes_per_sample
        for start in range(0, len(audio), step):
            if self.first_at is None:
                self.first_at = self.speaker.heard.until
            piece = audio[start : start + step]
            await self.speaker.emit(ResponseAudioDelta(
                response_id=self.response_id, item_id=self.item_id, output_index=self.output_index,
                delta=base64.b64encode(piece).decode("ascii"), media_time=self.media_time))
            self.track.sent(len(piece) // self.encoder.bytes_per_sample)
