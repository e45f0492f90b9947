"""Per-session rate bounds on what a client sends: frames per second and audio faster than real time.

Backpressure already keeps a fast client from queueing work without bound, but it cannot stop one from
keeping the device busy with media nobody could be watching in real time (a flood of frames, an hour of audio
in a second). A token bucket per kind admits a sustained rate plus a burst. The two kinds differ in what
happens past it, as the session's channels do: audio is never lost, so a message beyond the bound waits
(the reader sleeps until the bucket holds it, and TCP slows the client: "as fast as the server takes it" is
then this pace), while a frame beyond the bound is dropped and counted, as video may be. Dropped frames are
reported at most once per second (with the count since the last report), so a flood of refused messages does
not become a flood of error events; the totals, and the seconds audio waited, are in the session's `metrics`.
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
    """`rate` units per second refill a bucket holding at most `capacity`. `take` spends if there is enough;
    `reserve` spends now, into debt if need be, and says how long until the debt is paid back."""

    rate: float
    capacity: float
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.level, self.stamp = self.capacity, self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float) -> bool:
        self._refill()
        if amount > self.level:
            return False
        self.level -= amount
        return True

    def reserve(self, amount: float) -> float:
        """Seconds to wait before using `amount` (0 when the bucket holds it). Reservations queue: the next
        one waits for this one's debt too, so a steady stream settles at `rate`."""
        self._refill()
        self.level -= amount
        return max(0.0, -self.level / self.rate)


class SessionLimits:
    """The two buckets of one session. `pace_audio` says how long an audio message must wait; `admit_frame`
    whether to take a frame, and after a refusal `report` says what to answer now, or None while this second's
    report was already sent (the drop is still counted)."""

    def __init__(self, config: ServeConfig, clock: Callable[[], float] = time.monotonic,
                 counts: dict[str, float] | None = None) -> None:
        self.config, self.clock = config, clock
        self.frames = TokenBucket(config.max_frames_per_s, max(1.0, config.max_frames_per_s), clock)
        audio_rate = config.max_audio_speed * SAMPLE_RATE
        self.audio = TokenBucket(audio_rate, max(audio_rate, config.audio_burst_s * SAMPLE_RATE), clock)
        self.started = clock()
        self.counts = counts if counts is not None else {}  # the transport's stats, which the metrics report
        self.counts.update(image=0, audio_paced_s=0.0)  # frames dropped, seconds audio waited
        self._unreported = 0
        self._last_report = -1e9

    def pace_audio(self, samples: int) -> float:
        wait = self.audio.reserve(samples)
        self.counts["audio_paced_s"] = round(self.counts["audio_paced_s"] + wait, 3)
        return wait

    def admit_frame(self) -> bool:
        if self.frames.take(1.0):
            return True
        self.counts["image"] += 1
        self._unreported += 1
        return False

    def media_horizon(self) -> float:
        """The latest media second a client streaming at the bounded pace can have reached by now."""
        return self.config.audio_burst_s + self.config.max_audio_speed * (self.clock() - self.started)

    @property
    def max_audio_message_s(self) -> float:
        """The longest audio message the bucket holds (its capacity): a longer one could only be taken in debt
        beyond the burst, so it is refused as too large."""
        return self.audio.capacity / SAMPLE_RATE

    def report(self) -> str | None:
        """What to answer a dropped frame now, or None within a second of the last answer."""
        now = self.clock()
        if now - self._last_report < 1.0:
            return None
        count, self._unreported = self._unreported, 0
        self._last_report = now
        return (f"frames arrive faster than {self.config.max_frames_per_s:g} per second (serve.max_frames_per_s): "
                f"dropped {count} frame(s) since the last report, {self.counts['image']} in all")
