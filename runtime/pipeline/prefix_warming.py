"""Think while reading, on a remote server: keep its prefix cache holding the conversation as it grows.

The local engine prefills the context into its own KV as it streams in (`prefill.py`). A remote server has its
own prefix cache instead (vLLM, SGLang, llama.cpp), and this processor fills it: whenever the conversation
changed, at most once per `interval_s`, it sends the answerer's prefill-only request for the context so far.
When a question comes, the server finds the transcript cached and prefills only the question.

Bounded by construction: one request in flight per session, none while an answer streams (the server's slot is
the answer's then; a warm-up in flight when a question comes is given up), and changes coalesce
(`ContextChanges`), so a burst of transcript deltas costs one request. And a session's warm-ups take at most
`DUTY` of its time: after a warm-up of d seconds the next waits d * (1 / DUTY - 1). A warm-up is short when the
server's cache held the session's prefix; a long one means it did not (another session's prompt took the server's
slot: llama.cpp's Python server has one) or that the server is busy, and then warming again soon only queues
in front of the answers. Measured in the fleet test (six sessions on one single-slot llama.cpp server, every
2 s): each warm-up evicted another session's prefix and re-read about 1,000 tokens (10 s), and an answer waited
behind them for over a minute.
A failed warm-up is counted and otherwise ignored: it only costs the next question its cache, and the answer
itself reports a server that is down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from runtime.function_tools import ToolUse
from runtime.memory.conversation import Conversation
from runtime.session_state import AnswerActivity, ContextChanges, SessionSettings

log = logging.getLogger(__name__)

DUTY = 0.1  # the share of a session's time its warm-ups may take (module doc)


class Warming(Protocol):
    async def warm(self, context: str, tools: ToolUse | None = None) -> None: ...


class PrefixWarmer:
    def __init__(self, remote: Warming, conversation: Conversation, changes: ContextChanges,
                 activity: AnswerActivity, *, interval_s: float, settings: SessionSettings | None = None) -> None:
        """`settings`: the session's, whose tools go with each warm-up (they are part of the prompt's head)."""
        self.remote, self.conversation, self.changes, self.activity = remote, conversation, changes, activity
        self.settings = settings
        self.interval_s = interval_s
        self.sent = 0
        self.failed = 0
        self.cancelled = 0  # warm-ups given up because a question came
        self._warmed = ""  # the context the server last cached
        self._last = -float("inf")  # monotonic time of the last request
        self._rested = -float("inf")  # monotonic time until which the last warm-up's duty pause lasts

    @property
    def caught_up(self) -> bool:
        """Whether the server's cache holds the conversation as it is now (the last warm-up sent all of it)."""
        return bool(self._warmed) and self._warmed == self.conversation.context()

    async def run(self) -> None:
        if self.interval_s <= 0:
            return
        while True:
            await self.changes.wait()
            await asyncio.sleep(max(0.0, self._last + self.interval_s - time.monotonic(),
                                    self._rested - time.monotonic()))
            await self.activity.idle()  # the answer's own prompt refreshes the cache; wait for it to end
            context = self.conversation.context()
            if not context or context == self._warmed:
                continue
            self._last = time.monotonic()
            self.sent += 1
            warm = asyncio.ensure_future(self.remote.warm(context, self.settings.config.tools if self.settings
                                                          else None))
            asked = asyncio.ensure_future(self.activity.asking())
            try:
                await asyncio.wait((warm, asked), return_when=asyncio.FIRST_COMPLETED)
            finally:
                asked.cancel()
                if not warm.done():  # a question came (or the session stops): its own request goes first, and
                    warm.cancel()    # a server that aborts a request whose client left frees its slot for it
                    warm.add_done_callback(_retrieved)
                took = time.monotonic() - self._last
                self._rested = time.monotonic() + took * (1 / DUTY - 1)
            if not warm.done():
                self.cancelled += 1
                continue
            if warm.exception() is not None:  # a warm-up never fails the session
                self.failed += 1
                log.debug("warm-up failed: %s", warm.exception())
            else:
                self._warmed = context


def _retrieved(task: asyncio.Future[None]) -> None:
    """A given-up warm-up's outcome is read, so an error it ended with is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()
