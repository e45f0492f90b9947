"""Keepalive against flow control: a client that stops reading for a while, or a server still working through
a client's backlog, answers pings late. That is the flow control docs/protocol.md promises, not a dead peer,
so it must cost no session (websockets' heartbeat closed such sessions with 1011 after 20 s + 20 s)."""

import asyncio
import base64
import json

import numpy as np
import pytest
from test_web_server import tiny  # noqa: F401  (the module-scoped models fixture)
from websockets.asyncio.client import connect

from runtime.client import AsyncRealtimeClient, pcm16_bytes
from runtime.io.sample import demo_speech
from runtime.web.server import RealtimeServer

KEEPALIVE_S = 0.05  # pings every 50 ms: the stalls below last 30 and more intervals


async def append_speech(ws, seconds: float) -> None:
    speech = demo_speech()[: int(seconds * 16000)]
    for i in range(0, len(speech), 1600):
        audio = base64.b64encode(pcm16_bytes(speech[i : i + 1600])).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))


@pytest.mark.asyncio
async def test_a_client_that_stops_reading_keeps_its_session_and_every_event(tiny):  # noqa: F811
    # max_queue=1: past one unread message this client stops reading its socket, pongs included
    async with (RealtimeServer(*tiny, port=0, keepalive_s=KEEPALIVE_S) as server,
                connect(f"ws://127.0.0.1:{server.port}/v1/realtime", max_queue=1, ping_interval=None) as ws):
        await append_speech(ws, 3.0)
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "what was said?"}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        await asyncio.sleep(30 * KEEPALIVE_S)  # not reading: the server's pings go unanswered meanwhile
        await ws.send(json.dumps({"type": "runtime.session.finish"}))
        types = []
        async for message in ws:  # the server closes with 1000 after the session's last events
            types.append(json.loads(message)["type"])
        assert ws.close_code == 1000, (ws.close_code, ws.close_reason)
    assert types[0] == "session.created" and "response.done" in types and types[-1] == "runtime.metrics"


@pytest.mark.asyncio
async def test_a_server_working_through_a_backlog_keeps_the_session(tiny, monkeypatch):  # noqa: F811
    """The server stops reading while the audio queue is full; the SDK's pings then wait behind the audio."""
    async with RealtimeServer(*tiny, port=0, keepalive_s=KEEPALIVE_S) as server:
        session_started = asyncio.Event()
        original = server.worker.run

        async def slow_run(*args, **kwargs):  # every model job 20 ms late: the audio queue stays full
            session_started.set()
            await asyncio.sleep(0.02)
            return await original(*args, **kwargs)

        monkeypatch.setattr(server.worker, "run", slow_run)
        async with AsyncRealtimeClient(f"ws://127.0.0.1:{server.port}/v1/realtime", keepalive_s=KEEPALIVE_S) as client:
            speech = np.tile(demo_speech(), 2)
            for i in range(0, len(speech), 1600):
                await client.append_audio(speech[i : i + 1600])
            await client.finish()
            events = [event async for event in client.events()]
            assert client.close_code == 1000
    assert session_started.is_set() and events[-1].type == "runtime.metrics"
