"""`runtime bench voice`'s voice-to-voice rows: spoken questions answered aloud by the real server, N conversations
at once, timed from the end of the user's speech to the first sound of the answer.

Why: the figure users compare voice agents by (OpenAI Realtime, Pipecat, LiveKit) is voice-to-voice latency, and
it is the sum of four parts that belong to different models, so each part is reported on its own:

    end of speech --(server VAD: 500 ms of silence)--> speech_stopped / committed       `turn_detection`
                  --(the final ASR pass)--> input_audio_transcription.completed          `final_transcript`
                  --(prefill, decode until the first clause is complete)--> first clause `first_clause`
                  --(synthesis of that clause, encoding, the websocket)--> first audio   `first_audio`

How: the server is `python -m runtime serve --profile P` in its own process (voice_server.py; `--profile`,
default: the default profile, the one `runtime profiles` marks `*`), with the voice. The clients are the official
`openai` SDK's realtime client (`AsyncOpenAI(websocket_base_url=...).realtime.connect`, typed `recv()`), as users run
it. Each session sends `session.update` with `output_modalities: ["audio"]` (24 kHz PCM), `max_output_tokens` 32 (an
answer of a sentence or two: the first sound does not depend on it, the time until the next question does) and server
VAD as the API's defaults (`silence_duration_ms` 500, `create_response`, `interrupt_response`), then puts the facts
(`FACTS`) into the conversation as a user text item, then asks spoken questions about them, one a turn (`QUESTIONS`,
conversation i starting at question i; voice_questions.py says how they are spoken).

Real-time pace, as a microphone: chunk k (100 ms) of a turn is sent when its last sample would have been spoken
(at the turn's start + (k + 1) x 100 ms), never before; a turn's "end of speech" is the wall time its last speech
sample (the last above 1e-3) is spoken on that clock: start + its offset. So the up-to-100 ms wait for the chunk that
holds it is part of the latency, as it is for any client that sends 100 ms chunks. After the speech the client goes
on sending silence, chunk after chunk, until the answer ends (`response.done`) or `TURN_TIMEOUT_S` has passed, then
speaks the next question: a polite user who waits for the whole answer (its audio is sent as fast as it is made, as
the API's).

The marks of a turn, each its first event after the end of speech (receive time, perf_counter), in ms after the end
of speech: `vad_silence` (not a receive time: where `speech_stopped`'s `audio_end_ms` says the silence began, on the
stream's clock), `stop_chunk_sent` (when the chunk that completed the rule's 500 ms of silence was sent: so
`speech_stopped - stop_chunk_sent` is the server's lag in reading it),
`speech_stopped`, `committed`, `transcript` (the final transcript), `response_created`,
`first_token` (the first `response.output_audio_transcript.delta`: the model's first words), `first_clause` (the
transcript delta with which the client's own `ClauseSplitter`, the server's rules, completes the first clause: when
the voice could start), `first_audio` (the first `response.output_audio.delta`: voice-to-voice). `stages_ms` are the
differences named at the top (turn detection: end -> committed; final transcript: committed -> transcript;
first clause: transcript -> first clause; first audio: first clause -> first audio), p50/p95 each; a stage whose
later mark came before its earlier one (an answer that started before the transcript was final) is negative.
`stall_ms`: the silences inside an answer for a client that plays each audio delta at real time from the first one
(its buffer ran dry waiting for the next clause's audio), per turn: what cutting the first clause early may cost.

Reported per N (1, 2, 4 conversations of 5 questions; quick: 1 of 2 questions, 2 of 1): `voice_to_voice_ms` (p50, p95,
n), `marks_ms`, `stages_ms`, the turns
answered with sound, the answers (what was asked, what the server heard, what it said, whether the expected words are
in it: a 135M model's answers are often wrong, and a wrong answer is timed like a right one). One unmeasured turn
warms the server first. Clients and server share the machine's cores: on 2 cores N = 4 also measures the clients.

Memory: `rss_mb_peak` per N, the server process's largest RSS read from its `/healthz` every 0.5 s during the phase
(voice_server.py's `PeakRss`; `rss_mb_idle`: after the warm-up, no session open): what a host needs for every model
of the profile (the language model, the ASR with its final pass, turn detection, the screen reader, the voice) and N
conversations. The language model's own share, a session of it alone, is `runtime bench llm --model REF`'s `memory` row.
`target_rss_mb_per_extra_conversation` (the growth from the first phase's peak to the last's, per conversation
added) shows the sessions sharing one copy of the weights: a second copy of the 1.5B would add about 1,100 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.bench.timing import at_most, percentiles_ms
from runtime.bench.voice_questions import CHUNK_S, FACTS, QUESTIONS, RATE, SILENCE, Question, question
from runtime.bench.voice_server import PeakRss, VoiceServer
from runtime.errors import UserError

Status = Callable[[str], None]
TURN_TIMEOUT_S = 30.0
CONNECT_LEAD_S = 0.5
DRAIN_TIMEOUT_S = 30.0
# (conversations at once, questions each): quick keeps both rows within its budget with the 1.5B answering
QUICK_PHASES, FULL_PHASES = ((1, 2), (2, 1)), ((1, 5), (2, 5), (4, 5))
TARGET_P50_S = 1.2
# what one more conversation may add: its caches and buffers, not a second copy of the weights (the 1.5B's alone are
# about 1,100 MB in the default's native format)
TARGET_EXTRA_RSS_MB = 300.0
SILENCE_MS = 500  # the API's default
TURN_DETECTION = {"type": "server_vad", "silence_duration_ms": SILENCE_MS, "create_response": True,
                  "interrupt_response": True}
MAX_OUTPUT_TOKENS = 32  # a spoken answer of a sentence or two; bounds how long a polite user waits for the next turn
SESSION = {"type": "realtime", "output_modalities": ["audio"], "max_output_tokens": MAX_OUTPUT_TOKENS,
           "audio": {"input": {"turn_detection": TURN_DETECTION},
                     "output": {"format": {"type": "audio/pcm", "rate": RATE}}}}
MARKS = {"speech_stopped": "input_audio_buffer.speech_stopped", "committed": "input_audio_buffer.committed",
         "transcript": "conversation.item.input_audio_transcription.completed",
         "response_created": "response.created", "first_token": "response.output_audio_transcript.delta",
         "first_audio": "response.output_audio.delta"}
STAGES = (("turn_detection", None, "committed"), ("final_transcript", "committed", "transcript"),
          ("first_clause", "transcript", "first_clause"), ("first_audio", "first_clause", "first_audio"))


@dataclass
class Turn:
    question: Question
    speech_end: float  # wall time (perf_counter) of the last speech sample
    marks: dict[str, float] = field(default_factory=dict)  # seconds after speech_end
    heard: str = ""
    answer: str = ""
    status: str | None = None
    audio: list[tuple[float, float]] = field(default_factory=list)  # (receive time, seconds) of each audio delta

    def stall_s(self) -> float:
        """Silence inside the answer for a client that plays each delta at real time from the first: the time its
        buffer ran dry waiting for the next one (a clause whose synthesis came after the last one had played)."""
        stall, playing_until = 0.0, None
        for at, seconds in self.audio:
            if playing_until is not None and at > playing_until:
                stall += at - playing_until
            playing_until = max(playing_until or at, at) + seconds
        return stall


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


def first_clause_done(parts: list[str]) -> bool:
    from runtime.models.tts.clauses import ClauseSplitter

    splitter = ClauseSplitter()
    return any(splitter.push(p) for p in parts)


async def converse(base_url: str, script: list[Question], start: float, conv: Conversation) -> None:
    """One SDK session asking `script`, a question a turn; a failure is recorded in `conv.error`, not raised."""
    from openai import AsyncOpenAI
    from websockets.exceptions import ConnectionClosedOK

    current: list[Turn | None] = [None]
    silence_s = SILENCE_MS / 1000
    answered = asyncio.Event()
    parts: list[str] = []

    def mark(turn: Turn, name: str, at: float) -> None:
        turn.marks.setdefault(name, at - turn.speech_end)

    try:
        client = AsyncOpenAI(api_key="unused", websocket_base_url=base_url)
        async with client.realtime.connect(model="runtime") as connection:
            async def read() -> None:
                with contextlib.suppress(ConnectionClosedOK):
                    while True:
                        event = await connection.recv()
                        at, kind, turn = time.perf_counter(), str(getattr(event, "type", "")), current[0]
                        if turn is None or at < turn.speech_end:
                            continue
                        for name, wanted in MARKS.items():
                            if kind == wanted:
                                mark(turn, name, at)
                        if kind == MARKS["speech_stopped"] and "vad_silence" not in turn.marks:
                            # where the VAD says the silence began, on the stream's clock (media m at start + m),
                            # and when the chunk that completed the rule's silence was sent
                            silence = getattr(event, "audio_end_ms", 0) / 1000
                            done = math.ceil(round((silence + silence_s) / CHUNK_S, 6)) * CHUNK_S
                            turn.marks["vad_silence"] = start + silence - turn.speech_end
                            turn.marks["stop_chunk_sent"] = start + done - turn.speech_end
                        if kind == MARKS["transcript"]:
                            turn.heard = str(getattr(event, "transcript", ""))
                        elif kind == MARKS["first_token"]:
                            parts.append(str(getattr(event, "delta", "")))
                            if "first_clause" not in turn.marks and first_clause_done(parts):
                                mark(turn, "first_clause", at)
                        elif kind == MARKS["first_audio"]:
                            turn.audio.append((at, len(base64.b64decode(getattr(event, "delta", ""))) / 2 / RATE))
                        elif kind == "response.done":
                            turn.status = str(getattr(getattr(event, "response", None), "status", ""))
                            turn.answer = "".join(parts)
                            answered.set()

            reader = asyncio.create_task(read())
            try:
                await connection.session.update(session=SESSION)  # type: ignore[arg-type]
                await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": FACTS}]})
                k = 0
                for q in script:
                    turn_start = start + k * CHUNK_S
                    turn = Turn(q, turn_start + q.speech_end_s)
                    parts.clear()
                    answered.clear()
                    current[0] = turn
                    conv.turns.append(turn)
                    for chunk in q.chunks:
                        k = await _send(connection, chunk, start, k)
                    while not answered.is_set() and time.perf_counter() - turn.speech_end < TURN_TIMEOUT_S:
                        if reader.done():
                            raise RuntimeError("the connection closed mid-turn")
                        k = await _send(connection, SILENCE, start, k)
                await connection.send({"type": "runtime.session.finish"})  # type: ignore[arg-type]
                await asyncio.wait_for(asyncio.shield(reader), DRAIN_TIMEOUT_S)
            finally:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
    except Exception as err:  # noqa: BLE001 - one failed session is a count, not the end of the bench
        conv.error = f"{type(err).__name__}: {err}"


async def _send(connection: Any, chunk: str, start: float, k: int) -> int:  # noqa: ANN401 - the SDK's connection
    """Chunk k leaves when its last sample would have been spoken: start + (k + 1) x 100 ms."""
    if (wait := start + (k + 1) * CHUNK_S - time.perf_counter()) > 0:
        await asyncio.sleep(wait)
    await connection.input_audio_buffer.append(audio=chunk)
    return k + 1


def _stats(values: list[float]) -> dict[str, Any]:
    return {**percentiles_ms(values), "n": len(values)}


def summarize(convs: list[Conversation]) -> dict[str, Any]:
    turns = [t for c in convs for t in c.turns]
    done = [t for t in turns if "first_audio" in t.marks]
    out: dict[str, Any] = {"turns": len(turns), "turns_with_audio": len(done),
                           "voice_to_voice_ms": _stats([t.marks["first_audio"] for t in done])}
    out["marks_ms"] = {name: _stats([t.marks[name] for t in done if name in t.marks])
                       for name in ("vad_silence", "stop_chunk_sent", "speech_stopped", "committed", "transcript",
                                    "response_created", "first_token", "first_clause", "first_audio")}
    out["stages_ms"] = {name: _stats([t.marks[b] - (t.marks[a] if a else 0.0) for t in done
                                      if b in t.marks and (a is None or a in t.marks)])
                        for name, a, b in STAGES}
    out["stall_ms"] = {**_stats([t.stall_s() for t in done]),
                       "turns_with_stall": sum(t.stall_s() > 0 for t in done)}
    out["answers"] = [{"asked": t.question.text, "heard": t.heard, "answer": t.answer, "status": t.status,
                       "right": any(w in t.answer.lower() for w in t.question.expect)} for t in turns]
    out["answers_right"] = sum(a["right"] for a in out["answers"])
    errors = [c.error for c in convs if c.error]
    if errors:
        out["errors"] = errors
    return out


def start_server(profile: str, quick: bool, overrides: list[str] | None = None,
                 trace: Path | None = None) -> VoiceServer:
    """The server for `run`, started now: it loads while the caller does other work; with `trace`, it records its
    worker's jobs there (`runtime serve --trace-jobs`)."""
    phases = QUICK_PHASES if quick else FULL_PHASES
    return VoiceServer(profile, max(n for n, _ in phases) + 1, overrides or [], trace)


