"""`runtime bench serve --url URL`: the voice conversations of `bench serve --conversations`, driven through a
server someone else runs: a fleet's proxy (docs/fleet.md) or any one replica.

Why: `--conversations` starts its own server on loopback, which measures one process on this machine. An
operator who put replicas behind a proxy wants the same numbers through the path users take (proxy, network,
whatever profile and hardware the replicas have), at several loads, without the bench touching the servers.

How: exactly `--conversations`' phases (serve_conversations.py: the official `openai` SDK's
`realtime.connect` against `URL`, server VAD with `create_response`, each session T turns of one demo-speech
sentence followed by silence until the answer ends, 100 ms chunks at real-time pace on a shared schedule;
quick: T = 2, full: T = 5). First one probe connection checks that URL is a runtime server (it must send
`session.created`; the probe then closes with 1000), then one unmeasured one-turn conversation warms the path,
then one phase per M in `--sessions` (default quick: 1,2; full: 1,2,4), one after another. Nothing else: no
disconnect faults, no long session, and no server-side reading (a proxy's /healthz is some replica's), so it
never disturbs the fleet beyond the conversations themselves.

Reported per M (`per_m`, keyed by M as a string): `turn_latency_ms` (p50 = median, p95, max, n: receive time of
the turn's first `response.output_text.delta` minus the send time of the chunk holding the end of the sentence's
speech), `answer_after_stop_ms` (p50, p95: the server's part after its VAD stopped the turn, the number that
shows load), `errors` (server `error` events, total and `error_codes` by code), `sessions_failed` (a session
that raised or did not end with the server's 1000 after finish: refused by a full fleet, cut by a dying
replica), `turns_spoken`, `turns_answered` and `lost` (serve_conversations.py defines it: 0 is the only good
value). `rows` holds each phase's full row, as `--conversations` reports it.

Caveats: the clients run on this machine, so a small machine's clients measure their own loop too. What an
answer says depends on the servers' profile; only its timing and the counts are measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from runtime.bench.demo_sentences import CHUNK_MS, sentences
from runtime.bench.serve_conversations import (
    CONNECT_LEAD_S,
    FULL_NS,
    FULL_TURNS,
    QUICK_NS,
    QUICK_TURNS,
    TURN_DETECTION,
    TURN_TIMEOUT_S,
    _phase,
)
from runtime.errors import UserError

Status = Callable[[str], None]
PROBE_TIMEOUT_S = 15.0


def base_url(url: str) -> str:
    """The SDK's `websocket_base_url` for URL: ws[s]://HOST[:PORT]/PREFIX, given with or without the trailing
    `/realtime` (the SDK adds it); anything else is a one-line error."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise UserError(f"--url {url!r}: give the websocket base, ws://HOST:PORT/v1 (a proxy's or a replica's; "
                        "wss:// for TLS)")
    if parts.query or parts.fragment:
        raise UserError(f"--url {url!r}: no query or fragment; the SDK adds ?model=... itself")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/realtime")
    return f"{parts.scheme}://{parts.netloc}{path}"


