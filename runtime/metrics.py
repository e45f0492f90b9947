"""Event-loop lag: how late the loop wakes a sleeping task. A blocked loop delays every session's audio,
so this is the first number to look at when captions stutter. Reported in `metrics` events."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class LoopLagMonitor:
    """Sleeps `interval_s` in a loop and records how much later than asked it woke up."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._window: list[float] = []
        self.max_s = 0.0
        self.samples = 0

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
