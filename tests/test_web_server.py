"""The websocket server with the real tiny models, driven through the SDK: a full round trip, /healthz, bad
client events answered with errors while the session carries on, disconnects that leave nothing behind, and
the session limit."""

import asyncio
import base64
import json
import urllib.request

import numpy as np
import pytest
from cli_common import one_error_line, run_cli
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime import cli
from runtime.client import AsyncRealtimeClient, encode_jpeg, pcm16_bytes
from runtime.config import load_profile
from runtime.errors import UserError
from runtime.io.sample import demo_speech, render_frame
from runtime.session import load_models
from runtime.web.protocol import MAX_MESSAGE_BYTES
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker

CHUNK = 1600  # 100 ms


@pytest.fixture(scope="module")
def tiny():
    profile = load_profile("tiny", overrides=["pipeline.metrics_interval_s=0", "lm.max_new_tokens=8"])
    with DeviceWorker() as worker:
        yield profile, load_models(profile, worker), worker  # RealtimeServer(*tiny) order


def url(server: RealtimeServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime"


async def stream_demo(client: AsyncRealtimeClient, seconds: float = 3.0) -> None:
    speech = demo_speech()[: int(seconds * 16000)]
    for i in range(0, len(speech), CHUNK):
        await client.append_audio(speech[i : i + CHUNK])
        if i % 16000 == 0:
            await client.append_frame(render_frame(i / 16000, 160, 120), i / 16000)


def check_round_trip(events: list) -> None:
    types = [e.type for e in events]
    assert types[0] == "session.created"
    assert types[-1] == "metrics"  # final metrics, then the server closes
    assert "conversation.item.input_audio_transcription.completed" in types
    created, done = types.index("response.created"), types.index("response.done")
    deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert created < min(deltas) and max(deltas) < done
    done_event = events[done]
    assert done_event.response["status"] in ("completed", "incomplete")  # random weights may hit the token limit
    assert done_event.media_time == pytest.approx(3.0)
    heard = [e.media_time for e in events if e.type.startswith("conversation.item.input_audio")]
    assert heard == sorted(heard) and all(0 < t <= 3.0 + 1e-6 for t in heard)


@pytest.mark.asyncio
async def test_sdk_round_trip_and_healthz(tiny):
    async with RealtimeServer(*tiny, port=0) as server:
        health = json.loads(await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10).read()))
        assert health["sessions"] == 0 and health["device"] == "cpu" and "worker" in health
        async with AsyncRealtimeClient(url(server)) as client:
            await client.update_session(input_audio_format="pcm16")
            await stream_demo(client)
            await client.ask("what moved?")
            health = json.loads(await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10).read()))
            assert health["sessions"] == 1 and set(next(iter(health["queues"].values()))) == {
                "audio", "video", "questions", "events"}
            await client.commit()
            events = [e async for e in client.events()]
        assert "session.updated" in [e.type for e in events]
        check_round_trip(events)
        assert events[-1].metrics["video"]["frames_in"] == 3
        await wait_until(lambda: not server.sessions)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_bad_events_are_answered_and_the_session_carries_on(tiny):
    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server)) as client:
        bad = {
            "b1": ("not json at all", "invalid_json"),
            "b2": ({"type": "mystery.event"}, "unknown_event_type"),
            "b3": ({"type": "input_audio_buffer.append", "audio": "%%%"}, "invalid_base64"),
            "b4": ({"type": "input_audio_buffer.append", "audio": "AAEC"}, "invalid_audio"),  # 3 bytes
            "b5": ({"type": "input_video_frame.append", "image": "AAAA", "timestamp": 0.5}, "invalid_image"),
            "b6": ({"type": "input_video_frame.append", "image": "AAAA"}, "missing_field"),
            "b7": ({"type": "response.create"}, "no_pending_item"),
            "b8": ({"type": "response.cancel"}, "response_not_found"),
            "b9": ({"type": "response.create", "pad": "x" * (MAX_MESSAGE_BYTES + 10)}, "message_too_large"),
        }
        for event_id, (body, _) in bad.items():
            if isinstance(body, dict):
                body = json.dumps({"event_id": event_id, **body})
            await client.ws.send(body)
        await stream_demo(client)
        await client.ask("what moved?")
        await client.commit()
        events = [e async for e in client.events()]
    errors = [e for e in events if e.type == "error"]
    codes = [(e.error["event_id"], e.error["code"]) for e in errors]
    expected = [(None if k == "b1" else k, code) for k, (_, code) in bad.items()]
    assert codes == expected
    assert all(e.error["message"] for e in errors)
    check_round_trip(events)


