"""The server under test in `runtime bench voice`'s voice-to-voice rows (voice_latency.py says what they measure):
`python -m runtime serve --profile P` in its own process, with the voice, as users run it, and the most memory it
holds while the conversations run.

Why its own process: the RSS it reports on `/healthz` is then the server's alone, not the clients' (the serve
bench's `_Server`, reused here with another profile). Why the peak, read while a phase runs: it is what a host must
have for that many conversations at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.bench.serve import _free_port, _Server


class VoiceServer(_Server):
    """`python -m runtime serve --profile P` in its own process (the serve bench's `_Server`, another profile), its
    stderr in a temporary folder that `stop()` removes. Started by `voice_latency.start_server` before the rows that
    do not time anything (voice.py: intelligibility), so that its load overlaps them."""

    def __init__(self, profile: str, max_sessions: int, overrides: list[str], trace: Path | None = None) -> None:
        self.port = _free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="runtime-bench-voice-"))
        self.log = self.tmp / "server.stderr"
        self.cmd = [sys.executable, "-m", "runtime", "serve", "--profile", profile, "--port", str(self.port),
                    "--max-sessions", str(max_sessions)] + [a for o in overrides for a in ("--set", o)]
        if trace is not None:
            self.cmd += ["--trace-jobs", str(trace.resolve())]
        self.started = time.perf_counter()
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


class PeakRss:
    """The server's largest RSS (`/healthz`'s `rss_mb`) read every `every_s` while the block runs: what a host must
    have for that many conversations at once (weights, caches, buffers), the models' copy counted once."""

    def __init__(self, server: VoiceServer, every_s: float = 0.5) -> None:
        self.server, self.every_s, self.mb = server, every_s, 0.0
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.mb = max(self.mb, float((await asyncio.to_thread(self.server.health, 1.0))["rss_mb"]))
            await asyncio.sleep(self.every_s)

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(OSError):  # one last reading: a short phase may end between two polls
            self.mb = max(self.mb, float((await asyncio.to_thread(self.server.health, 1.0))["rss_mb"]))