async def _phase(base_url: str, pool: list[Question], n: int, turns: int) -> list[Conversation]:
    convs = [Conversation() for _ in range(n)]
    start = time.perf_counter() + CONNECT_LEAD_S + 0.05 * n
    await asyncio.gather(*(converse(base_url, [pool[(i + t) % len(pool)] for t in range(turns)],
                                    start + i * CHUNK_S / n, conv) for i, conv in enumerate(convs)))
    return convs


async def _bench(server: VoiceServer, phases: tuple[tuple[int, int], ...], status: Status) -> dict[str, Any]:
    pool = [question(text, expect) for text, expect in QUESTIONS]
    base_url = f"ws://127.0.0.1:{server.port}/v1"
    try:
        status(f"voice-to-voice: waiting for the server: {' '.join(server.cmd[1:])}")
        await server.wait_ready()
        status(f"voice-to-voice: server up {time.perf_counter() - server.started:.1f} s after its start; one "
               "warm-up turn")
        warm = summarize(await _phase(base_url, pool, 1, 1))
        if warm["turns_with_audio"] == 0:
            raise UserError(f"the warm-up turn got no audio ({warm.get('errors') or warm['answers']}); the server's "
                            f"stderr ends:\n{server.log.read_text(errors='replace')[-1500:]}")
        idle_rss = (await server.wait_idle())["rss_mb"]
        rows = []
        for n, turns in phases:
            status(f"voice-to-voice: N={n}: {n} conversation(s) of {turns} spoken question(s) at real-time pace "
                   f"(load average {os.getloadavg()[0]:.2f})")
            row: dict[str, Any] = {"n": n, "load_avg_1m": round(os.getloadavg()[0], 2)}
            async with PeakRss(server) as peak:
                row.update(summarize(await _phase(base_url, pool, n, turns)))
            row["rss_mb_peak"] = peak.mb
            rows.append(row)
            v = row["voice_to_voice_ms"]
            status(f"voice-to-voice: N={n}: p50 {v['p50']:.0f} / p95 {v['p95']:.0f} ms over {v['n']} turn(s); "
                   f"stages p50 " + ", ".join(f"{k} {s['p50']:.0f}" for k, s in row["stages_ms"].items())
                   + f"; server RSS peak {peak.mb:.0f} MB")
            await server.wait_idle()
        return {"rows": rows, "rss_mb_idle": idle_rss}
    finally:
        server.stop()


