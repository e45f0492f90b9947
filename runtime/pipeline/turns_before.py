"""What a new input buffer's ASR stream is given of the turns committed before it: their text as context, and, in a
captions session, the turn just before to read on from. Pure state and decisions: the audio processor
(pipeline/audio.py) owns the buffers and their streams, does the worker calls and asks `TurnsBefore` what to give.

Context across turns: a buffer's stream opens with the text of the buffers committed before it (the most recent
`CONTEXT_CHARS`; the backend keeps what its prompt holds, Whisper the last 223 tokens) and the session's
`audio.input.transcription.prompt` (the user's vocabulary), `ASRStream.set_context`: a reader cut at a pause goes
on in the sentence the stream already heard, in its streamed words, its previews and its final pass alike.

Reading on (`read_on`, the `ReadsOn` streams': causal Whisper with its offline pass): in a session that does not
answer turns (captions: `turn_detection.create_response` off), a committed buffer's turn is handed to the next
buffer's stream, whose final pass then reads it together with its own audio (final_pass.py, "Reading on"): a reader's
sentence cut at a pause is heard as one, when the VAD heard the next turn's speech start within `READ_ON_PAUSE_S`
of the turn before's end (a longer silence starts something new: a narrator's next slide; without turn detection
every commit hands on). Not in a session that answers: there the turns are questions with an answer
between them, and the pass's extra decode would come after the answer was prepared from the turn's own transcript
(`turn_may_end`), which a different final transcript would drop. A cleared or empty buffer hands nothing on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

CONTEXT_CHARS = 4000  # committed text kept as the next turns' context: more than Whisper's 223-token prompt holds
# Reading on joins a turn to the one before only across a reader's pause: a longer silence between the two turns'
# speech (by the VAD) starts something new (module doc). The captions bench's readers pause 0.4-1.0 s between sentences;
# `runtime bench video-qa`'s narrators speak one sentence a slide, ten seconds apart.
READ_ON_PAUSE_S = 2.0


class TurnsBefore:
    """The committed turns as the next buffer's stream is to see them: their text (the most recent `CONTEXT_CHARS`)
    and the turn handed on (module doc). The audio processor tells it what happens to its buffers, in order; it
    answers what to give the stream, and never calls the stream's worker jobs itself."""

    def __init__(self, reads_on: Callable[[], bool] | None = None) -> None:
        """`reads_on`: whether a buffer's stream reads on from the buffer committed before it now (the session's
        `captions_only`, read as each buffer opens; None: never)."""
        self.reads_on = reads_on
        self._said: deque[str] = deque()  # the committed buffers' transcripts, the most recent CONTEXT_CHARS
        self._said_chars = 0
        self._turn: object | None = None  # the last committed buffer's turn, for the next stream (`ReadsOn`)
        self._turn_end: float | None = None  # where the VAD heard that turn's speech stop (media s)
        self._speech_ended: float | None = None  # where the VAD last heard the open buffer's speech stop (media s)
        self._read_on_from: float | None = None  # the handed turn's speech end, until the open buffer's speech starts

    def context(self) -> str:
        """The text of the buffers committed so far, the most recent `CONTEXT_CHARS` (whole transcripts)."""
        return " ".join(self._said)

    def opened(self, stream_reads_on: bool) -> object | None:
        """A buffer opens (its stream `stream_reads_on`: a `ReadsOn` stream): the turn its stream is to read on from,
        or None. The turn before is handed at most once, and only while the session reads on; the caller gives it
        to the stream (`read_on`) before the first chunk. The turn may still be withdrawn (`speech_started`)."""
        before, self._turn = self._turn, None
        self._speech_ended = self._read_on_from = None
        if before is None or not stream_reads_on or self.reads_on is None or not self.reads_on():
            return None
        self._read_on_from = self._turn_end  # withdrawn if the speech starts too long after it
        return before

    def speech_started(self, at: float) -> bool:
        """The open buffer's speech began at `at`: whether the turn handed on to its stream is to be withdrawn
        (`read_on(None)`), `at` more than `READ_ON_PAUSE_S` after the handed turn's speech stopped (module doc). Asked
        once: a later start in the same buffer never withdraws it."""
        if self._read_on_from is None:
            return False
        pause, self._read_on_from = at - self._read_on_from, None
        return pause > READ_ON_PAUSE_S

    def speech_stopped(self, at: float) -> None:
        """The VAD heard the open buffer's speech stop at `at`: where its turn ends, should it be handed on."""
        self._speech_ended = at

    def cleared(self) -> None:
        """The buffer was dropped: the next buffer does not follow what was dropped."""
        self._turn = None

    def committed(self, transcript: str, turn_before: Callable[[], object | None] | None) -> None:
        """The open buffer was committed with `transcript`: it joins the context, and its turn (`turn_before`, the
        stream's `ReadsOn.turn_before`; None: a stream that cannot hand one on) is kept for the next buffer's stream
        unless the buffer holds no words."""
        if transcript.strip() and turn_before is not None:
            self._turn, self._turn_end = turn_before(), self._speech_ended
        self._remember(transcript)

    def _remember(self, transcript: str) -> None:
        text = " ".join(transcript.split())
        if not text:
            return
        self._said.append(text)
        self._said_chars += len(text) + 1
        while len(self._said) > 1 and self._said_chars - len(self._said[0]) - 1 >= CONTEXT_CHARS:
            self._said_chars -= len(self._said.popleft()) + 1
