"""A trace of the device worker's jobs, for finding where a turn's latency goes (`--trace-jobs FILE`).

Why: voice-to-voice latency is the sum of many short jobs on one or two threads (ASR chunks, prefills, decode steps,
synthesis), queued by priority and shared by every conversation. The server's metrics say how busy each priority
was; only the jobs themselves, in time, show which one a turn waited behind: every latency study of this project
began with such a trace.

Format: Chrome's trace-event JSON, one complete event (`"ph": "X"`) per job, so the file opens as it is in Perfetto
(https://ui.perfetto.dev) or chrome://tracing, one track per worker thread (named by a metadata event): `name` is
the job's function (`EngineAnswerer.start`, `CausalWhisperStream.accept`), `cat` its priority, `ts` and `dur`
microseconds (ts on the process's monotonic clock), `args.items` the items of a job that ran several callers' work
at once. The array is written as jobs end and left unclosed, which both viewers accept, so a killed server's trace
still opens. A line is about 120 bytes and a conversation runs some 10-30 jobs a second: about 10 MB an hour per
conversation. Writes go straight to the file from the worker thread that ran the job (a few microseconds, under a
lock), never from the event loop.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path
from typing import IO

from runtime.errors import UserError


class JobTrace:
    """An open trace file that the worker's threads append their jobs to."""

    def __init__(self, path: Path) -> None:
        try:
            self._file: IO[str] = path.open("w", buffering=1)  # a line at a time: readable while the server runs
        except OSError as err:
            raise UserError(f"--trace-jobs {path}: cannot write it ({err.strerror or err})") from None
        self.path = path
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._named: set[int] = set()
        self._file.write("[\n")
        self.jobs = 0

    def record(self, name: str, priority: str, started: float, elapsed: float, items: int = 1) -> None:
        """One job that ran `elapsed` seconds from `started` (time.perf_counter) on the calling thread."""
        thread = threading.current_thread()
        tid = thread.native_id or 0
        event: dict[str, object] = {"name": name, "cat": priority, "ph": "X", "ts": round(started * 1e6),
                                    "dur": round(elapsed * 1e6), "pid": self._pid, "tid": tid}
        if items != 1:
            event["args"] = {"items": items}
        line = json.dumps(event, separators=(",", ":")) + ",\n"
        with self._lock:
            if self._file.closed:
                return
            if tid not in self._named:  # the track's name: the worker thread's own
                self._named.add(tid)
                meta = {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid, "args": {"name": thread.name}}
                self._file.write(json.dumps(meta, separators=(",", ":")) + ",\n")
            self._file.write(line)
            self.jobs += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()


def job_name(fn: object) -> str:
    """A job's name in the trace: its function's qualified name (`EngineAnswerer.start`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)
