"""Audio into the ASR, one input buffer at a time; transcript events and the conversation's user items out.

Audio is never dropped: the channel in front of this processor blocks its producer when full. A `BufferEnd`
travels in the same channel, so a commit or a clear lands exactly between the chunks it was sent between.
Each buffer is one ASR stream, opened at its first chunk and finished at its end: a commit completes the
buffer's user item with the backend's final text (what it would give for that audio offline), a clear drops it.
With turn detection (`Turns`), a detected end of speech commits the buffer here, in order with the audio,
and the `TurnSink` decides whether a response follows.

Context across turns: a buffer's stream opens with the text of the buffers committed before it (the most recent
`CONTEXT_CHARS`; the backend keeps what its prompt holds, Whisper the last 223 tokens) and the session's
`audio.input.transcription.prompt` (the user's vocabulary), `ASRStream.set_context`: a reader cut at a pause goes
on in the sentence the stream already heard, in its streamed words, its previews and its final pass alike.

`speech_gate` (the Whisper profiles' `pipeline.speech_gate`): Whisper writes "you" over silence and noise, in
its streamed and its final text alike. With the gate and turn detection on, a buffer's transcript waits until
the VAD hears speech in it (a turn started, and `MIN_SPEECH_S` of windows at the turn threshold in the buffer:
Silero's own minimum speech duration, so one loud window of a chord or a click does not open it), and a buffer
in which it heard none holds no words: the end of the input drops it
without an event, a commit (the client's, or an idle timeout's) completes its item with an empty transcript.
What waited is kept as one update (its text joined, constant memory however long the wait) and follows
`speech_started` at once; words the ASR wrote over the silence just before the speech come with it (the ASR
stream spans the whole buffer). Once a buffer's words flow (speech heard, or turn detection off when they
came) the gate never closes on it again. Without turn detection nothing is gated.

The final pass prepared during the pause: the 500 ms of silence that end a turn are mostly waiting, and the final
pass (0.2-0.4 s on 2 cores) used to start only after them. With turn detection, once a pause has lasted
`FINAL_TAIL_S` the stream is told where the speech ended (`SpeechEnds.end_speech`): its final pass reads the turn's
audio up to the pause's start plus that tail, and the offline pass computes its costly parts right then, so the
commit that comes when the rule's silence is complete finds them done. Speech that resumes undoes it. A commit that
turn detection makes always gives the stream that point first, so a turn's final transcript does not depend on
whether the preparation was in time; a client's commit in a pause keeps it (what followed was silence). The
transcript the prepared pass will likely give goes to the `TurnSink` (`turn_may_end`), which may start on the answer
before the rule has decided (`QuestionProcessor.prepare`); speech that resumes takes it back (`turn_goes_on`).

Silence not read: once the pass is prepared, the stream is given no more of the pause's chunks. The turn's final
transcript reads nothing past the prepared point, and on a slow machine each chunk's ASR step (an encoder block, a
decoder step, a preview) kept the chunk that completes the rule's silence waiting behind it: turn detection ran
0.6-1.2 s late on an AVX2-only Zen 3. The chunks wait (`_unread`), and the stream reads them in one step when speech
resumes or the stream is told anything new; a commit, of whatever kind, leaves them unread (they are the silence the
pass already stops before). A stream whose pass was not prepared reads every chunk as before.

Reading on (`read_on`, the `ReadsOn` streams': causal Whisper with its offline pass): in a session that does not
answer turns (captions: `turn_detection.create_response` off), a committed buffer's turn is handed to the next
buffer's stream, whose final pass then reads it together with its own audio (final_pass.py, "Reading on"): a reader's
sentence cut at a pause is heard as one, when the VAD heard the next turn's speech start within `READ_ON_PAUSE_S`
of the turn before's end (a longer silence starts something new: a narrator's next slide; without turn detection
every commit hands on). Not in a session that answers: there the turns are questions with an answer
between them, and the pass's extra decode would come after the answer was prepared from the turn's own transcript
(`turn_may_end`), which a different final transcript would drop. A cleared or empty buffer hands nothing on.

One chunk is one worker job at ASR priority (the highest after control: captions are the latency budget), so
the loop never runs the model.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

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
from runtime.pipeline.turn_signals import IdleTimeout, TurnEvent, Turns, TurnSink
from runtime.session_state import ContextChanges, HeardClock
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)

MIN_COMMIT_S = 0.1  # the API refuses to commit less audio than this
MIN_SPEECH_S = 0.25  # the gate opens once the VAD heard this much speech in a buffer (Silero's min_speech_duration_ms)
CONTEXT_CHARS = 4000  # committed text kept as the next turns' context: more than Whisper's 223-token prompt holds
# the audio after a speech end that the final pass still reads (module doc): past the VAD's own tail (its probability
# falls 20-90 ms after the last word), short enough that the pass is prepared well inside server_vad's 500 ms
FINAL_TAIL_S = 0.2
# Reading on joins a turn to the one before only across a reader's pause: a longer silence between the two turns'
# speech (by the VAD) starts something new (module doc). The captions bench's readers pause 0.4-1.0 s between sentences;
# `runtime bench video-qa`'s narrators speak one sentence a slide, ten seconds apart.
READ_ON_PAUSE_S = 2.0


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
        whether a buffer's stream reads on from the buffer committed before it now (module doc; None: never)."""
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
        self.speech_gate = speech_gate
        self.heard_speech = False  # the VAD heard speech in the open buffer
        self._listened_from_open = False  # turn detection listened from the open buffer's first chunk
        self._held: TranscriptUpdate | None = None  # the open buffer's words, joined, while the gate waits
        self._flowing = False  # the open buffer's words have been published: the gate stays open for it
        self._turn_began = False  # turn detection heard a turn start in the open buffer
        self.vocabulary = vocabulary
        self.speech = speech
        self._said: deque[str] = deque()  # the committed buffers' transcripts, the most recent CONTEXT_CHARS
        self._speech_end: int | None = None  # the open buffer's speech end given to its stream (`end_speech`)
        self._prepared = False  # the final pass is prepared at `_speech_end`: the stream reads no more silence
        self._unread: list[AudioChunk] = []  # the open buffer's chunks since then, not yet read (module doc)
        self._said_chars = 0
        self.reads_on = reads_on
        self._turn_before: object | None = None  # the last committed buffer's turn, for the next stream (`ReadsOn`)
        self._speech_ended: float | None = None  # where the VAD last heard this buffer's speech stop (media s)
        self._turn_before_end: float | None = None  # ... and that of the turn handed on
        self._read_on_from: float | None = None  # the handed turn's speech end, until this buffer's speech starts

    async def run(self) -> None:
        try:
            async for entry in self.channel:
                if isinstance(entry, BufferEnd):
                    await self._end(entry)
                else:
                    await self._accept(entry)
            if self.buffer is not None:  # end of input: the last buffer is committed like any other
                if self._gated():  # ...unless the gate heard no speech in it: then there is nothing to say
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
            before, self._turn_before = self._turn_before, None
            self._speech_ended = self._read_on_from = None
            if before is not None and isinstance(self.stream, ReadsOn) and self.reads_on is not None \
                    and self.reads_on():
                await self.worker.run(Priority.ASR, self.stream.read_on, before)
                self._read_on_from = self._turn_before_end  # withdrawn if the speech starts too long after it
        self.buffer_samples += len(chunk.samples)
        self.audio_end = chunk.end
        if self._prepared:  # the pause's final pass is ready: its silence waits (module doc, "Silence not read")
            self._unread.append(chunk)
        else:
            await self._read(chunk)
        if self.turns is not None:
            for turn in await self._detect(chunk):
                await self._turn(turn)
            if self._turn_began and not self.heard_speech:
                await self._open_gate()
            await self._follow_pause(chunk.end_sample)
        await self.heard.advance(chunk.end)

    async def _read(self, chunk: AudioChunk) -> None:
        """The open stream reads `chunk` (after what it left unread, as one chunk) and its words are published or
        held."""
        assert self.stream is not None
        if self._unread:
            unread, self._unread = self._unread, []
            chunk = AudioChunk(np.concatenate([c.samples for c in (*unread, chunk)]), unread[0].start_sample)
        updates = await self._step(self.stream.accept, chunk, chunk.start)
        if self._gated():
            self._hold(updates)
        else:
            await self._release()
            await self._publish(updates)

    def context(self) -> str:
        """The text of the buffers committed so far, the most recent `CONTEXT_CHARS` (whole transcripts)."""
        return " ".join(self._said)

    async def _set_context(self, stream: ASRStream, at: float) -> None:
        """Give a new buffer's stream the session's language and task, the turns before it and the session's
        vocabulary (module doc). A language or task the model cannot do is an error event, and the turn is
        heard as the profile says."""
        speech = self.speech() if self.speech is not None else None
        if speech is not None:
            try:
                await self.worker.run(Priority.ASR, stream.set_speech, speech)
            except ConfigError as err:
                field = "language" if speech.language not in ("", "en") else "task"  # the first checked
                await self.emit(error_event(str(err), code="invalid_value", type="invalid_request_error",
                                            param=f"session.audio.input.transcription.{field}", media_time=at))
        previous, vocabulary = self.context(), self.vocabulary() if self.vocabulary is not None else ""
        if not previous and not vocabulary:
            return
        try:
            await self.worker.run(Priority.ASR, stream.set_context, previous, vocabulary)
        except Exception as err:  # the turn is heard without context rather than not at all
            log.exception("ASR context failed")
            await self.emit(error_event(f"speech recognition context failed: {err}", code="asr_failed",
                                        type="server_error", media_time=at))

    def _remember(self, transcript: str) -> None:
        text = " ".join(transcript.split())
        if not text:
            return
        self._said.append(text)
        self._said_chars += len(text) + 1
        while len(self._said) > 1 and self._said_chars - len(self._said[0]) - 1 >= CONTEXT_CHARS:
            self._said_chars -= len(self._said.popleft()) + 1

    async def _open_gate(self) -> None:
        """A turn began in the open buffer: once the VAD has heard `MIN_SPEECH_S` of speech in it, its words flow."""
        assert self.turns is not None
        if self.turns.speech_s() >= MIN_SPEECH_S:
            self.heard_speech = True
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
            await self._withdraw_turn_before(turn.sample / SAMPLE_RATE)
        elif self.speaking:
            self.speaking = False
            item_id = self.buffer.item_id
            await self.emit(SpeechStopped(item_id=item_id, audio_end_ms=at_ms, media_time=turn.sample / SAMPLE_RATE))
            self._speech_ended = turn.sample / SAMPLE_RATE
            if isinstance(self.stream, SpeechEnds):  # the same point whether or not the pause prepared it in time
                heard_to = round(self.audio_end * SAMPLE_RATE)
                until = min(turn.sample + round(FINAL_TAIL_S * SAMPLE_RATE), heard_to)
                if self._speech_end != until:
                    await self._end_speech(until, heard_to, commit=True)
            await self._end(BufferEnd())
            if self.sink is not None:
                await self.sink.turn_ended(item_id, self.audio_end, turn.settings)

    async def _withdraw_turn_before(self, speech_at: float) -> None:
        """This buffer's speech began at `speech_at`: the turn handed on to its stream is withdrawn when that is more
        than `READ_ON_PAUSE_S` after the handed turn's speech stopped (module doc). After the event, which waits for
        nothing: the stream's first item is decided at the commit."""
        if self._read_on_from is None:
            return
        pause, self._read_on_from = speech_at - self._read_on_from, None
        if pause > READ_ON_PAUSE_S and isinstance(self.stream, ReadsOn):
            await self.worker.run(Priority.ASR, self.stream.read_on, None)

    async def _follow_pause(self, heard_to: int) -> None:
        """Prepare the final pass once the open buffer's pause has lasted `FINAL_TAIL_S`; undo it when speech goes
        on (module doc)."""
        assert self.turns is not None
        if not isinstance(self.stream, SpeechEnds):
            return
        pause = self.turns.pause_start()
        if pause is None:
            if self._speech_end is not None:
                await self._end_speech(None, heard_to)
            return
        until = pause + round(FINAL_TAIL_S * SAMPLE_RATE)
        if until <= heard_to and self._speech_end != until:
            await self._end_speech(until, heard_to)

    async def _end_speech(self, until: int | None, heard_to: int, *, commit: bool = False) -> None:
        """Tell the open stream where its speech ended (None: that it went on), and the sink what the turn would
        likely say were it to end there (not at a `commit`: the turn ends anyway); a failure is reported and costs
        only the early start: the commit's final pass runs as it would have."""
        assert isinstance(self.stream, SpeechEnds) and self.buffer is not None
        self._speech_end, self._prepared = until, False
        if self._unread:  # the stream reads what it left unread (the last chunk, after the others) first
            await self._read(self._unread.pop())
        try:
            final = await self.worker.run(Priority.ASR, self.stream.end_speech, until)
        except Exception as err:
            log.exception("preparing the final pass failed")
            await self.emit(error_event(f"speech recognition failed: {err}", code="asr_failed", type="server_error",
                                        media_time=heard_to / SAMPLE_RATE))
            final = None
        self._prepared = until is not None and final is not None
        if self.sink is None or commit or self.buffer is None:
            return
        if until is None:
            self.sink.turn_goes_on()
        elif final is not None and not self._gated():
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
                self._flowing = True
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
            self._turn_before = None  # the next buffer does not follow what was dropped
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
        if self._gated():  # no speech in it: an empty item, whatever the ASR wrote over the silence
            done = BufferTranscript(buffer.item_id, buffer.start).complete(at)
        else:
            await self._release()
            await self._publish(final)
            done = buffer.complete(at)
        self.conversation.apply(done)
        if done.transcript.strip() and isinstance(stream, ReadsOn):
            self._turn_before, self._turn_before_end = stream.turn_before(), self._speech_ended
        self._remember(done.transcript)
        await self.emit(transcript_event(done))
        await self.emit(ItemDone(item=item.to_api(), previous_item_id=previous, media_time=at))
        self.changes.mark()
        await self._close_buffer(at)
        self.commits += 1
        await self.heard.committed()

    def _gated(self) -> bool:
        """The open buffer's words wait: the gate is on, turn detection listens, it heard no speech yet, and no
        word of the buffer has been published."""
        return (self.speech_gate and not self.heard_speech and not self._flowing and self.turns is not None
                and self.turns.listening())

    def _hold(self, updates: list[TranscriptUpdate]) -> None:
        """Fold `updates` into the buffer's text and keep what they show as one update, not yet published."""
        assert self.buffer is not None
        for update in updates:
            folded = self.buffer.fold(update)
            if folded is not None:
                held = self._held
                self._held = folded if held is None else replace(folded, delta=held.delta + folded.delta)

    async def _release(self) -> None:
        """Publish what the gate held (already folded), as one update."""
        held, self._held = self._held, None
        if held is not None:
            if self.buffer is not None:  # (held before speech was heard: it starts where the speech did)
                held = replace(held, start=self.buffer.start)
            self._flowing = True
            self.conversation.apply(held)
            await self.emit(transcript_event(held))
            self.changes.mark()

    async def _close_buffer(self, at: float) -> None:
        stream, self.stream, self.buffer, self.buffer_samples, self.speaking = self.stream, None, None, 0, False
        self._speech_end, self._prepared, self._unread = None, False, []
        self.heard_speech, self._held, self._flowing, self._turn_began = False, None, False, False
        if stream is not None:
            with contextlib.suppress(Exception):
                await self.worker.run(Priority.ASR, stream.close)
        if self.turns is not None:
            self.turns.reset(round(at * SAMPLE_RATE))
