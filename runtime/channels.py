"""Bounded channels between a session's tasks, each with a declared policy for when it is full.

- `BlockingChannel`: a full channel makes `put` wait. Used for audio (never dropped: the source is slowed,
  which is backpressure) and for events (never dropped: the processors are slowed).
- `LatestChannel`: a full channel drops its oldest item and counts the drop. Used for video, where a stale
  frame is worth less than the newest one.

Both close cleanly: after `close()`, `get` drains what is left and then returns None; `put` raises
`ChannelClosed`. Every channel counts what passed through it for the `metrics` event.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class ChannelClosed(Exception):
    pass


@dataclass
class ChannelStats:
    policy: str
    capacity: int
    depth: int = 0
    max_depth: int = 0
    put: int = 0
    got: int = 0
    dropped: int = 0
    blocked_s: float = 0.0  # time producers spent waiting on a full channel

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "depth": self.depth,
            "max_depth": self.max_depth,
            "put": self.put,
            "got": self.got,
            "dropped": self.dropped,
            "blocked_s": round(self.blocked_s, 4),
        }


class _Channel(Generic[T]):
    policy = ""

    def __init__(self, capacity: int, name: str = "") -> None:
        if capacity < 1:
            raise ValueError("channel capacity must be >= 1")
        self.name = name
        self.capacity = capacity
        self._items: collections.deque[T] = collections.deque()
        self._closed = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self.stats = ChannelStats(policy=self.policy, capacity=capacity)

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """No more puts; readers drain what is queued, then get None."""
        self._closed = True
        self._readable.set()
        self._writable.set()

    def _append(self, item: T) -> None:
        self._items.append(item)
        self.stats.put += 1
        self.stats.depth = len(self._items)
        self.stats.max_depth = max(self.stats.max_depth, self.stats.depth)
        self._readable.set()
        if len(self._items) >= self.capacity:
            self._writable.clear()

    async def get(self) -> T | None:
        """The next item, or None once the channel is closed and empty."""
        while not self._items:
            if self._closed:
                return None
            self._readable.clear()
            await self._readable.wait()
        item = self._items.popleft()
        self.stats.got += 1
        self.stats.depth = len(self._items)
        self._writable.set()
        return item

    def drain_nowait(self) -> list[T]:
        """Everything queued now, without waiting (a consumer batching what piled up)."""
        items = list(self._items)
        self._items.clear()
        self.stats.got += len(items)
        self.stats.depth = 0
        self._writable.set()
        return items

    def __aiter__(self) -> _Channel[T]:
        return self

    async def __anext__(self) -> T:
        item = await self.get()
        if item is None:
            raise StopAsyncIteration
        return item


class BlockingChannel(_Channel[T]):
    policy = "block"

    async def put(self, item: T) -> None:
        """Wait while full: the producer is slowed, nothing is dropped."""
        if len(self._items) >= self.capacity and not self._closed:
            started = time.perf_counter()
            while len(self._items) >= self.capacity and not self._closed:
                self._writable.clear()
                await self._writable.wait()
            self.stats.blocked_s += time.perf_counter() - started
        if self._closed:
            raise ChannelClosed(f"channel {self.name or '?'} is closed")
        self._append(item)


class LatestChannel(_Channel[T]):
    policy = "latest"

    def put_nowait(self, item: T) -> int:
        """Never waits: when full, the oldest items are dropped. Returns how many were dropped."""
        if self._closed:
            raise ChannelClosed(f"channel {self.name or '?'} is closed")
        dropped = 0
        while len(self._items) >= self.capacity:
            self._items.popleft()
            dropped += 1
        self.stats.dropped += dropped
        self._append(item)
        return dropped

    async def put(self, item: T) -> None:
        self.put_nowait(item)
