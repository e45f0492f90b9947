"""The local session's events (`runtime serve --camera 0` or `--source FILE`) for browsers that watch it.

The local session belongs to the terminal that started the server; a browser opening the demo page can watch
its captions, notes and answers over a read-only websocket (`/v1/watch`). Watching must never slow the local
session nor grow without bound, so each watcher has a bounded queue: `publish` never waits, and a watcher that
falls `WATCHER_QUEUE` events behind is closed (the page reconnects) instead. A new watcher first gets the last
`HISTORY` events (metrics excluded), so it opens on recent captions rather than an empty page.
"""

from __future__ import annotations

import asyncio
from collections import deque

from runtime.events import Event, Metrics

WATCHER_QUEUE = 512
HISTORY = 100
MAX_WATCHERS = 32


class Watcher:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue(WATCHER_QUEUE)
        self.behind = asyncio.Event()  # set when its queue overflowed: it is closed at once, its queue unsent

    @property
    def fell_behind(self) -> bool:
        return self.behind.is_set()


class Broadcast:
    def __init__(self, description: str) -> None:
        self.description = description
        self.watchers: set[Watcher] = set()
        self.history: deque[str] = deque(maxlen=HISTORY)

    def publish(self, event: Event) -> None:
        """Called for every event of the local session, on the loop; never waits."""
        text = event.to_json()
        if event.type != Metrics.type:
            self.history.append(text)
        for watcher in list(self.watchers):
            try:
                watcher.queue.put_nowait(text)
            except asyncio.QueueFull:
                watcher.behind.set()
                self.watchers.discard(watcher)

    def watch(self) -> Watcher | None:
        """A new watcher primed with the recent history, or None at `MAX_WATCHERS`."""
        if len(self.watchers) >= MAX_WATCHERS:
            return None
        watcher = Watcher()
        for text in self.history:
            watcher.queue.put_nowait(text)
        self.watchers.add(watcher)
        return watcher
