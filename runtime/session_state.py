"""The small shared objects through which a session's parts coordinate, instead of reaching into each other.

Each has one writer and any number of readers, and each is built before the parts that use it
(`session_builder.py`), so no processor holds another processor or sets its attributes:

- `HeardClock`: how far the ASR has heard (written by the audio processor; an answer waits on it).
- `ContextChanges`: the transcript or the video memory changed (written by both; the prefiller waits on it).
- `AnswerActivity`: questions waiting or being answered (the session and the question processor write it;
  the note writer waits for it to be idle, so a note never delays an answer).
- `SessionSettings`: the client's session config (written by the session; the audio and question processors
  read it).
- `TransportStats`: what a transport measured before the session's own channels (owned by the transport;
  the session's metrics read it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from runtime.session_config import SessionConfig


class HeardClock:
    """Media seconds of audio the ASR has consumed, and how many buffer ends (commits) it has processed;
    `finished` once the audio ended (or its task stopped)."""

    def __init__(self) -> None:
        self.until = 0.0
        self.commits = 0
        self.finished = False
        self._changed = asyncio.Condition()

    async def committed(self) -> None:
        async with self._changed:
            self.commits += 1
            self._changed.notify_all()

    async def advance(self, media_time: float) -> None:
        async with self._changed:
            self.until = max(self.until, media_time)
            self._changed.notify_all()

    async def finish(self) -> None:
        async with self._changed:
            self.finished = True
            self._changed.notify_all()

    async def reached(self, media_time: float, commits: int = 0) -> None:
        """Wait until audio up to `media_time` is heard and `commits` commits are done, or no more will be."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.finished or (self.until >= media_time - 1e-9
                                                                   and self.commits >= commits))


class ContextChanges:
    """A level-triggered flag: any number of changes between two reads are one change (they coalesce)."""

    def __init__(self) -> None:
        self._dirty = asyncio.Event()

    def mark(self) -> None:
        self._dirty.set()

    async def wait(self) -> None:
        """Wait for a change and take it (the next `wait` waits for a newer one)."""
        await self._dirty.wait()
        self._dirty.clear()


class AnswerActivity:
    """Counts questions from the moment they are accepted until their answer has ended."""

    def __init__(self) -> None:
        self.open = 0
        self.last_answer_end: float | None = None  # media seconds heard when the last answer ended (idle timeout)
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = asyncio.Event()

    def asked(self) -> None:
        self.open += 1
        self._idle.clear()
        self._busy.set()

    def ended(self, at: float | None = None) -> None:
        """A question's answer ended (`at`: the media time heard then, when it was answered)."""
        if at is not None:
            self.last_answer_end = at
        self.open = max(0, self.open - 1)
        if self.open == 0:
            self._idle.set()
            self._busy.clear()

    @property
    def busy(self) -> bool:
        return self.open > 0

    async def idle(self) -> None:
        """Wait until no question is waiting or being answered."""
        while self.open:
            await self._idle.wait()

    async def asking(self) -> None:
        """Wait until a question is waiting or being answered."""
        while not self.open:
            await self._busy.wait()


class SessionSettings:
    """The session's `SessionConfig`, replaced whole by `session.update` (one writer: the session); readers
    take `.config` when they need it, so a change applies from their next chunk or answer."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config


@dataclass
class TransportStats:
    """Measured by a transport, reported in the session's `metrics`. A transport that buffers a live peer's
    audio before `push_audio` (WebRTC) says how much it holds and how much it had to drop because the models
    fell that far behind; one with rate bounds counts what they refused, by kind (web/limits.py)."""

    audio_buffered_s: float = 0.0
    audio_dropped_s: float = 0.0
    rate_limited: dict[str, float] = field(default_factory=dict)
