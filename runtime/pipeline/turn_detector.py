"""When a user starts and stops speaking: OpenAI Realtime's `server_vad` and `semantic_vad` rules over per-window
speech probabilities (Silero VAD, `runtime/models/turns/silero_vad.py`). Pure and synchronous: no model, no
clock, no asyncio, so every rule is tested on scripted probabilities and media time is exact (sample indices).

server_vad: a window whose probability reaches `threshold` starts speech; the reported start is the onset minus
`prefix_padding_ms` (never before the start of the current input buffer), so the audio handed on keeps the soft
beginning the VAD scores late. Speech stops once silence has lasted `silence_duration_ms`, and the reported end
is where that silence began. Silence begins only below `threshold - 0.15` and speech resumes only at
`threshold` again: the hysteresis of Silero's own iterator (its `neg_threshold`), so a window hovering around
the threshold neither splits an utterance nor starts a pause. Windows in that band leave a pause running.

semantic_vad: a pause is not ended by its length alone. When it reaches the eagerness's check length, the
`end_of_turn(pause_start_sample)` callable (Smart Turn) says how likely the speaker has finished; at
`END_OF_TURN_THRESHOLD` or above speech stops there, otherwise it is asked again each further check length (a
longer pause is more evidence, and the model sees it), and at the eagerness's maximum silence speech stops
anyway. `silence_duration_ms` is unused there, as in OpenAI's API.

    eagerness      first check / re-check   maximum silence
    high           200 ms                   2 s
    medium, auto   400 ms                   4 s
    low            800 ms                   8 s

The maxima are the timeouts OpenAI documents for semantic_vad (8, 4 and 2 s). 200 ms is the shortest pause
Smart Turn's authors pair it with (their VAD stops after 0.2 s): shorter gaps are mostly stop consonants and
breaths. Medium asks at 400 ms, before server_vad's default 500 ms, so a finished sentence is answered sooner
than by silence alone while an unfinished one waits longer; low doubles that for speakers who pause to think.
Each check runs the model once (tens of ms on a CPU), which bounds a pause's cost to about ten calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

SAMPLE_RATE = 16_000
HYSTERESIS = 0.15  # silence is below threshold - HYSTERESIS, as Silero's neg_threshold
END_OF_TURN_THRESHOLD = 0.5

Eagerness = Literal["low", "medium", "high", "auto"]
# eagerness -> (check every ms of pause, maximum silence in ms); the module docstring says why
EAGERNESS_MS: dict[str, tuple[int, int]] = {
    "high": (200, 2000),
    "medium": (400, 4000),
    "auto": (400, 4000),
    "low": (800, 8000),
}


@dataclass(frozen=True)
class VADSettings:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_sample: int  # the onset minus the prefix padding, clamped to the buffer's start


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_sample: int  # where the silence that ended the speech began


TurnEvent = SpeechStarted | SpeechStopped


class TurnDetector:
    """One input stream's speech state; window i covers samples [i*window_samples, (i+1)*window_samples).

    With `end_of_turn` it applies semantic_vad, without it server_vad. The callable runs inside `push`, on the
    caller's thread: whoever wires Smart Turn in calls `push` where model compute belongs.
    """

    def __init__(self, settings: VADSettings = VADSettings(), window_samples: int = 512, *,
                 end_of_turn: Callable[[int], float] | None = None, eagerness: Eagerness = "auto",
                 sample_rate: int = SAMPLE_RATE) -> None:
        if eagerness not in EAGERNESS_MS:
            raise ValueError(f"eagerness must be one of {', '.join(EAGERNESS_MS)}, got {eagerness!r}")
        per_ms = sample_rate / 1000
        self.settings = settings
        self._window = window_samples
        self._prefix = round(settings.prefix_padding_ms * per_ms)
        self._silence = round(settings.silence_duration_ms * per_ms)
        self._end_of_turn = end_of_turn
        check_ms, max_ms = EAGERNESS_MS[eagerness]
        self._check = round(check_ms * per_ms)
        self._max_silence = round(max_ms * per_ms)
        self._buffer_start = 0
        self.speaking = False
        self._pause_start: int | None = None  # sample where the current pause began, while speaking
        self._next_check = 0  # pause length (samples) at which end_of_turn is asked next

    def reset(self, at_sample: int = 0) -> None:
        """Forget any speech: the input buffer now starts at `at_sample` (cleared or committed), and no event
        will point before it; windows that end before it are ignored."""
        self._buffer_start = at_sample
        self.speaking = False
        self._pause_start = None

    @property
    def pause_start(self) -> int | None:
        """While speaking: the sample where the current pause began (None: no pause, or not speaking)."""
        return self._pause_start if self.speaking else None

    def push(self, probs: Sequence[float], first_window: int) -> list[TurnEvent]:
        """The events that the speech probabilities of windows first_window, first_window + 1, ... cause."""
        threshold = self.settings.threshold
        events: list[TurnEvent] = []
        for i, prob in enumerate(probs, start=first_window):
            start, end = i * self._window, (i + 1) * self._window
            if end <= self._buffer_start:
                continue
            if not self.speaking:
                if prob >= threshold:
                    self.speaking = True
                    events.append(SpeechStarted(max(start - self._prefix, self._buffer_start)))
                continue
            if prob >= threshold:
                self._pause_start = None
                continue
            if self._pause_start is None:
                if prob >= threshold - HYSTERESIS:
                    continue  # the hysteresis band: still speech
                self._pause_start = max(start, self._buffer_start)
                self._next_check = self._check
            if self._pause_ends(end - self._pause_start):
                events.append(SpeechStopped(self._pause_start))
                self.speaking = False
                self._pause_start = None
        return events

    def _pause_ends(self, paused: int) -> bool:
        if self._end_of_turn is None:
            return paused >= self._silence
        if paused >= self._max_silence:
            return True
        if paused < self._next_check:
            return False
        while self._next_check <= paused:  # one question per check, however long the windows are
            self._next_check += self._check
        assert self._pause_start is not None
        return self._end_of_turn(self._pause_start) >= END_OF_TURN_THRESHOLD
