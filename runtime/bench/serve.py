"""`runtime bench serve`: the websocket server under N concurrent SDK clients streaming at real-time pace.

Why: the other benchmarks time one model call at a time; a server shares one event loop and one device worker
between every session, so what a user feels (caption delay, stutter) and what a host pays (memory per session)
only show with many live sessions at once. This measures that on the `tiny` profile over loopback.

How: the server runs as its own process (`python -m runtime serve --profile tiny --port P`), so the loop lag
and RSS it reports on `/healthz` are the server's alone, not the clients'. One short unmeasured warm-up session
runs first (first-call allocations and kernel set-up are not any session's cost). Then, for each N (1, 4, 16;
quick: 1, 4), N `AsyncRealtimeClient`s connect, and each streams the demo speech (looped) in chunks of the
profile's `pipeline.audio_chunk_ms`, plus one JPEG frame (pre-encoded, 320x180) per second of media, for D
seconds (quick: 8, full: 20). Sends follow a schedule from a common start time (chunk k at start + k * chunk),
not fixed sleeps, so send jitter does not accumulate; client i's schedule is offset by i/N of a chunk, as
independent clients' would be, rather than every chunk of every client landing at the same instant. The wall
time (perf_counter) just before each chunk is handed to the socket is recorded. No questions are asked.

- `event_latency_ms` (p50/p95/p99 per N, over every transcript event of every session): receive time of a
  transcript event (`...transcription.delta` or `.completed`) minus the send time of the chunk that made it
  possible. The tiny causal Whisper decodes in blocks of `asr.chunk_ms` (300 ms) and emits a block ending at
  media time E once it holds the audio up to E + 10 ms (its last hop plus the conv's look-ahead), with E in
  the event's `end`. So the chunk charged is the first chunk whose end >= `end` + 10 ms (in samples): the one
  carrying the last sample the ASR needed. Only events received before the commit count: the commit's final
  `completed` event is caused by the commit, not by a chunk.
- `loop_lag_ms` (per N): p99 and max of the server's own event-loop lag from `GET /healthz?window=D`, read
  as the last chunk of the phase has been sent (the window covers the streaming, not the setup).
- `rss_mb_per_session` (per N): (server RSS with the N sessions live, read at the same moment) minus (idle
  server RSS after the warm-up session closed), divided by N. glibc keeps freed pages cached, so a later
  phase reuses an earlier phase's pages, and glibc may also hand pages back between readings: it is a noisy
  estimate, not an exact cost, and on short phases (a few seconds) it can read zero or below.
- `keeps_up` / `sessions_kept_realtime`: a session keeps up with real time when, 1 s (`GRACE_S`) after its
  last chunk was sent, its transcript events cover media to within one ASR block plus one chunk of what it
  sent (`behind_ms` <= asr.chunk_ms + audio_chunk_ms: perfectly on time it is up to one block behind, since
  text only comes per block), and its own p95 event latency is at most `KEEPUP_P95_MS` (1 s, a caption
  delay a viewer still reads as live). `sessions_kept_realtime` is the largest N at which every session
  keeps up (0 if none); `keeps_up` holds, per N, the verdict and each session's numbers that decided it.
- `targets` (issue #6, section 8, judged on 2 CPU cores): at N = 4, p95 `event_latency_ms` <= chunk + 100 ms
  and `loop_lag_ms` p99 <= 20 ms, each as {value, target, met}.

Caveats: the clients run in this process on the same cores as the server, so on a small machine a large N
also measures the clients' own loop (receive times are taken when the SDK yields an event). Weights are random
(`random_weights: true`): the transcript is noise, and how much text the model emits per block (hence the
number of events) is too; only timing and memory are real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.bench.timing import at_most, machine
from runtime.chunks import SAMPLE_RATE
from runtime.client import AsyncRealtimeClient, encode_jpeg
from runtime.errors import UserError
from runtime.events import TranscriptionCompleted, TranscriptionDelta
from runtime.io.sample import demo_speech, render_frame
from runtime.profile_files import load_profile

Status = Callable[[str], None]
PROFILE = "tiny"
QUICK_NS, FULL_NS = (1, 4), (1, 4, 16)
QUICK_S, FULL_S = 8.0, 20.0
SECONDS_ENV = "RUNTIME_BENCH_SERVE_SECONDS"  # undocumented: shortens each phase (the test uses it)
LOOKAHEAD_SAMPLES = 160  # causal Whisper emits a block ending at E once it holds E + 10 ms of audio
GRACE_S = 1.0  # after the last chunk, how long a session has to deliver its last transcript events
KEEPUP_P95_MS = 1000.0
WARMUP_S = 2.0
STARTUP_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 30.0
FRAME_SIZE = (320, 180)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _Server:
    """`python -m runtime serve` in its own process; stderr goes to a file (its tail is shown if it fails)."""

    def __init__(self, args: argparse.Namespace, max_sessions: int, log_dir: Path) -> None:
        self.port = _free_port()
        self.log = log_dir / "server.stderr"
        cmd = [sys.executable, "-m", "runtime", "serve", "--profile", PROFILE, "--port", str(self.port),
               "--max-sessions", str(max_sessions), "--device", args.device]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        if args.threads:
            cmd += ["--set", f"threads={args.threads}"]
        self.cmd = cmd
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def health(self, window_s: float = 10.0) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.port}/healthz?window={window_s:g}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return dict(json.loads(r.read()))
        except OSError:
            if self.proc.poll() is not None:
                raise self._died() from None
            raise

    def _died(self) -> UserError:
        return UserError(f"the server exited with code {self.proc.returncode} ({' '.join(self.cmd)}); "
                         f"its stderr ends:\n{_tail(self.log)}")

    async def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise self._died()
            try:
                return await asyncio.to_thread(self.health, 1.0)
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"the server did not answer /healthz within {timeout_s:g} s "
                                f"({' '.join(self.cmd)}); its stderr ends:\n{_tail(self.log)}")
            await asyncio.sleep(0.25)

    async def wait_idle(self, timeout_s: float = 15.0) -> dict[str, Any]:
        """Until no session is left on the server (a finished session unregisters after its cleanup)."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = await asyncio.to_thread(self.health, 1.0)
            if health["sessions"] == 0 or time.monotonic() > deadline:
                return health
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: the server's own clean shutdown
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


