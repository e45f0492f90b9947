"""`runtime bench serve --conversations`: N concurrent voice conversations, each of several turns with server VAD.

Why: `bench serve` streams a talk nobody answers; a voice agent is used in turns: the user speaks, pauses, the
server decides the turn is over (server VAD), commits it, transcribes it and answers, and the user speaks
again once the answer is in. What a user feels there is the gap between the end of their sentence and the
first word of the answer, and what must never happen is a turn that is silently dropped: a committed item
without its transcript, a response without its end, a sentence never answered. This measures the one and
counts the other, with several conversations on one server at once and after clients vanish mid-turn.

How: the server runs as its own process (`python -m runtime serve --profile tiny --port P`, `bench serve`'s
`_Server`). The clients are the official `openai` SDK (`AsyncOpenAI(websocket_base_url=...).realtime.connect`,
events read with its typed `recv()`), as users run it. Each session sends `session.update` with `turn_detection:
{type: server_vad, create_response: true, interrupt_response: true}` (the defaults: speech ends after 500 ms below
the VAD's threshold), then holds T turns (full: 5, quick: 2). A turn is one spoken sentence of the shipped demo
speech (`demo_speech()`, espeak-ng, 16 kHz): the speech is cut into its four sentences at its pauses, found as runs
of at least 250 ms whose 20 ms RMS stays under 1e-3 (the cut is the middle of the pause, so each later sentence
starts with about 0.2 s of quiet); Silero VAD's probabilities agree: they fall below 0.35 (the server's
end-of-speech level) within 100 ms of each found speech end and stay there, and within a sentence they dip below it
for at most two 32 ms windows, far shorter than the 500 ms that end a turn
(`tests/test_bench_serve_conversations.py` checks both; demo_sentences.py cuts them). Each clip is zero-padded to
whole 100 ms chunks, resampled to the API's 24 kHz PCM16 by linear interpolation (plenty for a VAD and an ASR on
random weights) and base64-encoded once, up front. Session i, turn t speaks sentence (i + t) mod 4. After the
sentence the client keeps sending silence (digital zeros), chunk after chunk, until the turn's answer ends (a
`response.done` not `cancelled`, received after the end of the speech) or `TURN_TIMEOUT_S` has passed since the end
of the speech (a miss), then starts the next sentence: a polite user. Every chunk is 100 ms and leaves on a schedule
from the phase's common start (chunk k at start + k * 100 ms, counted across turns and silence alike), not after
fixed sleeps, so send jitter does not accumulate; session i's schedule is offset by i/N of a chunk, as independent
users' would be. The wall time (perf_counter) just before each chunk is handed to the SDK is recorded. After its
last turn a session sends `runtime.session.finish` and reads until the server closes with 1000, so every event it
will ever get is counted. The server commits the trailing silence at finish as one more user item (no response); the
loss checks count it like any other item. One unmeasured one-turn session warms the server first. N runs through (1,
2, 4) (quick: 1, 2), one phase after another.

Reported per N (`rows`), over every turn of every session of the phase; the "end of speech" of a turn is the
wall time its chunk holding the sentence's last speech sample was sent (the speech ends somewhere inside
that 100 ms chunk; the server cannot know of it before the chunk arrives):
- `turn_latency_ms` (p50 = median, p95, max, n): receive time of the turn's first
  `response.output_text.delta` minus its end of speech. This is what the user waits for: it holds the
  server VAD's 500 ms of silence, the chunk's transport, the final transcription, the response's prefill and
  first token.
- `speech_stopped_ms`: receive time of the turn's first `input_audio_buffer.speech_stopped` minus the end of
  speech (the VAD's part: at least its 500 ms of silence).
- `response_created_ms`: receive time of the turn's first `response.created` minus the end of speech.
- `answer_after_stop_ms`: receive time of the turn's first text delta minus that of its `speech_stopped`: the
  server's own part after the VAD (commit, final transcript, prefill, first token), free of the chunk steps
  below, so the number that shows load.
  A turn's events are those received from its end of speech until the first chunk of the next turn was sent
  (the last turn: until the session closed).
- `loss` (counts over the phase's sessions): `turns_spoken`, `turns_answered` (a response created within the
  turn ended with `response.done` of status `completed` or `incomplete`: the tiny model's random weights
  never stop by themselves, so their answers end at the profile's 24 tokens, `incomplete`), `missed`
  (spoken - answered), `turns_without_text` (answered with no text delta: no latency for them),
  `extra_responses` (more than one response created within a turn: the VAD split a sentence),
  `committed` (user items committed, the finish's included), `transcripts_not_once` and
  `items_done_not_once` (committed items without exactly one
  `conversation.item.input_audio_transcription.completed`, resp. one user `conversation.item.done`, for
  their id), `responses_created`, `responses_not_done_once` (created responses without exactly one
  `response.done` for their id, plus `response.done`s for ids never created), `responses_cancelled`,
  `errors` (server `error` events, by code), `sessions_failed` (a session whose connection did not end with
  the server's 1000 after finish, or which raised), and `lost` (the sum of the not-once counts, the misses and
  the failed sessions: 0 is the only good value).
- `max_send_late_ms`: how far behind its schedule the worst chunk send of the phase was (the clients' side);
  `sessions`: each session's turns, answered turns, `lost` and `late_ms`; `sessions_left_after`: the
  server's session count once the phase's sessions are gone (0 expected).

At the top: `turns_answered_equals_spoken` (every row), `lost` (the rows' and the sequential session's),
`sessions_left_at_end` (after everything), `sentences` (where each clip starts and its speech ends in the demo
speech, its chunks, its end-of-speech chunk), `machine`.

`faults`: F abrupt disconnects (full: 100, quick: 10) at 10x real time (serve_disconnects.py says how, and what
it reports), then `server_alive`, and `after_disconnects_ok`: a fresh SDK session holds one full turn at real-time
pace with nothing lost and no error event (`after_disconnects_turn_latency_ms`: its turn latency). `sequential`:
one SDK session then holds L turns one after another (full: 100, quick: 10), at 10x real time (same schedule
rule, 10 ms per 100 ms chunk; each turn still waits for its answer), with the same loss counts; its latencies
are not reported (media time runs 10x faster than wall time).

Caveats: the VAD can only decide when a chunk arrives, so `speech_stopped_ms` (and with it the turn latency)
comes in steps of the 100 ms chunk: a turn reads about 600 or about 700 ms depending on where the speech end and
the VAD's 32 ms windows fall within the chunks, which shifts from turn to turn with the stream's history (the
silence before it). A p50 or p95 moving by about 100 ms between rows is that mix, not load; compare
`answer_after_stop_ms` for load. Clients and server share the machine's cores (on a small machine a large N also
measures the clients' own loop; receive times are taken when the SDK yields an event). Weights are random:
transcripts and answers are noise, answers never end early, and only timing and the loss counts are real. The
pauses are digital silence, which the VAD finds quickly; a real microphone's noise floor would change nothing in
the server's 500 ms rule but may move where the VAD's probability falls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.bench.demo_sentences import CHUNK_MS, CHUNK_S, RATE, SILENCE, Sentence, sentences
from runtime.bench.serve import PROFILE, _Server
from runtime.bench.serve_disconnects import CONCURRENCY, IDLE_TIMEOUT_S, disconnects
from runtime.bench.timing import machine
from runtime.bench.turn_accounting import Account, Ev, TurnMarks, account, lost, stats_ms, summarize
from runtime.errors import UserError
from runtime.profile_files import load_profile

Status = Callable[[str], None]
QUICK_NS, FULL_NS = (1, 2), (1, 2, 4)
QUICK_TURNS, FULL_TURNS = 2, 5
QUICK_FAULTS, FULL_FAULTS = 10, 100
QUICK_SEQUENTIAL, FULL_SEQUENTIAL = 10, 100
TURN_TIMEOUT_S = 20.0  # from the end of speech to the answer's end; past it the turn is a miss
FAST = 10.0  # the pace of the disconnecting sessions and the sequential session, in multiples of real time
CONNECT_LEAD_S = 0.5  # time for every client of a phase to connect before the first chunk
DRAIN_TIMEOUT_S = 30.0
TURN_DETECTION = {"type": "server_vad", "create_response": True, "interrupt_response": True}
SESSION = {"type": "realtime", "audio": {"input": {"turn_detection": TURN_DETECTION}}}  # every session's update


# --- one conversation through the openai SDK -----------------------------------------------------------------

def _reduce(event: object, at: float) -> Ev:
    """The SDK's typed event (a `runtime.` one is its first union member, `type` kept) as an `Ev`."""
    kind = str(getattr(event, "type", "?"))
    item = getattr(event, "item", None)
    response = getattr(event, "response", None)
    item_id = getattr(item, "id", None) if kind == "conversation.item.done" else getattr(event, "item_id", None)
    response_id = getattr(response, "id", None) if response is not None else getattr(event, "response_id", None)
    return Ev(at, kind, item_id=item_id, response_id=response_id, status=getattr(response, "status", None),
              role=getattr(item, "role", None), code=getattr(getattr(event, "error", None), "code", None))


