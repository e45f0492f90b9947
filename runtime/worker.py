"""The device worker: the thread that owns the models and the accelerator (with `threads=2`, a second thread that
listens: ASR and turn detection beside the language model and the voice).

Model compute never runs on the event loop. Processors hand the worker small jobs (one ASR chunk, one
prefill, one decode step) and await the result; the worker runs them one at a time in priority order, so
ASR, which holds the latency budget, overtakes queued decode steps between tokens. Models are loaded by a
worker job too and are touched only inside jobs.

The GIL: a model step is thousands of small torch ops, each releasing and retaking the GIL. When another
thread runs Python meanwhile, each retake can wait a whole switch interval (5 ms by default): a probe with
one busy Python thread beside a tiny Whisper decode took 118 s instead of 0.36 s. The worker lowers the
process's switch interval to 1 ms on start (3.4 s in the same probe); pass `switch_interval_s=None` to
leave it alone.

Bounded: at most `max_pending` jobs wait at once; a submitter beyond that waits for a slot (backpressure),
it is never refused. A job whose awaiting task was cancelled before it started is skipped.

Jobs that run together (`run_together`): submitters of the same function at the same priority that are waiting at
once share one job, which calls the function on all their items: the decode steps of several conversations become
one forward (`EngineAnswerer.step_together`), which on a CPU costs little more than one step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import ParamSpec, TypeVar

from runtime.job_trace import JobTrace, job_name

T = TypeVar("T")
A = TypeVar("A")
P = ParamSpec("P")
Together = Callable[[list[A]], list[T | Exception]]  # items in, one result (or the exception for it) per item out


class Priority(IntEnum):
    """Lower runs first."""

    CONTROL = 0  # loading, releasing per-session state
    ASR = 1
    # an answer's opening: its decode steps until its first clause is written, and that clause's synthesis. The
    # first words a user hears (or reads) come from a few short jobs; behind another conversation's question prefill
    # (about 0.25 s at two conversations on 2 cores) they waited for all of it
    OPENING = 2
    PREFILL = 3
    SPEECH = 4  # a later clause of the spoken answer: the text is ahead of the voice, so sound comes first
    DECODE = 5
    CONTEXT = 6  # the context prefilled ahead of any question: never before an answer in flight (another session's)
    VISION = 7


class WorkerStopped(RuntimeError):
    pass


LISTENING = frozenset({Priority.ASR})  # a second thread's jobs (`threads=2`): ASR and turn detection
Job = tuple[int, int, Callable[[], None] | None]


class DeviceWorker:
    def __init__(
        self, max_pending: int = 64, name: str = "device-worker", switch_interval_s: float | None = 0.001,
        threads: int = 1, trace: JobTrace | None = None,
    ) -> None:
        """`threads=2`: ASR and turn detection (`LISTENING`) run on a second thread beside the language model's and
        the voice's jobs, so that one conversation's prefill or decode step never holds back another's turn
        detection (voice-to-voice p50 at two conversations 1.29-1.36 s against 1.50-1.67 s with one thread). The
        voice stays on the first thread: beside a decode step its synthesis shared the cores and the first sound
        came later (one conversation: 0.95-1.08 s against 0.90-0.94). Each thread runs its jobs one at a time in
        priority order. `trace`: every job is recorded there as it ends (job_trace.py); the worker closes it when
        it stops."""
        if threads not in (1, 2):
            raise ValueError(f"a device worker runs 1 or 2 threads, not {threads}")
        self.max_pending = max_pending
        self.switch_interval_s = switch_interval_s
        self.name = name
        self._queues: list[queue.PriorityQueue[Job]] = [queue.PriorityQueue() for _ in range(threads)]
        self._seq = itertools.count()
        self._slots: asyncio.Semaphore | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._lock = threading.Lock()
        self._pending = 0
        self._gathering: dict[tuple[int, Callable[..., object]], list[tuple[object, Future[object]]]] = {}
        self.jobs_done: dict[str, int] = {p.name: 0 for p in Priority}
        self.busy_s = 0.0
        self.busy_by_priority_s: dict[str, float] = {p.name: 0.0 for p in Priority}  # where the worker's time goes
        self.max_job_s: dict[str, float] = {p.name: 0.0 for p in Priority}
        self.together_items: dict[str, int] = {}  # items run by jobs that ran together, by priority
        self.trace = trace

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> DeviceWorker:
        if not self._threads:
            if self.switch_interval_s is not None:
                sys.setswitchinterval(min(sys.getswitchinterval(), self.switch_interval_s))
            for i, jobs in enumerate(self._queues):
                name = self.name if i == 0 else f"{self.name}-listening"
                self._threads.append(threading.Thread(target=self._loop, args=(jobs,), name=name, daemon=True))
                self._threads[-1].start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the jobs already queued, then end the threads."""
        if not self._threads or self._stopping:
            return
        self._stopping = True
        for jobs in self._queues:
            jobs.put((len(Priority) + 1, next(self._seq), None))
        for thread in self._threads:
            thread.join(timeout)
        if self.trace is not None:
            self.trace.close()

    def __enter__(self) -> DeviceWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread of the language model's jobs (of every job with `threads=1`)."""
        return self._threads[0] if self._threads else None

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        return tuple(self._threads)

    def _jobs_for(self, priority: Priority) -> queue.PriorityQueue[Job]:
        return self._queues[1 if len(self._queues) == 2 and priority in LISTENING else 0]

    def _account(self, priority: Priority, elapsed: float, items: int = 0) -> None:
        with self._lock:
            self.busy_s += elapsed
            self.busy_by_priority_s[priority.name] += elapsed
            self.jobs_done[priority.name] += 1
            self.max_job_s[priority.name] = max(self.max_job_s[priority.name], elapsed)
            if items:
                self.together_items[priority.name] = self.together_items.get(priority.name, 0) + items

    # -- submitting ------------------------------------------------------------------------------------------
    def submit(self, priority: Priority, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Thread-safe, unbounded: for callers outside the event loop (start-up, tests)."""
        if self._stopping or not self._threads:
            raise WorkerStopped(f"{self.name} is not running")
        priority = Priority(priority)
        fut: Future[T] = Future()

        def job() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            started = time.perf_counter()
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as err:  # delivered to the awaiting side
                fut.set_exception(err)
            finally:
                elapsed = time.perf_counter() - started
                self._account(priority, elapsed)
                if self.trace is not None:
                    self.trace.record(job_name(fn), priority.name, started, elapsed)

        with self._lock:
            self._pending += 1
        fut.add_done_callback(self._job_finished)
        self._jobs_for(priority).put((int(priority), next(self._seq), job))
        return fut

    def submit_together(self, priority: Priority, fn: Together[A, T], item: A) -> Future[T]:
        """Thread-safe: `fn([item, ...])` on the worker with the items of every other submitter of `fn` at this
        priority whose job has not started yet; each future gets its item's result (or its exception). A cancelled
        future's item is left out."""
        if self._stopping or not self._threads:
            raise WorkerStopped(f"{self.name} is not running")
        priority = Priority(priority)
        fut: Future[T] = Future()
        key = (int(priority), fn)
        with self._lock:
            self._pending += 1
            batch = self._gathering.get(key)
            new = batch is None
            if batch is None:
                batch = self._gathering[key] = []
            batch.append((item, fut))  # type: ignore[arg-type]
        fut.add_done_callback(self._job_finished)
        if new:
            job = lambda: self._run_together(priority, fn, batch)  # noqa: E731 - the queue holds callables
            self._jobs_for(priority).put((int(priority), next(self._seq), job))
        return fut

    def _run_together(self, priority: Priority, fn: Together[A, T], batch: list[tuple[A, Future[T]]]) -> None:
        with self._lock:  # closed: a later submitter starts the next batch
            if self._gathering.get((int(priority), fn)) is batch:
                del self._gathering[(int(priority), fn)]
        live = [(item, fut) for item, fut in batch if fut.set_running_or_notify_cancel()]
        if not live:
            return
        started = time.perf_counter()
        try:
            results = fn([item for item, _ in live])
            if len(results) != len(live):
                raise RuntimeError(f"{fn} returned {len(results)} results for {len(live)} items")
        except BaseException as err:  # every item's
            for _, fut in live:
                fut.set_exception(err)
        else:
            for (_, fut), result in zip(live, results, strict=True):
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
        finally:
            elapsed = time.perf_counter() - started
            self._account(priority, elapsed, len(live))
            if self.trace is not None:
                self.trace.record(job_name(fn), priority.name, started, elapsed, len(live))

    def call(self, priority: Priority, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Blocking submit-and-wait, for code that is not on an event loop."""
        return self.submit(priority, fn, *args, **kwargs).result()

    async def run(self, priority: Priority, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` on the worker and await its result without blocking the loop; waits for a free slot."""
        return await self._awaited(lambda: self.submit(priority, fn, *args, **kwargs))

    async def run_together(self, priority: Priority, fn: Together[A, T], item: A) -> T:
        """`submit_together`, awaited without blocking the loop; waits for a free slot like `run`."""
        return await self._awaited(lambda: self.submit_together(priority, fn, item))

    async def _awaited(self, submit: Callable[[], Future[T]]) -> T:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_pending)
        async with self._slots:
            fut = submit()
            try:
                return await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                fut.cancel()  # skipped if it has not started; a running job finishes on its own
                raise

    def _job_finished(self, _fut: Future[object]) -> None:
        with self._lock:
            self._pending -= 1

    def _loop(self, jobs: queue.PriorityQueue[Job]) -> None:
        while True:
            _, _, job = jobs.get()
            if job is None:
                return
            job()

    # -- metrics ---------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished."""
        return self._pending

    def stats(self) -> dict[str, float | int | dict[str, int] | dict[str, float]]:
        return {
            "pending": self._pending,
            "max_pending": self.max_pending,
            "busy_s": round(self.busy_s, 4),
            "busy_by_priority_s": {k: round(v, 3) for k, v in self.busy_by_priority_s.items()},
            "jobs_done": dict(self.jobs_done),
            "max_job_ms": {k: round(v * 1000, 2) for k, v in self.max_job_s.items()},
            "together_items": dict(self.together_items),
        }
