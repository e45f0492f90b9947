"""What an operator's tools ask a replica: `/readyz` (may a load balancer send it a session now?) and `/metrics`
(Prometheus text, through `prometheus-client`).

Two kinds of numbers, so nothing on the data path pays for a scrape: what is true *now* (live sessions, queue
depths, the device worker's backlog, event-loop lag, memory, audio dropped) is read from the server at scrape
time by a collector; what *happened* (responses by status, output tokens, committed turns, first-token and
answer times) is counted from the events as the session driver forwards them (`observe`), one dictionary lookup
per event. Each server has its own registry, so several in one process (the tests) never share counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.events import AudioBufferCommitted, Event, Metrics, ResponseDone
from runtime.metrics import LoopLagMonitor, rss_mb
from runtime.session import Session
from runtime.worker import DeviceWorker, Priority

READY_TIMEOUT_S = 2.0  # a worker that cannot run a no-op job in this long is not ready for a session
SECONDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class ServerView(Protocol):
    """What the metrics read of the server (`RealtimeServer`)."""

    sessions: dict[str, Session]
    max_sessions: int
    worker: DeviceWorker
    loop_lag: LoopLagMonitor


class _Now(Collector):
    """The server's state at scrape time."""

    def __init__(self, server: ServerView) -> None:
        self.server = server

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.server
        yield GaugeMetricFamily("runtime_sessions", "Live sessions", value=len(s.sessions))
        yield GaugeMetricFamily("runtime_max_sessions", "Sessions this replica admits", value=s.max_sessions)
        totals = dict.fromkeys(("audio", "video", "questions", "events"), 0)
        for session in s.sessions.values():
            for channel in (session.audio_in, session.video_in, session.questions, session.events):
                totals[channel.name] += len(channel)
        depth = GaugeMetricFamily("runtime_queue_depth", "Items waiting, summed over live sessions", labels=["queue"])
        for name, total in totals.items():
            depth.add_metric([name], total)
        yield depth
        yield GaugeMetricFamily("runtime_worker_pending", "Jobs waiting for the device worker",
                                value=s.worker.pending)
        lag = s.loop_lag.percentiles(10.0)
        yield GaugeMetricFamily("runtime_loop_lag_p99_seconds", "Event-loop lag, 99th percentile over 10 s",
                                value=float(lag.get("p99") or 0.0) / 1000)
        yield GaugeMetricFamily("runtime_rss_bytes", "Resident memory of the process", value=rss_mb()[0] * 2**20)
        yield GaugeMetricFamily("runtime_audio_dropped_seconds", "Audio dropped by live sessions' transports "
                                "(WebRTC buffer overflow)", value=sum(x.transport.audio_dropped_s
                                                                      for x in s.sessions.values()))
        yield GaugeMetricFamily("runtime_video_frames_dropped", "Video frames dropped by live sessions (queue full)",
                                value=sum(x.video_in.stats.dropped for x in s.sessions.values()))


class ServerMetrics:
    def __init__(self, server: ServerView) -> None:
        self.server = server
        self.registry = CollectorRegistry()
        self.registry.register(_Now(server))
        self.responses = Counter("runtime_responses", "Responses ended, by status", ["status"],
                                 registry=self.registry)
        self.output_tokens = Counter("runtime_output_tokens", "Answer tokens streamed (rate: tokens/s)",
                                     registry=self.registry)
        self.turns = Counter("runtime_turns_committed", "Input buffers committed as user items",
                             registry=self.registry)
        self.first_token = Histogram("runtime_first_token_seconds", "From a response's request to its first "
                                     "token", buckets=SECONDS, registry=self.registry)
        self.answer_time = Histogram("runtime_response_seconds", "From a response's request to its end",
                                     buckets=SECONDS, registry=self.registry)
        self.asr_lag = Histogram("runtime_asr_lag_seconds", "How far the transcript trails the audio received, "
                                 "per session metrics report (the ASR stage's latency)", buckets=SECONDS,
                                 registry=self.registry)

    def observe(self, event: Event) -> None:
        """Count what an event says happened (called for every event a session sends)."""
        if isinstance(event, ResponseDone):
            response = event.response
            self.responses.labels(str(response.get("status", "unknown"))).inc()
            usage, timing = response.get("usage") or {}, response.get("timing") or {}
            self.output_tokens.inc(int(usage.get("output_tokens") or 0))
            if timing.get("first_token_s") is not None:
                self.first_token.observe(float(timing["first_token_s"]))
            if timing.get("total_s") is not None:
                self.answer_time.observe(float(timing["total_s"]))
        elif isinstance(event, AudioBufferCommitted):
            self.turns.inc()
        elif isinstance(event, Metrics):
            lag = (event.metrics.get("asr") or {}).get("lag_s")
            if isinstance(lag, int | float):
                self.asr_lag.observe(max(0.0, float(lag)))

    def text(self) -> bytes:
        return generate_latest(self.registry)

    async def ready(self) -> tuple[bool, str]:
        """(ready, why not): room for a session, and a device worker that runs a job within `READY_TIMEOUT_S`."""
        s = self.server
        if len(s.sessions) >= s.max_sessions:
            return False, f"at its limit of {s.max_sessions} sessions"
        try:
            await asyncio.wait_for(s.worker.run(Priority.CONTROL, _nothing), READY_TIMEOUT_S)
        except TimeoutError:
            return False, f"the device worker did not run a job within {READY_TIMEOUT_S:g} s"
        return True, "ok"


def _nothing() -> None:
    return None
