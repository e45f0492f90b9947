"""Audio into the ASR, one input buffer at a time; transcript events and the conversation's user items out.

Audio is never dropped: the channel in front of this processor blocks its producer when full. A `BufferEnd`
travels in the same channel, so a commit or a clear lands exactly between the chunks it was sent between.
Each buffer is one ASR stream, opened at its first chunk and finished at its end: a commit completes the
buffer's user item with the backend's final text (what it would give for that audio offline), a clear drops it.
With turn detection (`Turns`), a detected end of speech commits the buffer here, in order with the audio,
and the `TurnSink` decides whether a response follows.

What a new buffer's stream is given of the turns before it (their text as context; in a captions session the turn
just before, read on): pipeline/turns_before.py, "Context across turns" and "Reading on".

With `pipeline.speech_gate` and turn detection, a buffer's words wait until the VAD hears speech in it (Whisper
writes "you" over silence): pipeline/transcript_gate.py.

With turn detection, the final pass is prepared during a turn's pause, and the pause's silence after that is not
read: pipeline/pause_pass.py.

One chunk is one worker job at ASR priority (the highest after control: captions are the latency budget), so
the loop never runs the model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from runtime.channels import BlockingChannel
from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.errors import ConfigError
from runtime.events import (
    AudioBufferCleared,
    AudioBufferCommitted,
    AudioBufferTimeout,
    Event,
    ItemAdded,
    ItemDone,
    SpeechStarted,
    SpeechStopped,
    TranscriptionCompleted,
    TranscriptionDelta,
    error_event,
    new_id,
)
from runtime.memory.conversation import Conversation, Item
from runtime.models.asr.base import ASRStream, ReadsOn, Speech, SpeechEnds, TranscriptUpdate
from runtime.pipeline import Emit
from runtime.pipeline.input_buffer import BufferTranscript
from runtime.pipeline.pause_pass import PausePass
from runtime.pipeline.transcript_gate import TranscriptGate
from runtime.pipeline.turn_signals import IdleTimeout, TurnEvent, Turns, TurnSink
from runtime.pipeline.turns_before import TurnsBefore
from runtime.session_state import ContextChanges, HeardClock
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)

MIN_COMMIT_S = 0.1  # the API refuses to commit less audio than this


@dataclass(frozen=True)
class BufferEnd:
    """In-band with the audio: the buffer so far ends here, committed (a user item) or cleared (dropped)."""

    clear: bool = False
    client_event_id: str | None = None


def transcript_event(update: TranscriptUpdate) -> Event:
    if update.completed:
        return TranscriptionCompleted(item_id=update.item_id, transcript=update.transcript, start=update.start,
                                      end=update.end, language=update.language, media_time=update.end)
    return TranscriptionDelta(item_id=update.item_id, delta=update.delta, unstable=update.unstable,
                              start=update.start, end=update.end, language=update.language, media_time=update.end)


class AudioProcessor:
    """Feeds chunks to the open buffer's ASR stream; publishes how far it has heard (`heard`), the user items
    (`conversation`) and that the context changed."""

    def __init__(self, channel: BlockingChannel[AudioChunk | BufferEnd], open_asr: Callable[[], ASRStream],
                 worker: DeviceWorker, emit: Emit, conversation: Conversation, heard: HeardClock,
                 changes: ContextChanges, *, first_stream: ASRStream | None = None, turns: Turns | None = None,
                 sink: TurnSink | None = None, speech_gate: bool = False,
                 vocabulary: Callable[[], str] | None = None, speech: Callable[[], Speech | None] | None = None,
                 reads_on: Callable[[], bool] | None = None) -> None:
        """`first_stream`: the first buffer's stream, opened by the builder (so a broken model fails the session
        before it starts); later buffers open theirs with `open_asr`. `speech_gate`: see the module doc.
        `vocabulary`: the session's transcription prompt now (read as each buffer opens). `speech`: the language and
        task the session asks for now (None: the profile's), given to each buffer's stream as it opens. `reads_on`:
        whether a buffer's stream reads on from the buffer committed before it now (`TurnsBefore`; None: never)."""
        self.channel, self.open_asr, self.worker, self.emit = channel, open_asr, worker, emit
        self.conversation, self.heard, self.changes = conversation, heard, changes
        self.turns, self.sink = turns, sink
        self._spare = first_stream
        self.stream: ASRStream | None = None
        self.buffer: BufferTranscript | None = None
        self.buffer_samples = 0
        self.audio_end = 0.0  # media seconds: the end of the audio accepted so far
        self.speaking = False
        self.commits = 0
        self.gate = TranscriptGate(speech_gate, turns)  # whether the open buffer's words wait
        self._listened_from_open = False  # turn detection listened from the open buffer's first chunk
        self._turn_began = False  # turn detection heard a turn start in the open buffer
        self.vocabulary = vocabulary
        self.speech = speech
        self.pause = PausePass()  # what the open buffer's stream was told of its pause
        self.turns_before = TurnsBefore(reads_on)  # the committed turns' text, and the turn handed on

    async def run(self) -> None:
        try:
            async for entry in self.channel:
                if isinstance(entry, BufferEnd):
                    await self._end(entry)
                else:
                    await self._accept(entry)
            if self.buffer is not None:  # end of input: the last buffer is committed like any other
                if self.gate.waits():  # ...unless the gate heard no speech in it: then there is nothing to say
                    await self._close_buffer(self.audio_end)
                else:
                    await self._end(BufferEnd())
        finally:
            await self.release()
            await self.heard.finish()

    async def release(self) -> None:
        """Close the ASR streams this processor holds (also when it never ran); idempotent."""
        streams, self.stream, self._spare = (self.stream, self._spare), None, None
        for stream in streams:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await self.worker.run(Priority.ASR, stream.close)

    async def _accept(self, chunk: AudioChunk) -> None:
        if self.stream is None:
            self.stream, self._spare = self._spare or await self.worker.run(Priority.ASR, self.open_asr), None
            self.buffer = BufferTranscript(new_id("item"), chunk.start)
            self._listened_from_open = self.turns is not None and self.turns.listening()
            self.buffer_samples = 0
            await self._set_context(self.stream, chunk.start)
            before = self.turns_before.opened(isinstance(self.stream, ReadsOn))
            if before is not None and isinstance(self.stream, ReadsOn):  # (only a ReadsOn stream is handed one)
                await self.worker.run(Priority.ASR, self.stream.read_on, before)
        self.buffer_samples += len(chunk.samples)
        self.audio_end = chunk.end
        if not self.pause.defer(chunk):  # the pause's final pass is ready: its silence waits (pause_pass.py)
            await self._read(chunk)
        if self.turns is not None:
            for turn in await self._detect(chunk):
                await self._turn(turn)
            if self._turn_began and not self.gate.heard_speech:
                await self._open_gate()
            await self._follow_pause(chunk.end_sample)
        await self.heard.advance(chunk.end)

    async def _read(self, chunk: AudioChunk) -> None:
        """The open stream reads `chunk` (after what it left unread, as one chunk) and its words are published or
        held."""
        assert self.stream is not None
        chunk = self.pause.with_unread(chunk)
        updates = await self._step(self.stream.accept, chunk, chunk.start)
        if self.gate.waits():
            assert self.buffer is not None
            self.gate.hold(self.buffer, updates)
        else:
            await self._release()
            await self._publish(updates)

    async def _set_context(self, stream: ASRStream, at: float) -> None:
        """Give a new buffer's stream the session's language and task, the turns before it and the session's
        vocabulary (pipeline/turns_before.py). A language or task the model cannot do is an error event, and the turn is
        heard as the profile says."""
        speech = self.speech() if self.speech is not None else None
        if speech is not None:
            try:
                await self.worker.run(Priority.ASR, stream.set_speech, speech)
            except ConfigError as err:
                field = "language" if speech.language not in ("", "en") else "task"  # the first checked
                await self.emit(error_event(str(err), code="invalid_value", type="invalid_request_error",
                                            param=f"session.audio.input.transcription.{field}", media_time=at))
        previous, vocabulary = self.turns_before.context(), self.vocabulary() if self.vocabulary is not None else ""
        if not previous and not vocabulary:
            return
        try:
            await self.worker.run(Priority.ASR, stream.set_context, previous, vocabulary)
        except Exception as err:  # the turn is heard without context rather than not at all
            log.exception("ASR context failed")
            await self.emit(error_event(f"speech recognition context failed: {err}", code="asr_failed",
                                        type="server_error", media_time=at))

    async def _open_gate(self) -> None:
        """A turn began in the open buffer: once the VAD has heard `MIN_SPEECH_S` of speech in it, its words flow."""
        if self.gate.hears_speech():
            await self._release()

    async def _detect(self, chunk: AudioChunk) -> list[TurnEvent | IdleTimeout]:
        assert self.turns is not None
        try:
            return await self.worker.run(Priority.ASR, self.turns.detect, chunk)
        except Exception as err:  # turn detection failing costs its turns, not the captions
            log.exception("turn detection failed")
            await self.emit(error_event(f"turn detection failed: {err}", code="turn_detection_failed",
                                        type="server_error", media_time=chunk.end))
            return []

    async def _turn(self, turn: TurnEvent | IdleTimeout) -> None:
        if self.buffer is None:
            return
        if isinstance(turn, IdleTimeout):
            item_id = self.buffer.item_id
            await self.emit(AudioBufferTimeout(item_id=item_id, audio_start_ms=round(turn.start * 1000 / SAMPLE_RATE),
                                               audio_end_ms=round(turn.end * 1000 / SAMPLE_RATE),
                                               media_time=turn.end / SAMPLE_RATE))
            await self._end(BufferEnd())
            if self.sink is not None:
                await self.sink.idle_timeout(item_id, self.audio_end, turn.settings)
            return
        at_ms = round(turn.sample * 1000 / SAMPLE_RATE)
        if turn.started:
            if not self._turn_began and self._listened_from_open:
                self._speech_from(turn.sample / SAMPLE_RATE)
            self.speaking = self._turn_began = True
            await self.emit(SpeechStarted(item_id=self.buffer.item_id, audio_start_ms=at_ms,
                                          media_time=turn.sample / SAMPLE_RATE))
            if self.sink is not None:
                self.sink.speech_started()
            await self._open_gate()
            if self.turns_before.speech_started(turn.sample / SAMPLE_RATE) and isinstance(self.stream, ReadsOn):
                # withdrawn after the event, which waits for no worker job: the stream's first item is decided at
                # the commit
                await self.worker.run(Priority.ASR, self.stream.read_on, None)
        elif self.speaking:
            self.speaking = False
            item_id = self.buffer.item_id
            await self.emit(SpeechStopped(item_id=item_id, audio_end_ms=at_ms, media_time=turn.sample / SAMPLE_RATE))
            self.turns_before.speech_stopped(turn.sample / SAMPLE_RATE)
            if isinstance(self.stream, SpeechEnds):  # the same point whether or not the pause prepared it in time
                heard_to = round(self.audio_end * SAMPLE_RATE)
                until = self.pause.at_speech_stop(turn.sample, heard_to)
                if self.pause.speech_end != until:
                    await self._end_speech(until, heard_to, commit=True)
            await self._end(BufferEnd())
            if self.sink is not None:
                await self.sink.turn_ended(item_id, self.audio_end, turn.settings)

    async def _follow_pause(self, heard_to: int) -> None:
        """Prepare the final pass once the open buffer's pause has lasted `FINAL_TAIL_S`; undo it when speech goes
        on (pause_pass.py)."""
        assert self.turns is not None
        if not isinstance(self.stream, SpeechEnds):
            return
        until = self.pause.in_pause(self.turns.pause_start(), heard_to)
        if until != self.pause.speech_end:
            await self._end_speech(until, heard_to)

    async def _end_speech(self, until: int | None, heard_to: int, *, commit: bool = False) -> None:
        """Tell the open stream where its speech ended (None: that it went on), and the sink what the turn would
        likely say were it to end there (not at a `commit`: the turn ends anyway); a failure is reported and costs
        only the early start: the commit's final pass runs as it would have."""
        assert isinstance(self.stream, SpeechEnds) and self.buffer is not None
        unread = self.pause.telling(until)
        if unread is not None:  # the stream reads what it left unread (the last chunk, after the others) first
            await self._read(unread)
        try:
            final = await self.worker.run(Priority.ASR, self.stream.end_speech, until)
        except Exception as err:
            log.exception("preparing the final pass failed")
            await self.emit(error_event(f"speech recognition failed: {err}", code="asr_failed", type="server_error",
                                        media_time=heard_to / SAMPLE_RATE))
            final = None
        self.pause.told(until, final is not None)
        if self.sink is None or commit or self.buffer is None:
            return
        if until is None:
            self.sink.turn_goes_on()
        elif final is not None and not self.gate.waits():
            self.sink.turn_may_end(self.buffer.item_id, self.buffer.text_if_final(final))

    def _speech_from(self, at: float) -> None:
        """The open buffer's speech began at `at`: its transcript starts there (`BufferTranscript`), and so does
        its item's line in the context, if words the ASR wrote over the silence before had opened it already.
        Only for a buffer turn detection listened to from its start: switched on mid-buffer, the detector's first
        speech start is merely when it began to listen."""
        assert self.buffer is not None
        self.buffer.speech_from(at)
        item = self.conversation.get(self.buffer.item_id)
        if item is not None and item.start != self.buffer.start:
            self.conversation.restamp(item, self.buffer.start)
            self.changes.mark()

    async def _step(self, fn: Callable[..., list[TranscriptUpdate]], chunk: AudioChunk | None,
                    at: float) -> list[TranscriptUpdate]:
        try:
            return await self.worker.run(Priority.ASR, fn, *([chunk] if chunk is not None else []))
        except Exception as err:  # one bad chunk costs its own words, not the session
            log.exception("ASR failed")
            await self.emit(error_event(f"speech recognition failed: {err}", code="asr_failed",
                                        type="server_error", media_time=at))
            return []

    async def _publish(self, updates: list[TranscriptUpdate]) -> None:
        assert self.buffer is not None
        changed = False
        for update in updates:
            folded = self.buffer.fold(update)
            if folded is not None:
                self.gate.published()
                self.conversation.apply(folded)
                await self.emit(transcript_event(folded))
                changed = True
        if changed:
            self.changes.mark()

    async def _end(self, end: BufferEnd) -> None:
        """Commit or clear the buffer; a commit of less than `MIN_COMMIT_S` of audio is refused."""
        buffer, stream = self.buffer, self.stream
        at = self.audio_end
        if end.clear:
            self.turns_before.cleared()
            if buffer is not None:
                self.conversation.delete(buffer.item_id)
                self.changes.mark()
            await self._close_buffer(at)
            await self.emit(AudioBufferCleared(media_time=at))
            return
        if buffer is None or stream is None or self.buffer_samples < MIN_COMMIT_S * SAMPLE_RATE:
            held = 1000 * self.buffer_samples / SAMPLE_RATE if buffer is not None else 0.0
            await self.emit(error_event(f"buffer too small: expected at least {MIN_COMMIT_S * 1000:.0f} ms of "
                                        f"audio, the buffer holds {held:.0f} ms",
                                        code="input_audio_buffer_commit_empty",
                                        client_event_id=end.client_event_id, media_time=at))
            await self.heard.committed()  # a response waiting on this commit goes on (with nothing new to read)
            return
        item = self.conversation.get(buffer.item_id)
        if item is None:  # nothing was heard yet: the item joins now, empty
            item = Item(buffer.item_id, buffer.start, at, status="in_progress")
            self.conversation.add_spoken(item)
        previous = self.conversation.previous_id(item.item_id)
        await self.emit(AudioBufferCommitted(item_id=item.item_id, previous_item_id=previous, media_time=at))
        await self.emit(ItemAdded(item=item.to_api(), previous_item_id=previous, media_time=at))
        final = await self._step(stream.finish, None, at)
        if self.gate.waits():  # no speech in it: an empty item, whatever the ASR wrote over the silence
            done = BufferTranscript(buffer.item_id, buffer.start).complete(at)
        else:
            await self._release()
            await self._publish(final)
            done = buffer.complete(at)
        self.conversation.apply(done)
        self.turns_before.committed(done.transcript, stream.turn_before if isinstance(stream, ReadsOn) else None)
        await self.emit(transcript_event(done))
        await self.emit(ItemDone(item=item.to_api(), previous_item_id=previous, media_time=at))
        self.changes.mark()
        await self._close_buffer(at)
        self.commits += 1
        await self.heard.committed()

    async def _release(self) -> None:
        """Publish what the gate held (already folded), as one update."""
        held = self.gate.release(self.buffer.start if self.buffer is not None else None)
        if held is not None:
            self.conversation.apply(held)
            await self.emit(transcript_event(held))
            self.changes.mark()

    async def _close_buffer(self, at: float) -> None:
        stream, self.stream, self.buffer, self.buffer_samples, self.speaking = self.stream, None, None, 0, False
        self.pause.reset()
        self.gate.reset()
        self._turn_began = False
        if stream is not None:
            with contextlib.suppress(Exception):
                await self.worker.run(Priority.ASR, stream.close)
        if self.turns is not None:
            self.turns.reset(round(at * SAMPLE_RATE))
