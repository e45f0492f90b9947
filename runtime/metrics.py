"""Event-loop lag: how late the loop wakes a sleeping task. A blocked loop delays every session's audio,
so this is the first number to look at when captions stutter. Reported in `metrics` events and /healthz,
with the process's resident memory (`rss_mb`)."""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from collections import deque
from typing import Any

RECENT_SAMPLES = 20_000  # what `percentiles` can look back over: 200 s at the server's 10 ms interval


class LoopLagMonitor:
    """Sleeps `interval_s` in a loop and records how much later than asked it woke up."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._window: list[float] = []
        self.max_s = 0.0
        self.samples = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)  # (wall time, lag): percentiles()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loop-lag-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - before - self.interval_s)
            self._window.append(lag)
            self._recent.append((time.monotonic(), lag))
            self.max_s = max(self.max_s, lag)
            self.samples += 1
            if len(self._window) > 10_000:  # bounded even if nobody reads it
                del self._window[:5_000]

    def report(self) -> dict[str, Any]:
        """Lag since the previous report (mean, max) and the maximum over the whole run, in ms."""
        window, self._window = self._window, []
        mean = sum(window) / len(window) if window else 0.0
        return {
            "mean_ms": round(mean * 1000, 3),
            "max_ms": round(max(window, default=0.0) * 1000, 3),
            "max_ms_total": round(self.max_s * 1000, 3),
            "samples": self.samples,
        }

    @property
    def history_s(self) -> float:
        """The longest window `percentiles` can cover: what the bounded sample history spans."""
        return RECENT_SAMPLES * self.interval_s

    def percentiles(self, window_s: float = 10.0) -> dict[str, Any]:
        """p50/p95/p99/max lag in ms over the last `window_s` seconds, at most `history_s` (the answer's
        `window_s` says which); unlike `report` it resets nothing, so any number of readers (the /healthz
        endpoint, a benchmark) may ask."""
        window_s = min(window_s, self.history_s)
        since = time.monotonic() - window_s
        lags = sorted(lag for t, lag in self._recent if t >= since)
        if not lags:
            return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0, "samples": 0, "window_s": window_s}

        def at(q: float) -> float:
            return round(lags[min(len(lags) - 1, int(q * len(lags)))] * 1000, 3)

        return {"p50": at(0.5), "p95": at(0.95), "p99": at(0.99), "max": round(lags[-1] * 1000, 3),
                "samples": len(lags), "window_s": window_s}


def rss_mb() -> tuple[float, str]:
    """This process's resident memory in MB and where it came from: VmRSS (current) from /proc, or where /proc
    is missing the peak from getrusage, which can only grow."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024, "VmRSS (current)"
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (1024 * 1024 if sys.platform == "darwin" else 1024), "ru_maxrss (peak)"
