"""Whether the open input buffer's words may be published yet: the speech gate. Pure state and decisions: the audio
processor (pipeline/audio.py) folds, publishes and emits; `TranscriptGate` says whether its words wait, keeps what
waited, and says when the gate opens.

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
"""

from __future__ import annotations

from dataclasses import replace

from runtime.models.asr.base import TranscriptUpdate
from runtime.pipeline.input_buffer import BufferTranscript
from runtime.pipeline.turn_signals import Turns

MIN_SPEECH_S = 0.25  # the gate opens once the VAD heard this much speech in a buffer (Silero's min_speech_duration_ms)


class TranscriptGate:
    """The open buffer's gate (module doc): closed until the VAD hears speech in it, unless its words already flow.
    The audio processor tells it what happens to the buffer (`reset` when one closes)."""

    def __init__(self, on: bool, turns: Turns | None) -> None:
        """`on`: the profile's `pipeline.speech_gate`; `turns`: the processor's turn detection (None: nothing is
        gated), read for whether it listens and how much speech it heard."""
        self.on, self.turns = on, turns
        self.heard_speech = False  # the VAD heard speech in the open buffer
        self._held: TranscriptUpdate | None = None  # the open buffer's words, joined, while the gate waits
        self._flowing = False  # the open buffer's words have been published: the gate stays open for it

    def waits(self) -> bool:
        """The open buffer's words wait: the gate is on, turn detection listens, it heard no speech yet, and no
        word of the buffer has been published."""
        return (self.on and not self.heard_speech and not self._flowing and self.turns is not None
                and self.turns.listening())

    def hears_speech(self) -> bool:
        """A turn began in the open buffer: whether the VAD has now heard `MIN_SPEECH_S` of speech in it (then it
        has, for the rest of the buffer, and what waited is to be released)."""
        assert self.turns is not None
        if self.turns.speech_s() >= MIN_SPEECH_S:
            self.heard_speech = True
            return True
        return False

    def hold(self, buffer: BufferTranscript, updates: list[TranscriptUpdate]) -> None:
        """Fold `updates` into the buffer's text and keep what they show as one update, not yet published."""
        for update in updates:
            folded = buffer.fold(update)
            if folded is not None:
                held = self._held
                self._held = folded if held is None else replace(folded, delta=held.delta + folded.delta)

    def release(self, start: float | None) -> TranscriptUpdate | None:
        """What waited (already folded), as one update for the caller to publish, starting at `start` (the buffer's
        start now: held before speech was heard, it starts where the speech did; None: as it was); None when
        nothing waited. Once released, the buffer's words flow."""
        held, self._held = self._held, None
        if held is None:
            return None
        self._flowing = True
        return replace(held, start=start) if start is not None else held

    def published(self) -> None:
        """A word of the open buffer was published: the gate never closes on it again."""
        self._flowing = True

    def reset(self) -> None:
        """The buffer closed: the next one starts closed, with nothing held."""
        self.heard_speech, self._held, self._flowing = False, None, False
