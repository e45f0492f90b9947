"""Per-session rate bounds on what a client sends: frames per second and audio faster than real time.

Backpressure already keeps a fast client from queueing work without bound, but it cannot stop one from
keeping the device busy with media nobody could be watching in real time (a flood of frames, an hour of audio
in a second). A token bucket per kind admits a sustained rate plus a burst; what exceeds it is dropped and
counted. Refusals are reported at most once per second per kind (with the count since the last report), so a
flood of refused messages does not become a flood of error events; the totals are in the session's `metrics`.
The same pace bounds frame timestamps: no client can have reached a media time beyond the audio burst plus
`max_audio_speed` times the wall time since the session began, so a frame stamped later is refused rather
than allowed to move the session's clock (and its frame sampler) far ahead of everything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.chunks import SAMPLE_RATE
from runtime.config import ServeConfig


@dataclass
class TokenBucket:
    """`rate` units per second refill a bucket holding at most `capacity`; `take` spends if there is enough."""

    rate: float
    capacity: float
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.level, self.stamp = self.capacity, self.clock()

    def take(self, amount: float) -> bool:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount > self.level:
            return False
        self.level -= amount
        return True


class SessionLimits:
    """The two buckets of one session. `admit_*` say whether to take a message; after a refusal, `report`
    says what to answer now, or None while this second's report was already sent (the drop is still counted)."""

    def __init__(self, config: ServeConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self.frames = TokenBucket(config.max_frames_per_s, max(1.0, config.max_frames_per_s), clock)
        audio_rate = config.max_audio_speed * SAMPLE_RATE
        self.audio = TokenBucket(audio_rate, max(audio_rate, config.audio_burst_s * SAMPLE_RATE), clock)
        self.started = clock()
        self.dropped = {"audio": 0, "image": 0}
        self._unreported = {"audio": 0, "image": 0}
        self._last_report = {"audio": -1e9, "image": -1e9}

    def admit_audio(self, samples: int) -> bool:
        return self._count(self.audio.take(samples), "audio")

    def admit_frame(self) -> bool:
        return self._count(self.frames.take(1.0), "image")

    def media_horizon(self) -> float:
        """The latest media second a client streaming at the bounded pace can have reached by now."""
        return self.config.audio_burst_s + self.config.max_audio_speed * (self.clock() - self.started)

    @property
    def max_audio_message_s(self) -> float:
        """The longest audio message the bucket can ever admit (its capacity); a longer one is never taken."""
        return self.audio.capacity / SAMPLE_RATE

    def _count(self, admitted: bool, kind: str) -> bool:
        if not admitted:
            self.dropped[kind] += 1
            self._unreported[kind] += 1
        return admitted

    def report(self, kind: str) -> str | None:
        now = self.clock()
        if now - self._last_report[kind] < 1.0:
            return None
        count, self._unreported[kind] = self._unreported[kind], 0
        self._last_report[kind] = now
        if kind == "audio":
            why = (f"audio arrives faster than {self.config.max_audio_speed:g}x real time (serve.max_audio_speed) "
                   f"beyond a {self.config.audio_burst_s:g} s burst")
        else:
            why = f"frames arrive faster than {self.config.max_frames_per_s:g} per second (serve.max_frames_per_s)"
        return f"{why}: dropped {count} message(s) since the last report, {self.dropped[kind]} in all"
