"""What the open input buffer's stream is told of a pause: where its speech ended, so that the final pass is prepared
during the pause, and none of the pause's silence after that. Pure state and decisions: the audio processor
(pipeline/audio.py) does the worker calls (`SpeechEnds.end_speech`, the stream's reads) and tells the `TurnSink`;
`PausePass` says where the speech ends and which chunks wait.

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
0.6-1.2 s late on an AVX2-only Zen 3. The chunks wait (`defer`), and the stream reads them in one step when speech
resumes or the stream is told anything new; a commit, of whatever kind, leaves them unread (they are the silence the
pass already stops before). A stream whose pass was not prepared reads every chunk as before.
"""

from __future__ import annotations

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk

# the audio after a speech end that the final pass still reads (module doc): past the VAD's own tail (its probability
# falls 20-90 ms after the last word), short enough that the pass is prepared well inside server_vad's 500 ms
FINAL_TAIL_S = 0.2
_TAIL = round(FINAL_TAIL_S * SAMPLE_RATE)


class PausePass:
    """The open buffer's speech end as its stream was told it, whether its final pass is prepared there, and the
    chunks that wait unread since then (module doc). The audio processor tells it what it told the stream
    (`telling`, `told`) and `reset`s it when the buffer closes."""

    def __init__(self) -> None:
        self.speech_end: int | None = None  # the open buffer's speech end given to its stream (`end_speech`)
        self._prepared = False  # the final pass is prepared at `speech_end`: the stream reads no more silence
        self._unread: list[AudioChunk] = []  # the open buffer's chunks since then, not yet read

    def in_pause(self, pause_start: int | None, heard_to: int) -> int | None:
        """Where the stream's speech is to end now (samples; None: it goes on), with turn detection's pause started
        at `pause_start` (None: speech) and the audio heard to `heard_to`: the pause's start plus `FINAL_TAIL_S` once
        that much of it was heard, until then what the stream was told. Tell the stream when it differs from
        `speech_end`."""
        if pause_start is None:
            return None
        until = pause_start + _TAIL
        return until if until <= heard_to else self.speech_end

    @staticmethod
    def at_speech_stop(stop: int, heard_to: int) -> int:
        """Where the stream's speech ends when turn detection commits the turn at a speech stop at `stop`: the same
        point whether or not the pause prepared it in time (module doc)."""
        return min(stop + _TAIL, heard_to)

    def defer(self, chunk: AudioChunk) -> bool:
        """Whether `chunk` waits unread (kept here): the final pass is prepared, and the chunk is its silence."""
        if self._prepared:
            self._unread.append(chunk)
        return self._prepared

    def with_unread(self, chunk: AudioChunk) -> AudioChunk:
        """`chunk` after what waited unread, as one chunk for the stream to read in one step; nothing waits after."""
        if not self._unread:
            return chunk
        unread, self._unread = self._unread, []
        return AudioChunk(np.concatenate([c.samples for c in (*unread, chunk)]), unread[0].start_sample)

    def telling(self, until: int | None) -> AudioChunk | None:
        """The stream is about to be told its speech ends at `until`: not prepared until it answers. Returns the
        last chunk that waited unread (None: none), for the stream to read first, after the others (`with_unread`):
        what it is told next concerns the audio it has read."""
        self.speech_end, self._prepared = until, False
        return self._unread.pop() if self._unread else None

    def told(self, until: int | None, prepared: bool) -> None:
        """The stream answered the speech end `until`: the pass is `prepared` there (the stream gave a likely
        transcript) or not (it failed, or could not tell: every chunk is read)."""
        self._prepared = until is not None and prepared

    def reset(self) -> None:
        """The buffer closed: the next one's stream was told nothing."""
        self.speech_end, self._prepared, self._unread = None, False, []
