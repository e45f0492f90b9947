"""The microphone gated while the agent's own voice plays (`runtime serve --camera 0 --speak`), so that it does not
hear, transcribe and answer itself.

Why a gate and not echo cancellation: a laptop's speaker a few centimetres from its microphone comes back loud,
through the room and the device's own processing, and an echo canceller good enough for that (WebRTC's AEC3, speex)
is a native dependency and a tuning job; a gate is exact about what it drops. What it costs, said in the docs: while
the agent speaks (and for `hangover_s` after its last sample, for the device's output latency and the room's echo)
the user cannot interrupt by voice, and whatever they say then is not heard at all (not transcribed, not answered);
a typed `/cancel` still stops the answer. The session's `interrupt_response` is off for the same reason.

How: the player tells the gate each time it hands audio to the device (`playing(seconds)`). The device plays it in
real time from then, after what it already held, so the gate keeps closed intervals of wall time (monotonic):
a write that lands while sound still plays extends the interval, one after a gap opens a new one. `GatedSource`
wraps the live source and replaces the samples of every audio chunk recorded during a closed interval (plus the
hangover) with digital silence of the same length, so media time, the ASR's sample clock and the VAD's windows run on
unchanged; video frames pass untouched. A chunk's recording time is its media time mapped onto the wall clock by the
smallest offset seen (`arrival - chunk.end`): a chunk that waited in a queue is not taken for a later one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import numpy as np

from runtime.chunks import AudioChunk
from runtime.io.source import Item, Source

HANGOVER_S = 0.3  # after the last sample played: the device's output latency and the room's echo
KEEP_INTERVALS = 64  # closed intervals remembered (older ones are far behind any chunk still to come)


class SpeechGate:
    """Closed while the voice plays and `hangover_s` after. Thread-safe: the player's thread writes, the loop reads."""

    def __init__(self, hangover_s: float = HANGOVER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.hangover_s, self.clock = hangover_s, clock
        self._intervals: deque[list[float]] = deque(maxlen=KEEP_INTERVALS)  # [start, end of sound], wall seconds
        self._lock = threading.Lock()

    def playing(self, seconds: float) -> None:
        """`seconds` of audio were just handed to the output: they sound after what it still holds."""
        now = self.clock()
        with self._lock:
            if self._intervals and self._intervals[-1][1] >= now:
                self._intervals[-1][1] += seconds
            else:
                self._intervals.append([now, now + seconds])

    def closed(self, start: float, end: float) -> bool:
        """Whether any of wall time [start, end) falls while the voice plays or within the hangover after it."""
        with self._lock:
            return any(start < b + self.hangover_s and end > a for a, b in self._intervals)

    def speaking_until(self) -> float | None:
        """When the last sound handed to the output ends (wall time), or None before any."""
        with self._lock:
            return self._intervals[-1][1] if self._intervals else None


class GatedSource:
    """`source` with its audio silenced while `gate` is closed (the module says how); counts what it silenced."""

    def __init__(self, source: Source, gate: SpeechGate) -> None:
        self.source, self.gate = source, gate
        self.description = f"{source.description} (gated while the voice speaks)"
        self.duration = source.duration
        self.gated_s = 0.0
        self._offset: float | None = None  # wall time minus media time, the smallest seen

    def __getattr__(self, name: str) -> object:  # speed, position: what feed() and progress bars read
        return getattr(self.source, name)

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Item]:
        async for item in self.source:
            yield self.gated(item) if isinstance(item, AudioChunk) else item

    def gated(self, chunk: AudioChunk) -> AudioChunk:
        """`chunk` as it arrives now: silenced if it was recorded while the gate was closed."""
        offset = self.gate.clock() - chunk.end
        self._offset = offset if self._offset is None else min(self._offset, offset)
        if not self.gate.closed(self._offset + chunk.start, self._offset + chunk.end):
            return chunk
        self.gated_s += chunk.duration
        return AudioChunk(np.zeros_like(chunk.samples), chunk.start_sample)

    async def aclose(self) -> None:
        await self.source.aclose()
