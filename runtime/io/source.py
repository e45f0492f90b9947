"""The source protocol, and the thread-to-event-loop handoff every source here is built on.

Decoding and device reads are blocking CPU work, so they run in background threads and never on the event
loop. Each thread hands items over through one small bounded asyncio queue: when the consumer is slow the
thread blocks in `emit` (memory never grows), and when the consumer stops (``aclose``, ``break``, an
exception) the threads see the stop flag within ~50 ms and exit; the iterator waits for them, so nothing is
left running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from runtime.chunks import AudioChunk, VideoFrame

Item = AudioChunk | VideoFrame
Emit = Callable[[Item], bool]
"""Hands one item to the consumer, blocking while the queue is full; False means stop producing."""

Producer = Callable[[Emit], None]
"""Runs in its own thread and calls `emit` for each item in media-time order; returns when done."""

_POLL_S = 0.05
_JOIN_S = 5.0


@runtime_checkable
class Source(Protocol):
    """Anything that yields audio chunks and video frames in media-time order."""

    description: str  # e.g. "file talk.mp4", "camera /dev/video0 + microphone default (alsa)"
    duration: float | None  # media seconds if known (files), else None (live)

    def __aiter__(self) -> AsyncIterator[Item]: ...

    async def aclose(self) -> None: ...


def available_time(item: Item) -> float:
    """Media time at which an item is complete: the end of an audio chunk (a live microphone delivers a
    chunk only once it is recorded), the presentation time of a frame. Sources order items by it."""
    return item.end if isinstance(item, AudioChunk) else item.time


class _End:
    pass


class _Closed:
    pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class ThreadedSource:
    """Base class: subclasses return their producers from `_producers()` and release resources in
    `_release()`. Iterate once; `speed` > 0 paces release to the wall clock (1.0 = real time), 0 = as fast
    as the consumer takes items."""

    description: str = ""
    duration: float | None = None

    def __init__(self, *, speed: float = 0.0, queue_size: int = 8) -> None:
        if speed < 0:
            raise ValueError(f"speed must be >= 0, got {speed}")
        self.speed = speed
        self.queue_size = max(1, queue_size)
        self.position = 0.0  # media seconds released so far (for progress bars)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._closed = False
        self._queue: asyncio.Queue | None = None
        self._agen: weakref.ref | None = None  # weak: a consumer's `break` lets it be finalized

    # -- for subclasses -------------------------------------------------------------------------------
    def _producers(self) -> list[Producer]:
        raise NotImplementedError

    def _release(self) -> None:
        """Close what was opened up front (called once, after the producer threads have stopped)."""

    def _wrap_error(self, error: BaseException) -> BaseException:
        """Turn an error raised in a producer thread into the one the consumer sees."""
        return error

    # -- protocol -------------------------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Item]:
        if self._started or self._closed:
            raise RuntimeError(f"{self.description or type(self).__name__} can be iterated only once")
        self._started = True
        agen = self._iterate()
        self._agen = weakref.ref(agen)
        return agen

    async def aclose(self) -> None:
        """Stop the producer threads, wait for them, release devices and files. Idempotent."""
        agen = self._agen() if self._agen is not None else None
        self._agen = None
        if agen is not None and agen.ag_running:  # type: ignore[attr-defined]
            self._stop.set()  # another task waits inside it for an item: wake it, it ends the iteration
            if self._queue is not None:
                with contextlib.suppress(asyncio.QueueFull):
                    self._queue.put_nowait(_Closed())
        elif agen is not None:
            await agen.aclose()  # type: ignore[attr-defined]
        await self._shutdown()

    async def __aenter__(self) -> ThreadedSource:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- machinery ------------------------------------------------------------------------------------
    async def _iterate(self) -> AsyncIterator[Item]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item | _End | _Closed | _Failure] = asyncio.Queue(self.queue_size)
        self._queue = queue
        producers = self._producers()
        remaining = len(producers)
        for index, producer in enumerate(producers):
            thread = threading.Thread(
                target=self._run, args=(producer, loop, queue), name=f"source-{index}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        try:
            origin: float | None = None  # media time released at the wall-clock start
            wall0 = loop.time()
            while remaining and not self._stop.is_set():
                item = await queue.get()
                if isinstance(item, _End):
                    remaining -= 1
                    continue
                if isinstance(item, _Closed):
                    return
                if isinstance(item, _Failure):
                    raise self._wrap_error(item.error)
                due = available_time(item)
                if self.speed > 0:
                    if origin is None:
                        origin = item.start if isinstance(item, AudioChunk) else item.time
                        wall0 = loop.time()
                    delay = wall0 + (due - origin) / self.speed - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if self._stop.is_set():
                        return
                self.position = max(self.position, due)
                yield item
        finally:
            await self._shutdown()

    def _run(self, producer: Producer, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        def put(item: object) -> bool:
            if self._stop.is_set():
                return False
            try:
                future = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return False
            while True:
                try:
                    future.result(timeout=_POLL_S)
                    return True
                except concurrent.futures.TimeoutError:
                    if self._stop.is_set():
                        future.cancel()
                        return False
                except (concurrent.futures.CancelledError, RuntimeError):
                    return False

        try:
            producer(put)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            put(_Failure(error))
        else:
            put(_End())

    async def _shutdown(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + _JOIN_S
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not self._closed and not any(t.is_alive() for t in self._threads):
            self._closed = True  # a thread stuck in a device read releases its own device when it returns
            self._release()