@dataclass
class _Media:
    chunk_samples: int
    chunks: list[np.ndarray]
    frames: list[bytes]  # one JPEG per second of media, pre-encoded so the clients spend no CPU on it

    @classmethod
    def build(cls, seconds: float, chunk_ms: int) -> _Media:
        chunk = SAMPLE_RATE * chunk_ms // 1000
        n = int(round(seconds * 1000 / chunk_ms))
        speech = demo_speech()
        audio = np.tile(speech, -(-n * chunk // len(speech)))[: n * chunk]
        frames = [encode_jpeg(render_frame(float(t), *FRAME_SIZE)) for t in range(int(np.ceil(seconds)) + 1)]
        return cls(chunk, [audio[i * chunk : (i + 1) * chunk] for i in range(n)], frames)


@dataclass
class _Run:
    """One client's stream: when each chunk left, and each transcript event's media end and arrival."""

    sends: list[float] = field(default_factory=list)
    late_s: float = 0.0  # how far behind its schedule a send ever was (the client's side, not the server's)
    events: list[tuple[float, float]] = field(default_factory=list)  # (media end s, received perf_counter)
    sent_until_s: float = 0.0
    error: str | None = None

    def latencies(self, chunk_samples: int) -> list[float]:
        out = []
        for end, received in self.events:
            k = -(-(round(end * SAMPLE_RATE) + LOOKAHEAD_SAMPLES) // chunk_samples) - 1  # first chunk ending after
            if 0 <= k < len(self.sends):
                out.append(received - self.sends[k])
        return out


async def _session(url: str, media: _Media, start: float, offset_s: float, chunk_s: float, grace_until: float,
                   run: _Run) -> None:
    client = AsyncRealtimeClient(url)
    await client.connect()
    try:
        async def read() -> None:
            async for event in client.events():
                if isinstance(event, (TranscriptionDelta, TranscriptionCompleted)):
                    run.events.append((event.end, time.perf_counter()))

        reader = asyncio.create_task(read())
        for k, chunk in enumerate(media.chunks):
            due = start + offset_s + k * chunk_s
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            run.late_s = max(run.late_s, time.perf_counter() - due)
            if k * media.chunk_samples % SAMPLE_RATE == 0:  # a frame each whole second of media
                second = k * media.chunk_samples // SAMPLE_RATE
                await client.append_frame(media.frames[second], float(second))
            run.sends.append(time.perf_counter())
            await client.append_audio(chunk)
        run.sent_until_s = len(media.chunks) * media.chunk_samples / SAMPLE_RATE
        await asyncio.sleep(max(0.0, grace_until - time.perf_counter()))
        counted = len(run.events)
        await client.finish()  # the server drains the session and closes the connection with 1000
        try:
            await asyncio.wait_for(reader, DRAIN_TIMEOUT_S)
        except TimeoutError:
            run.error = f"no close within {DRAIN_TIMEOUT_S:g} s of commit"
        del run.events[counted:]  # the commit's own final event is not a chunk's
    finally:
        await client.close()


def _ms(seconds: list[float]) -> dict[str, Any]:
    if not seconds:
        return {"p50": None, "p95": None, "p99": None, "max": None, "events": 0}
    values = np.asarray(seconds) * 1000.0
    p50, p95, p99 = (round(float(np.percentile(values, q)), 2) for q in (50, 95, 99))
    return {"p50": p50, "p95": p95, "p99": p99, "max": round(float(values.max()), 2), "events": len(seconds)}


async def _phase(server: _Server, n: int, media: _Media, chunk_ms: int, block_ms: int, status: Status
                 ) -> dict[str, Any]:
    chunk_s = chunk_ms / 1000
    duration = len(media.chunks) * chunk_s
    runs = [_Run() for _ in range(n)]
    start = time.perf_counter() + 0.5 + 0.05 * n  # time for every client to connect before the first chunk
    grace_until = start + duration + GRACE_S  # every client's last chunk is sent by start + duration
    tasks = [asyncio.create_task(_session(server.url, media, start, i * chunk_s / n, chunk_s, grace_until, run))
             for i, run in enumerate(runs)]
    await asyncio.sleep(max(0.0, start + duration - time.perf_counter()))
    live = await asyncio.to_thread(server.health, duration)  # sessions live, streaming just over
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for run, result in zip(runs, results, strict=True):
        if isinstance(result, BaseException):
            run.error = f"{type(result).__name__}: {result}"
    idle = await server.wait_idle()
    if idle["sessions"]:
        status(f"N={n}: {idle['sessions']} session(s) still open on the server after the phase")
    allowed_ms = block_ms + chunk_ms
    sessions, everything = [], []
    for run in runs:
        lat = run.latencies(media.chunk_samples)
        everything += lat
        covered = max((end for end, _ in run.events), default=0.0)
        behind_ms = round((run.sent_until_s - covered) * 1000, 1) if run.sent_until_s else None
        p95 = _ms(lat)["p95"]
        ok = (run.error is None and behind_ms is not None and behind_ms <= allowed_ms
              and p95 is not None and p95 <= KEEPUP_P95_MS)
        sessions.append({"keeps_up": ok, "behind_ms": behind_ms, "p95_ms": p95, "events": len(lat),
                         "sent_s": round(run.sent_until_s, 3), "max_send_late_ms": round(run.late_s * 1000, 2),
                         **({"error": run.error} if run.error else {})})
    return {"latency": _ms(everything), "loop_lag": live["loop_lag_ms"], "rss_live_mb": live["rss_mb"],
            "sessions_live": live["sessions"], "sessions_left_after": idle["sessions"],
            "keeps_up": {"all": all(s["keeps_up"] for s in sessions), "sessions": sessions}}


async def _bench(args: argparse.Namespace, status: Status, ns: tuple[int, ...], seconds: float, chunk_ms: int,
                 block_ms: int, log_dir: Path) -> dict[str, Any]:
    status(f"building {seconds:g} s of media per client: {chunk_ms} ms chunks, a 320x180 JPEG per second")
    media = await asyncio.to_thread(_Media.build, seconds, chunk_ms)
    warm = await asyncio.to_thread(_Media.build, WARMUP_S, chunk_ms)
    server = _Server(args, max(ns), log_dir)
    try:
        status(f"starting the server: {' '.join(server.cmd[1:])}")
        started = time.perf_counter()
        await server.wait_ready()
        status(f"server up in {time.perf_counter() - started:.1f} s; one warm-up session ({WARMUP_S:g} s)")
        await _phase(server, 1, warm, chunk_ms, block_ms, status)
        await asyncio.sleep(0.5)
        idle_rss = (await asyncio.to_thread(server.health, 1.0))["rss_mb"]
        phases = {}
        for n in ns:
            status(f"N={n}: {n} client(s) streaming audio + 1 fps frames at real-time pace for {seconds:g} s")
            phases[n] = await _phase(server, n, media, chunk_ms, block_ms, status)
            lat, lag = phases[n]["latency"], phases[n]["loop_lag"]
            status(f"N={n}: event latency p50 {lat['p50']} / p95 {lat['p95']} ms, loop lag p99 {lag['p99']} ms, "
                   f"keeps up: {phases[n]['keeps_up']['all']}")
        return {"idle_rss_mb": idle_rss, "phases": phases}
    finally:
        server.stop()


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    ns = QUICK_NS if args.quick else FULL_NS
    seconds = float(os.environ.get(SECONDS_ENV) or (QUICK_S if args.quick else FULL_S))
    profile = load_profile(PROFILE, device=args.device, dtype=args.dtype)
    chunk_ms, block_ms = profile.pipeline.audio_chunk_ms, profile.asr.chunk_ms
    with tempfile.TemporaryDirectory(prefix="runtime-bench-serve-") as tmp:
        measured = asyncio.run(_bench(args, status, ns, seconds, chunk_ms, block_ms, Path(tmp)))
    phases, idle = measured["phases"], measured["idle_rss_mb"]
    kept = [n for n in ns if phases[n]["keeps_up"]["all"]]
    out: dict[str, Any] = {
        "bench": "serve", "quick": args.quick, "profile": PROFILE, "transport": "websocket over loopback",
        "chunk_ms": chunk_ms, "asr_block_ms": block_ms, "n_sessions": list(ns), "duration_s": seconds,
        "frames": {"fps": 1.0, "size": list(FRAME_SIZE), "format": "jpeg"},
        "event_latency_ms": {str(n): phases[n]["latency"] for n in ns},
        "loop_lag_ms": {str(n): {"p99": phases[n]["loop_lag"]["p99"], "max": phases[n]["loop_lag"]["max"],
                                 "p50": phases[n]["loop_lag"]["p50"], "samples": phases[n]["loop_lag"]["samples"]}
                        for n in ns},
        "sessions_kept_realtime": max(kept, default=0),
        "keeps_up": {str(n): phases[n]["keeps_up"] for n in ns},
        "keeps_up_rule": f"behind_ms <= {block_ms + chunk_ms} (asr block + chunk) {GRACE_S:g} s after the last "
                         f"chunk, p95 latency <= {KEEPUP_P95_MS:g} ms, no error",
        "rss_mb_per_session": {str(n): round((phases[n]["rss_live_mb"] - idle) / n, 1) for n in ns},
        "rss_mb": {"idle_after_warmup": idle, **{str(n): phases[n]["rss_live_mb"] for n in ns}},
        "server_sessions_live": {str(n): phases[n]["sessions_live"] for n in ns},  # as /healthz saw them
        "latency_definition": "transcript event received - send time of the first chunk ending at or after "
                              "the event's media end + 10 ms (the ASR's look-ahead)",
    }
    at4 = "4"
    out["targets"] = {
        "event_latency_p95_ms_at_4": at_most(out["event_latency_ms"][at4]["p95"], chunk_ms + 100),
        "loop_lag_p99_ms_at_4": at_most(out["loop_lag_ms"][at4]["p99"], 20.0),
        "judged_on": "2 CPU cores (this machine: see machine.cpu_count)",
    }
    out["random_weights"] = True
    out["note"] = "random weights: transcripts are noise; only timing and memory are real"
    threads = args.threads or profile.threads or max(1, (os.cpu_count() or 1) - 1)
    source = "--threads" if args.threads else "the profile's threads" if profile.threads else "default: cores - 1"
    out["machine"] = {**machine(profile.device, profile.dtype, threads),
                      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count(), "server_torch_threads_source": source}
    return out