@pytest.mark.asyncio
async def test_disconnects_leave_nothing_behind(tiny):
    """Clean closes, aborts without a close handshake, aborts while finishing, and frames past the hard size
    cap (websockets closes with 1009): every session is freed and every task is gone."""
    silence = base64.b64encode(pcm16_bytes(np.zeros(CHUNK * 3, np.float32))).decode()
    async with RealtimeServer(*tiny, port=0) as server:
        for i in range(20):
            ws = await connect(url(server), max_size=None)
            await ws.recv()  # session.created: the session is up
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
            mode = i % 4
            if mode == 0:
                await ws.close()
            elif mode == 1:
                ws.transport.abort()
            elif mode == 2:
                for body in ({"type": "conversation.item.create", "item": {"content": [
                        {"type": "input_text", "text": "what moved?"}]}}, {"type": "response.create"},
                        {"type": "input_audio_buffer.commit"}):
                    await ws.send(json.dumps(body))
                ws.transport.abort()
            else:
                await ws.send("x" * (2 * MAX_MESSAGE_BYTES + 1))
                with pytest.raises(ConnectionClosed):
                    while True:
                        await ws.recv()
                assert ws.close_code == 1009
        await wait_until(lambda: not server.sessions)
        await wait_until(lambda: not [t for t in asyncio.all_tasks() if "sess_" in t.get_name()])
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_max_sessions_refuses_with_server_busy(tiny):
    async with RealtimeServer(*tiny, port=0, max_sessions=1) as server:
        async with AsyncRealtimeClient(url(server)) as first:
            assert (await anext(first.events())).type == "session.created"
            async with AsyncRealtimeClient(url(server)) as second:
                events = [e async for e in second.events()]
                assert [e.error["code"] for e in events] == ["server_busy"]
                assert second.ws.close_code == 1013
        await wait_until(lambda: not server.sessions)
        async with AsyncRealtimeClient(url(server)) as third:  # the slot is free again
            assert (await anext(third.events())).type == "session.created"


def test_jpeg_frames_cost_little():
    assert len(encode_jpeg(render_frame(1.0, 160, 120))) < 20_000


async def wait_until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_stream_file_sends_audio_and_jpeg_frames(tiny, demo_file):
    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server)) as client:
        reached = await client.stream_file(demo_file, speed=0)
        await client.ask("what moved?")
        await client.commit()
        events = [e async for e in client.events()]
    assert client.close_code == 1000
    types = [e.type for e in events]
    assert "conversation.item.input_audio_transcription.completed" in types and "response.done" in types
    assert events[-1].metrics["video"]["frames_in"] >= int(reached) - 1
    assert events[-1].metrics["asr"]["pushed_until"] == pytest.approx(reached, abs=0.5)  # video may outlast audio


async def refused(uri: str, **kwargs) -> tuple[int, str]:
    """The HTTP status and body of an upgrade the server refuses."""
    with pytest.raises(InvalidStatus) as refusal:
        await connect(uri, **kwargs)
    response = refusal.value.response
    return response.status_code, response.body.decode()


@pytest.mark.asyncio
async def test_a_token_is_required_on_every_upgrade_but_not_on_healthz(tiny):
    async with RealtimeServer(*tiny, port=0, token="s3cret") as server:
        for kwargs in ({}, {"additional_headers": {"Authorization": "Bearer wrong"}},
                       {"additional_headers": {"Authorization": "Basic s3cret"}}):
            status, body = await refused(url(server), **kwargs)
            assert status == 401 and "token" in body and body.count("\n") == 1
        status, _ = await refused(url(server) + "?token=wrong")
        assert status == 401
        assert not server.sessions
        async with AsyncRealtimeClient(url(server), token="s3cret") as client:
            assert (await anext(client.events())).type == "session.created"
        async with connect(url(server) + "?token=s3cret") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
        health = json.loads(await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10).read()))
        assert health["status"] == "ok"


@pytest.mark.asyncio
async def test_browser_origins_are_checked_and_clients_without_one_pass(tiny):
    async with RealtimeServer(*tiny, port=0) as server:
        status, body = await refused(url(server), origin="https://evil.example")
        assert status == 403 and "https://evil.example" in body
        assert not server.sessions
        for origin in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}", None):
            async with connect(url(server), origin=origin) as ws:  # the demo page's own origin, or no browser
                assert json.loads(await ws.recv())["type"] == "session.created"
    async with RealtimeServer(*tiny, port=0, allow_origins=["https://app.example/"]) as server:
        async with connect(url(server), origin="https://app.example") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
        status, _ = await refused(url(server), origin=f"http://127.0.0.1:{server.port}")  # the list replaces it
        assert status == 403


def test_serve_refuses_a_network_address_without_a_token_before_loading_models(capsys, monkeypatch):
    def setup(*_):
        raise UserError("models would load here")

    monkeypatch.setattr(cli, "_setup", setup)
    monkeypatch.delenv("RUNTIME_TOKEN", raising=False)
    code, _, err = run_cli(capsys, "serve", "--host", "0.0.0.0")
    assert code == 1 and "0.0.0.0" in one_error_line(err) and "--token" in err
    assert "models would load here" not in err
    for argv, env in ((["--token", "s3cret"], None), ([], "s3cret")):  # with a token it goes on to load models
        if env is not None:
            monkeypatch.setenv("RUNTIME_TOKEN", env)
        code, _, err = run_cli(capsys, "serve", "--host", "0.0.0.0", *argv)
        assert code == 1 and "models would load here" in one_error_line(err)
    code, _, err = run_cli(capsys, "serve", "--host", "127.0.0.1")
    assert "models would load here" in one_error_line(err)