@dataclass
class Conversation:
    turns: list[TurnMarks] = field(default_factory=list)
    events: list[Ev] = field(default_factory=list)
    late_s: float = 0.0
    closed_ok: bool = False
    error: str | None = None

    def account(self) -> Account:
        return account(self.turns, self.events, failed=not self.closed_ok or self.error is not None)


async def converse(base_url: str, script: list[Sentence], start: float, conv: Conversation, speed: float = 1.0
                   ) -> None:
    """One SDK session speaking `script`, a sentence a turn, each followed by silence until its answer ends; a
    failure (even to connect) is recorded in `conv.error`, not raised: one failed session is a count."""
    try:
        await _converse(base_url, script, start, conv, speed)
    except Exception as err:  # noqa: BLE001
        conv.error = conv.error or f"{type(err).__name__}: {err}"


async def _converse(base_url: str, script: list[Sentence], start: float, conv: Conversation, speed: float) -> None:
    from openai import AsyncOpenAI
    from websockets.exceptions import ConnectionClosedOK

    interval = CHUNK_S / speed
    answered = asyncio.Event()
    waiting_since = [float("inf")]  # the current turn's end of speech: an answer's end counts after it

    client = AsyncOpenAI(api_key="unused", websocket_base_url=base_url)
    async with client.realtime.connect(model="runtime") as connection:
        async def read() -> None:
            try:
                while True:
                    event = await connection.recv()
                    ev = _reduce(event, time.perf_counter())
                    conv.events.append(ev)
                    if ev.type == "response.done" and ev.status != "cancelled" and ev.at >= waiting_since[0]:
                        answered.set()
            except ConnectionClosedOK:
                conv.closed_ok = True

        reader = asyncio.create_task(read())
        try:
            await connection.session.update(session=SESSION)
            k = 0

            async def send(chunk: str) -> float:
                nonlocal k
                due = start + k * interval
                if (wait := due - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                sent = time.perf_counter()
                conv.late_s = max(conv.late_s, sent - due)
                k += 1
                await connection.input_audio_buffer.append(audio=chunk)
                return sent

            for number, sentence in enumerate(script):
                answered.clear()
                waiting_since[0] = float("inf")
                first = end = 0.0
                for j, chunk in enumerate(sentence.chunks):
                    sent = await send(chunk)
                    if j == 0:
                        first = sent
                    if j == sentence.speech_end_chunk:
                        end = waiting_since[0] = sent
                turn = TurnMarks(number, first, end)
                conv.turns.append(turn)
                while not answered.is_set() and time.perf_counter() - end < TURN_TIMEOUT_S and not reader.done():
                    await send(SILENCE)
                turn.timed_out = not answered.is_set()
            await connection.send({"type": "runtime.session.finish"})  # type: ignore[arg-type]
            await asyncio.wait_for(asyncio.shield(reader), DRAIN_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - reported, not raised
            conv.error = f"{type(err).__name__}: {err}"
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
    if reader.done() and not reader.cancelled() and (err := reader.exception()) is not None and not conv.error:
        conv.error = f"{type(err).__name__}: {err}"


def _script(pool: list[Sentence], first: int, turns: int) -> list[Sentence]:
    return [pool[(first + t) % len(pool)] for t in range(turns)]


# --- the phases ----------------------------------------------------------------------------------------------

async def _phase(base_url: str, pool: list[Sentence], n: int, turns: int) -> dict[str, Any]:
    convs = [Conversation() for _ in range(n)]
    start = time.perf_counter() + CONNECT_LEAD_S + 0.05 * n
    await asyncio.gather(*(converse(base_url, _script(pool, i, turns), start + i * CHUNK_S / n, conv)
                           for i, conv in enumerate(convs)))
    accounts = [conv.account() for conv in convs]
    row = {"n": n, **summarize(accounts),
           "max_send_late_ms": round(max(c.late_s for c in convs) * 1000, 2),
           "sessions": [{"turns": a.counts["turns_spoken"], "answered": a.counts["turns_answered"],
                         "lost": lost(a.counts), "late_ms": round(c.late_s * 1000, 2),
                         **({"error": c.error} if c.error else {})} for a, c in zip(accounts, convs, strict=True)]}
    return row


# --- the whole bench ------------------------------------------------------------------------------------------

async def _bench(args: argparse.Namespace, status: Status, ns: tuple[int, ...], turns: int, faults: int,
                 sequential: int, log_dir: Path) -> dict[str, Any]:
    pool = await asyncio.to_thread(sentences)
    server = _Server(args, max(ns) + 2 * CONCURRENCY, log_dir)
    base_url = f"ws://127.0.0.1:{server.port}/v1"
    try:
        status(f"starting the server: {' '.join(server.cmd[1:])}")
        started = time.perf_counter()
        await server.wait_ready()
        status(f"server up in {time.perf_counter() - started:.1f} s; one warm-up turn")
        await _phase(base_url, pool, 1, 1)
        await server.wait_idle(IDLE_TIMEOUT_S)
        rows = []
        for n in ns:
            status(f"N={n}: {n} conversation(s) of {turns} turn(s) at real-time pace")
            row = await _phase(base_url, pool, n, turns)
            row["sessions_left_after"] = (await server.wait_idle(IDLE_TIMEOUT_S))["sessions"]
            rows.append(row)
            status(f"N={n}: turn latency p50 {row['turn_latency_ms']['p50']} / p95 {row['turn_latency_ms']['p95']} "
                   f"ms; answered {row['loss']['turns_answered']}/{row['loss']['turns_spoken']}, "
                   f"lost {row['loss']['lost']}")
        status(f"{faults} abrupt disconnects, {CONCURRENCY} at a time")
        fault = await disconnects(server, SESSION, pool, faults, FAST)
        fault["server_alive"] = server.proc.poll() is None
        after = Conversation()
        await converse(base_url, _script(pool, 0, 1), time.perf_counter() + CONNECT_LEAD_S, after)
        after_acc = after.account()
        fault["after_disconnects_ok"] = (after_acc.counts["turns_answered"] == 1 and lost(after_acc.counts) == 0
                                         and not after_acc.errors)
        fault["after_disconnects_turn_latency_ms"] = stats_ms(after_acc.first_delta)["p50"]
        status(f"disconnects: {fault['sessions_left']} session(s) left, a fresh turn after them: "
               f"{'ok' if fault['after_disconnects_ok'] else 'FAILED'}; {sequential} turns on one session")
        long = Conversation()
        started = time.perf_counter()
        await converse(base_url, _script(pool, 0, sequential), started + CONNECT_LEAD_S, long, speed=FAST)
        long_acc = summarize([long.account()])["loss"]
        sequential_out = {"turns": sequential, "speed": FAST, "wall_s": round(time.perf_counter() - started, 2),
                          **long_acc, **({"error": long.error} if long.error else {})}
        return {"rows": rows, "faults": fault, "sequential": sequential_out,
                "sessions_left_at_end": (await server.wait_idle(IDLE_TIMEOUT_S))["sessions"]}
    finally:
        server.stop()


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    try:
        import openai
    except ImportError:
        raise UserError("runtime bench serve --conversations drives the official openai SDK: "
                        "pip install openai (it is in the dev extra)") from None
    ns = QUICK_NS if args.quick else FULL_NS
    turns = QUICK_TURNS if args.quick else FULL_TURNS
    faults = QUICK_FAULTS if args.quick else FULL_FAULTS
    sequential = QUICK_SEQUENTIAL if args.quick else FULL_SEQUENTIAL
    profile = load_profile(PROFILE, device=args.device, dtype=args.dtype)
    with tempfile.TemporaryDirectory(prefix="runtime-bench-conversations-") as tmp:
        measured = asyncio.run(_bench(args, status, ns, turns, faults, sequential, Path(tmp)))
    rows = measured["rows"]
    pool = sentences()
    out: dict[str, Any] = {
        "bench": "serve-conversations", "quick": args.quick, "profile": PROFILE,
        "transport": "websocket over loopback", "client": f"openai {openai.__version__} (realtime.connect)",
        "input_format": {"type": "audio/pcm", "rate": RATE}, "chunk_ms": CHUNK_MS,
        "turn_detection": TURN_DETECTION, "n_sessions": list(ns), "turns_per_session": turns,
        "turn_timeout_s": TURN_TIMEOUT_S,
        "sentences": [{"start_s": round(s.start_s, 3), "speech_end_s": round(s.speech_end_s, 3),
                       "chunks": len(s.chunks), "speech_end_chunk": s.speech_end_chunk} for s in pool],
        "rows": rows,
        "turns_answered_equals_spoken": all(r["loss"]["turns_answered"] == r["loss"]["turns_spoken"] for r in rows),
        "lost": sum(r["loss"]["lost"] for r in rows) + measured["sequential"]["lost"],
        "faults": measured["faults"], "sequential": measured["sequential"],
        "sessions_left_at_end": measured["sessions_left_at_end"],
        "latency_definition": "receive time of the turn's first response.output_text.delta (speech_stopped, "
                              "response.created) minus the send time of the chunk holding the end of the "
                              "sentence's speech",
        "random_weights": True,
        "note": "random weights: transcripts and answers are noise; only timing and the loss counts are real",
    }
    threads = args.threads or profile.threads or max(1, (os.cpu_count() or 1) - 1)
    out["machine"] = {**machine(profile.device, profile.dtype, threads),
                      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count()}
    return out