def run(args: argparse.Namespace, status: Status, profile: str, server: VoiceServer | None = None) -> dict[str, Any]:
    """The rows of the module docstring for `profile` (a name or .toml path), on `server` if it was started ahead
    (`start_server`; stopped here either way)."""
    try:
        import openai
    except ImportError:
        raise UserError("voice-to-voice latency drives the official openai SDK: pip install openai (the dev "
                        "extra)") from None
    from runtime.profile_files import load_profile

    loaded = load_profile(profile)
    quick = bool(getattr(args, "quick", False))
    phases = QUICK_PHASES if quick else FULL_PHASES
    server = server or start_server(profile, quick)
    measured = asyncio.run(_bench(server, phases, status))
    rows = measured["rows"]
    p50 = rows[0]["voice_to_voice_ms"]["p50"] / 1000 if rows and rows[0]["voice_to_voice_ms"]["n"] else None
    first, last = rows[0], rows[-1]
    extra = (round((last["rss_mb_peak"] - first["rss_mb_peak"]) / (last["n"] - first["n"]), 1)
             if last["n"] > first["n"] else None)
    return {"profile": loaded.name, "lm": loaded.lm.model, "asr": loaded.asr.model, "client": f"openai "
            f"{openai.__version__} (realtime.connect)", "turn_detection": TURN_DETECTION, "chunk_ms": 100,
            "facts": FACTS, "phases": [{"n": n, "questions_each": t} for n, t in phases], "rows": rows,
            "target_p50_s_at_1": at_most(None if p50 is None else round(p50, 3), TARGET_P50_S),
            "rss_mb_idle": measured["rss_mb_idle"],
            "target_rss_mb_per_extra_conversation": at_most(extra, TARGET_EXTRA_RSS_MB),
            "definition": "receive time of the turn's first response.output_audio.delta minus the wall time its "
                          "question's last speech sample was spoken (chunks sent at real-time pace, each when its "
                          "last sample would have been recorded)"}
