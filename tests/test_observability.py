"""The operator's endpoints: `/readyz` says whether a load balancer may send this replica a session (room, and a
device worker that answers), `/metrics` is Prometheus text that counts what the sessions did."""

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from session_fakes import EchoAnswerer, WordASR, profile_for

from runtime.client import AsyncRealtimeClient
from runtime.loaded_models import Models
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker

pytestmark = pytest.mark.asyncio


def get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def samples(text: str) -> dict[str, float]:
    return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def server_parts():
    with DeviceWorker() as worker:
        yield profile_for(metrics_interval_s=0), Models(WordASR(), EchoAnswerer()), worker


async def test_ready_and_metrics_count_what_the_sessions_did(server_parts):
    async with RealtimeServer(*server_parts, port=0, max_sessions=2) as server:
        status, kind, body = await asyncio.to_thread(get, server.port, "/readyz")
        assert (status, json.loads(body)) == (200, {"status": "ready", "reason": "ok"})
        status, kind, body = await asyncio.to_thread(get, server.port, "/metrics")
        assert status == 200 and kind.startswith("text/plain")
        before = samples(body)
        assert before["runtime_sessions"] == 0 and before["runtime_max_sessions"] == 2
        assert before['runtime_queue_depth{"queue": "audio"}'] == 0
        async with AsyncRealtimeClient(f"ws://127.0.0.1:{server.port}/v1/realtime") as client:
            await client.append_audio(np.zeros(4800, np.float32))
            await client.commit()
            await client.ask("what was said?")
            events = []
            async for event in client.events():
                events.append(event)
                if event.type == "response.done":
                    break
            during = samples((await asyncio.to_thread(get, server.port, "/metrics"))[2])
            assert during["runtime_sessions"] == 1
            await client.finish()
            _ = [e async for e in client.events()]
        after = samples((await asyncio.to_thread(get, server.port, "/metrics"))[2])
    done = next(e for e in events if e.type == "response.done").response
    assert after['runtime_responses_total{"status": "completed"}'] == 1
    assert after["runtime_output_tokens_total"] == done["usage"]["output_tokens"] > 0
    assert after["runtime_turns_committed_total"] == 1  # the commit; finish() found the buffer empty
    assert after["runtime_first_token_seconds_count"] == after["runtime_response_seconds_count"] == 1
    assert after["runtime_first_token_seconds_sum"] <= after["runtime_response_seconds_sum"]
    # the ASR stage: one sample per metrics report (here the session's last, at its end: caught up)
    assert after["runtime_asr_lag_seconds_count"] >= 1 and after["runtime_asr_lag_seconds_sum"] >= 0


async def test_not_ready_when_full_or_when_the_worker_does_not_answer(server_parts, monkeypatch):
    async with RealtimeServer(*server_parts, port=0, max_sessions=1) as server:
        async with AsyncRealtimeClient(f"ws://127.0.0.1:{server.port}/v1/realtime"):
            status, _, body = await asyncio.to_thread(get, server.port, "/readyz")
            assert status == 503 and json.loads(body) == {"status": "not_ready",
                                                          "reason": "at its limit of 1 sessions"}
        for _ in range(200):
            if not server.sessions:
                break
            await asyncio.sleep(0.02)
        original = server.worker.run

        async def stalled(*args, **kwargs):
            await asyncio.sleep(5)
            return await original(*args, **kwargs)

        monkeypatch.setattr(server.worker, "run", stalled)
        status, _, body = await asyncio.to_thread(get, server.port, "/readyz")
        assert status == 503 and "did not run a job within 2 s" in json.loads(body)["reason"]
        status, _, body = await asyncio.to_thread(get, server.port, "/healthz")
        assert status == 200  # alive, though not ready