async def probe(base: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The server's session.created on one connection (then closed with 1000), or a one-line UserError saying
    why URL is no runtime server: unreachable, refused (a full fleet answers 503), or a greeting of another kind."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus, WebSocketException

    url = f"{base}/realtime"
    try:
        async with asyncio.timeout(timeout_s):
            async with connect(url, max_size=None) as ws:
                greeting = json.loads(await ws.recv())
                replica = ws.response.headers.get("X-Runtime-Replica") if ws.response is not None else None
    except InvalidStatus as err:
        raise UserError(f"--url {url}: the server refused the websocket with HTTP {err.response.status_code}"
                        ) from None
    except TimeoutError:
        raise UserError(f"--url {url}: no session.created within {timeout_s:g} s") from None
    except (OSError, WebSocketException, ValueError) as err:
        raise UserError(f"--url {url}: cannot open a session: {err or type(err).__name__}") from None
    if not isinstance(greeting, dict) or greeting.get("type") != "session.created":
        kind = greeting.get("type") if isinstance(greeting, dict) else type(greeting).__name__
        detail = greeting.get("error", {}).get("message", "") if isinstance(greeting, dict) else ""
        raise UserError(f"--url {url}: the first message was {kind!r}, not session.created"
                        + (f": {detail}" if detail else ""))
    return {"session": greeting.get("session", {}), "replica": replica}


def _per_m(row: dict[str, Any]) -> dict[str, Any]:
    loss, latency, after = row["loss"], row["turn_latency_ms"], row["answer_after_stop_ms"]
    return {"turn_latency_ms": {"p50": latency["p50"], "p95": latency["p95"], "max": latency["max"],
                                "n": latency["n"]},
            "answer_after_stop_ms": {"p50": after["p50"], "p95": after["p95"]},
            "errors": sum(loss["errors"].values()), "error_codes": loss["errors"],
            "sessions_failed": loss["sessions_failed"], "turns_spoken": loss["turns_spoken"],
            "turns_answered": loss["turns_answered"], "lost": loss["lost"]}


async def _bench(base: str, ns: tuple[int, ...], turns: int, status: Status) -> dict[str, Any]:
    status(f"probing {base}/realtime")
    greeting = await probe(base)
    pool = await asyncio.to_thread(sentences)
    status("one warm-up conversation of one turn (not measured)")
    warm = await _phase(base, pool, 1, 1)
    rows = []
    for n in ns:
        status(f"M={n}: {n} conversation(s) of {turns} turn(s) at real-time pace through {base}")
        row = await _phase(base, pool, n, turns)
        rows.append(row)
        short = _per_m(row)
        status(f"M={n}: turn latency p50 {short['turn_latency_ms']['p50']} / p95 {short['turn_latency_ms']['p95']} "
               f"ms; answered {short['turns_answered']}/{short['turns_spoken']}, errors {short['errors']}, "
               f"sessions failed {short['sessions_failed']}")
        await asyncio.sleep(CONNECT_LEAD_S)  # the phase's sessions unregister before the next phase counts
    return {"greeting": greeting, "warmup_lost": warm["loss"]["lost"], "rows": rows}


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    try:
        import openai
    except ImportError:
        raise UserError("runtime bench serve --url drives the official openai SDK: pip install openai (it is in "
                        "the dev extra)") from None
    base = base_url(args.url)
    ns = args.sessions or (QUICK_NS if args.quick else FULL_NS)
    turns = QUICK_TURNS if args.quick else FULL_TURNS
    started = time.perf_counter()
    measured = asyncio.run(_bench(base, ns, turns, status))
    rows, session = measured["rows"], measured["greeting"]["session"]
    per_m = {str(n): _per_m(row) for n, row in zip(ns, rows, strict=True)}
    return {
        "bench": "serve-url", "url": base, "quick": args.quick, "sessions": list(ns), "turns_per_session": turns,
        "client": f"openai {openai.__version__} (realtime.connect)", "chunk_ms": CHUNK_MS,
        "turn_detection": TURN_DETECTION, "turn_timeout_s": TURN_TIMEOUT_S,
        "probe": {"session_id": session.get("id"), "replica": measured["greeting"]["replica"]},
        "per_m": per_m,
        "errors": sum(m["errors"] for m in per_m.values()),
        "sessions_failed": sum(m["sessions_failed"] for m in per_m.values()),
        "lost": sum(m["lost"] for m in per_m.values()),
        "warmup_lost": measured["warmup_lost"],
        "rows": rows,
        "latency_definition": "receive time of the turn's first response.output_text.delta minus the send time of "
                              "the chunk holding the end of the sentence's speech",
        "wall_s": round(time.perf_counter() - started, 2),
        "machine": {"role": "the clients' machine, not the servers'", "cpu_count": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version()},
    }
