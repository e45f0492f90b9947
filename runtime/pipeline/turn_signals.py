"""What turn detection and the audio processor tell each other, and what follows a turn: the seam between
`pipeline/audio.py` (which owns the input buffer and its ASR stream), `pipeline/turn_taking.py` (the VAD and the turn
rule, run on the worker) and `pipeline/response_requests.py` (the responses a turn asks for). Only data and protocols:
no behaviour lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from runtime.chunks import AudioChunk
from runtime.session_config import SessionConfig


@dataclass(frozen=True)
class TurnEvent:
    """What turn detection found in a chunk: speech began (`started`) or ended, at a sample of the session.
    `settings`: at an end, the session's settings when it was found, which decide what follows the turn (a
    `session.update` that lands while the turn is being committed applies to the next one)."""

    started: bool
    sample: int
    settings: SessionConfig | None = None


@dataclass(frozen=True)
class IdleTimeout:
    """No speech from `start` (the last answer's end, or the buffer's start) to `end` (samples): `idle_timeout_ms`.
    `settings`: the session's settings when it fired (as `TurnEvent.settings`)."""

    start: int
    end: int
    settings: SessionConfig | None = None


class Turns(Protocol):
    """Turn detection as the audio processor sees it (`turn_taking.TurnTaking`): `detect` runs on the worker."""

    def detect(self, chunk: AudioChunk) -> list[TurnEvent | IdleTimeout]: ...

    def reset(self, at_sample: int) -> None: ...

    def listening(self) -> bool:
        """Whether a turn rule is on now (it reports where speech starts); a session.update may change it."""
        ...

    def speech_s(self) -> float:
        """Seconds of VAD windows at the turn rule's threshold since the buffer's start (the last `reset`)."""
        ...

    def pause_start(self) -> int | None:
        """The sample where the speaker's current pause began; None while speaking or before any speech."""
        ...


class TurnSink(Protocol):
    """What follows a turn (the session's `ResponseRequests`): a response, or cancelling one on barge-in."""

    async def turn_ended(self, item_id: str, at: float, settings: SessionConfig | None) -> None: ...

    async def idle_timeout(self, item_id: str, at: float, settings: SessionConfig | None) -> None: ...

    def speech_started(self) -> None: ...

    def turn_may_end(self, item_id: str, transcript: str) -> None:
        """The user paused: if the turn ends here, `transcript` will likely be its final text (module doc)."""
        ...

    def turn_goes_on(self) -> None:
        """The paused user spoke again: what `turn_may_end` said no longer holds."""
        ...
