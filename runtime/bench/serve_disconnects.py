"""Clients that vanish mid-turn: `runtime bench serve --conversations`' abrupt disconnects.

Why: a phone loses its network, a tab is closed; the server never gets a close frame, and the session it held
(its buffers, a response being answered, a turn being transcribed) must still go, without harming the others.
This is the part of the conversations bench that makes that happen on purpose and counts what stays behind.

How: F sessions (full: 100, quick: 10), `CONCURRENCY` at a time, each on a raw websocket (the SDK's transport,
minus the SDK: a client that vanishes has no SDK logic left to run). Each sends the `session.update` it is given
(server VAD, as the conversations send) and streams a sentence of the demo speech, then silence, at `pace` times
real time, and aborts its TCP transport (`transport.abort()`: no close frame, unread data dropped) at one of three
moments, in turn, each after its `session.created` came: `speaking` (after 3 to 22 chunks, mid-sentence),
`committed` (on receiving `input_audio_buffer.committed`: between the commit and the answer) and `answering` (on
receiving `response.created`).

Reported (`faults` in the bench's JSON): `mid_answer` counts the aborts made while a response the client saw
created had not yet been seen done (the tiny model answers its 24 tokens in tens of milliseconds, so the server
may well finish the answer before it notices); `opened` the aborts whose client had seen `session.created` (a
session existed to lose); `sessions_left`: the server's session count on `GET /healthz` once it reaches 0 or 30 s
have passed (0 is the only good value), and `settle_s` how long after the last abort that took. `wall_s` is how
long the disconnects took, `trigger_timed_out` the aborts whose awaited event did not come within 15 s (aborted
anyway), `client_errors` the first five client-side failures (none expected).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from runtime.bench.demo_sentences import CHUNK_S, SILENCE, Sentence
from runtime.bench.serve import _Server

CONCURRENCY = 4
TRIGGER_TIMEOUT_S = 15.0
KINDS = ("speaking", "committed", "answering")
IDLE_TIMEOUT_S = 30.0


@dataclass
class Disconnect:
    kind: str
    aborted_on: str = ""
    opened: bool = False  # the client saw session.created: there was a session to lose
    mid_answer: bool = False
    timed_out: bool = False
    error: str | None = None


async def disconnect(url: str, session_update: dict[str, Any], sentence: Sentence, kind: str,
                     speaking_chunks: int, pace: float) -> Disconnect:
    """A raw websocket session that streams a turn at `pace` times real time and aborts its TCP transport at
    `kind`; a failure is recorded in the result, not raised."""
    from websockets.asyncio.client import connect

    fault = Disconnect(kind)
    seen: list[str] = []  # the server events' types, as received
    trigger, created = asyncio.Event(), asyncio.Event()
    wanted = {"committed": "input_audio_buffer.committed", "answering": "response.created"}.get(kind)
    ws = None
    try:
        ws = await connect(url, max_size=None)

        async def read() -> None:
            assert ws is not None
            async for message in ws:
                event = json.loads(message)
                seen.append(event["type"])
                if event["type"] == "session.created":
                    created.set()
                if event["type"] == wanted:
                    trigger.set()

        reader = asyncio.create_task(read())
        # the session exists before the turn starts, so a client that vanishes after a few chunks leaves one behind
        # to lose (not aborting before a loaded server has even sent session.created)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(created.wait(), TRIGGER_TIMEOUT_S)
        await ws.send(json.dumps({"type": "session.update", "session": session_update}))
        chunks = sentence.chunks[:speaking_chunks] if kind == "speaking" else sentence.chunks
        deadline = time.perf_counter() + TRIGGER_TIMEOUT_S
        for chunk in chunks:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            await asyncio.sleep(CHUNK_S / pace)
        while wanted and not trigger.is_set() and time.perf_counter() < deadline and not reader.done():
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": SILENCE}))
            await asyncio.sleep(CHUNK_S / pace)
        fault.opened = "session.created" in seen
        fault.timed_out = bool(wanted) and not trigger.is_set()
        fault.aborted_on = seen[-1] if seen else ""
        fault.mid_answer = seen.count("response.created") > seen.count("response.done")
        ws.transport.abort()  # no close frame: the peer vanishes
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
    except Exception as err:  # noqa: BLE001 - reported
        fault.error = f"{type(err).__name__}: {err}"
        if ws is not None:
            ws.transport.abort()
    return fault


async def disconnects(server: _Server, session_update: dict[str, Any], pool: list[Sentence], count: int,
                      pace: float) -> dict[str, Any]:
    """`count` abrupt disconnects against `server`, then how many sessions it still holds once it settles."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> Disconnect:
        async with gate:
            return await disconnect(server.url, session_update, pool[i % len(pool)], KINDS[i % len(KINDS)],
                                    3 + i % 20, pace)

    started = time.perf_counter()
    faults = await asyncio.gather(*(one(i) for i in range(count)))
    wall = time.perf_counter() - started
    idle = await server.wait_idle(IDLE_TIMEOUT_S)
    settle = time.perf_counter() - started - wall
    return {"disconnects": count, "opened": sum(f.opened for f in faults),
            "by_kind": dict(Counter(f.kind for f in faults)),
            "mid_answer": sum(f.mid_answer for f in faults), "trigger_timed_out": sum(f.timed_out for f in faults),
            "client_errors": [f.error for f in faults if f.error][:5], "wall_s": round(wall, 2),
            "sessions_left": idle["sessions"], "settle_s": round(settle, 2)}
