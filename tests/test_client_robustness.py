"""The SDK when things go wrong: closing without reading, a connection that breaks, a server newer than the
SDK, failed connects and use after close, bad audio shapes, and the examples' exits. Most run against a tiny
fake websockets server that misbehaves on cue; the close test runs the real server with the tiny models."""

import asyncio
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import soundfile
from test_web_server import tiny  # noqa: F401  (the module-scoped models fixture)
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosedError

from runtime.client import AsyncRealtimeClient, RealtimeClient
from runtime.events import Metrics, ResponseTextDelta, SessionCreated
from runtime.io.sample import demo_speech
from runtime.web.server import RealtimeServer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHUNK = 1600  # 100 ms


@asynccontextmanager
async def fake_server(handler: Callable[[ServerConnection], Awaitable[None]], **kwargs) -> AsyncIterator[str]:
    """A websockets server on a free port running `handler` per connection, after the greeting every session
    starts with (`session.created`, which the SDK reads on connect); yields its URL."""

    async def greeted(ws: ServerConnection) -> None:
        await ws.send(SessionCreated(session={"id": "sess_fake", "object": "realtime.session"}).to_json())
        await handler(ws)

    async with serve(greeted, "127.0.0.1", 0, **kwargs) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"ws://127.0.0.1:{port}/v1/realtime"


async def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def delta(text: str) -> str:
    return ResponseTextDelta(response_id="resp_1", item_id="item_1", delta=text).to_json()


# 1. closing without reading the events


@pytest.mark.asyncio
async def test_closing_with_unread_events_is_prompt_and_clean(tiny):  # noqa: F811
    async with RealtimeServer(*tiny, port=0) as server:
        client = AsyncRealtimeClient(f"ws://127.0.0.1:{server.port}/v1/realtime")
        with pytest.raises(RuntimeError, match="gave up"):
            async with client:
                speech = demo_speech()[: 8 * 16000]
                for i in range(0, len(speech), CHUNK):
                    await client.append_audio(speech[i : i + CHUNK])
                # the precondition of the stall: websockets stopped reading the socket, its queue full of events
                await wait_until(lambda: not client.ws.transport.is_reading())
                started = time.monotonic()
                raise RuntimeError("gave up")
        assert time.monotonic() - started < 2.0  # not close()'s 10 s timeout
        assert client.ws.close_code == 1000  # a clean handshake, not 1006


@pytest.mark.asyncio
async def test_blocking_client_closes_promptly_with_unread_events():
    async def flood(ws: ServerConnection) -> None:
        for i in range(200):
            await ws.send(delta(str(i)))
        await ws.wait_closed()

    async with fake_server(flood) as url:
        def unread_then_close() -> tuple[float, int | None]:
            client = RealtimeClient(url).connect()
            time.sleep(0.5)  # the 200 events arrive; none is read
            started = time.monotonic()
            client.close()
            return time.monotonic() - started, client.close_code

        elapsed, code = await asyncio.to_thread(unread_then_close)
    assert elapsed < 2.0 and code == 1000


# 2. a broken connection is an error, a finished or refused one is not


@pytest.mark.asyncio
async def test_events_raise_after_yielding_what_arrived_when_the_connection_drops():
    async def abort(ws: ServerConnection) -> None:
        await ws.send(delta("last words"))
        await asyncio.sleep(0.2)
        ws.transport.abort()  # as if the server were SIGKILLed: no close frame

    async with fake_server(abort) as url, AsyncRealtimeClient(url) as client:
        received = []
        with pytest.raises(ConnectionClosedError):
            async for event in client.events():
                received.append(event)
    assert received[0].type == "session.created"  # the greeting, read on connect, comes first
    assert [e.delta for e in received[1:]] == ["last words"]
    assert client.close_code == 1006


@pytest.mark.asyncio
async def test_a_server_that_closes_while_the_client_is_blocked_sending_raises_connection_closed():
    """The server fails the connection (a close frame, then end of stream) while the client's writes back up,
    then reads the backlog on, as the session driver does. The next send must say the connection closed, not
    leak asyncio's AttributeError from aborting a transport that is already gone."""
    async def fail_midstream(ws: ServerConnection) -> None:
        # small kernel buffers: the writes back up after some 64 KB, not after the hundreds of MB a loopback
        # socket's autotuned buffers took here (26,000 sends, 13 s of a 2 GHz core)
        ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        for _ in range(5):
            await ws.recv()
        await asyncio.sleep(0.5)  # not reading: the client's sends wait for the buffer to drain
        ws.protocol.fail(1011, "internal error")
        ws.send_data()
        async for _ in ws:
            pass

    async with fake_server(fail_midstream, ping_interval=None, max_size=None) as url, \
            AsyncRealtimeClient(url) as client:
        assert client.ws is not None
        client.ws.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        with pytest.raises(ConnectionClosedError) as closed:
            async with asyncio.timeout(30):
                while True:
                    await client.append_audio(np.zeros(16000, np.float32))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011


@pytest.mark.asyncio
@pytest.mark.parametrize(("code", "raises"), [(1000, False), (1001, False), (1013, False), (1011, True)])
async def test_events_end_quietly_only_on_normal_shutdown_and_busy_closes(code, raises):
    async def close_with(ws: ServerConnection) -> None:
        await ws.send(delta("x"))
        await ws.close(code, "bye")

    async with fake_server(close_with) as url, AsyncRealtimeClient(url) as client:
        received = []
        try:
            async for event in client.events():
                received.append(event)
        except ConnectionClosedError:
            assert raises
        else:
            assert not raises
    assert len(received) == 2 and client.close_code == code  # the greeting and the delta


@pytest.mark.asyncio
async def test_blocking_events_raise_when_the_connection_drops():
    async def abort(ws: ServerConnection) -> None:
        await ws.send(delta("a"))
        await asyncio.sleep(0.2)
        ws.transport.abort()

    async with fake_server(abort) as url:
        def read_all() -> list:
            received = []
            with RealtimeClient(url) as client, pytest.raises(ConnectionClosedError):
                for event in client.events():
                    received.append(event)
            return received

        assert [e.delta for e in (await asyncio.to_thread(read_all))[1:]] == ["a"]


# 8. a newer server: unknown fields and event types do not stop the stream


@pytest.mark.asyncio
async def test_unknown_fields_are_dropped_and_unknown_types_skipped(caplog):
    metrics = Metrics(metrics={"asr": {}}).to_dict()

    async def newer_server(ws: ServerConnection) -> None:
        await ws.send(json.dumps({**metrics, "future_field": 1}))
        await ws.send('{"type": "future.event", "event_id": "e1"}')
        await ws.send("not json")
        await ws.send(delta("still here"))
        await ws.close(1000)

    async with fake_server(newer_server) as url, AsyncRealtimeClient(url) as client:
        with caplog.at_level(logging.WARNING, logger="runtime.client"):
            received = [e async for e in client.events()]
    assert [e.type for e in received] == ["session.created", "runtime.metrics", "response.output_text.delta"]
    assert received[1].metrics == {"asr": {}} and not hasattr(received[1], "future_field")
    assert received[2].delta == "still here"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "future.event" in warnings[0]


# 3 and 4. the blocking client's thread: no leak on failed connects, a clear error after close


def client_threads() -> int:
    return sum(t.name == "realtime-client" for t in threading.enumerate())  # RealtimeClient.THREAD_NAME


@pytest.mark.asyncio
async def test_failed_connects_leave_no_thread_behind():
    async def never(ws: ServerConnection) -> None:
        raise AssertionError("the handshake is refused before this")

    async with fake_server(never, process_request=lambda conn, req: conn.respond(404, "nope\n")) as url:
        def fail_many() -> None:
            for _ in range(10):
                with pytest.raises(OSError):
                    RealtimeClient("ws://127.0.0.1:1/v1/realtime").connect()  # nothing listens on port 1
                with pytest.raises(Exception, match="404"), RealtimeClient(url.replace("realtime", "nope")):
                    pass

        before = client_threads()
        await asyncio.to_thread(fail_many)
    assert client_threads() == before


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_calls_after_close_raise_a_clear_error():
    client = RealtimeClient("ws://127.0.0.1:1/v1/realtime")
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="RealtimeClient is closed"):
        client.ask("x")
    with pytest.raises(RuntimeError, match="RealtimeClient is closed"):
        list(client.events())
    with pytest.raises(RuntimeError, match="RealtimeClient is closed"):
        client.append_audio(np.zeros(CHUNK, np.float32))
    gc.collect()  # a coroutine created and dropped would warn "never awaited" here


# 5. audio shape


@pytest.mark.asyncio
@pytest.mark.parametrize("shape", [(CHUNK, 2), (2, CHUNK), (1, CHUNK), ()])
async def test_append_audio_refuses_anything_but_one_dimension(shape):
    client = AsyncRealtimeClient("ws://127.0.0.1:1/v1/realtime")  # refused before anything is sent
    with pytest.raises(ValueError, match="1-D"):
        await client.append_audio(np.zeros(shape, np.float32))


# 6 and 7. the examples


def run_example(*args: str, stdin: int | None = subprocess.DEVNULL, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], stdin=stdin, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)})


def test_examples_print_usage_for_missing_arguments():
    for script in ("ask_about_a_file.py", "stream_live_async.py"):
        done = run_example(str(EXAMPLES / script))
        assert done.returncode == 2 and "usage:" in done.stderr and "Traceback" not in done.stderr


def test_ask_about_a_file_exits_non_zero_with_one_line_when_the_server_is_unreachable(demo_file):
    done = run_example(str(EXAMPLES / "ask_about_a_file.py"), str(demo_file), "what moved?",
                       "ws://127.0.0.1:1/v1/realtime")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.asyncio
async def test_ask_about_a_file_exits_non_zero_when_the_connection_breaks(demo_file):
    async def abort(ws: ServerConnection) -> None:
        async for message in ws:  # take the media and the question, then die
            if "runtime.session.finish" in message:
                await ws.send(delta("half an answer"))
                await asyncio.sleep(0.2)
                ws.transport.abort()
                return

    async with fake_server(abort) as url:
        done = await asyncio.to_thread(run_example, str(EXAMPLES / "ask_about_a_file.py"), str(demo_file), "q", url)
    assert done.returncode == 1 and "half an answer" in done.stdout
    assert "Traceback" not in done.stderr and "ConnectionClosedError" in done.stderr


@pytest.mark.asyncio
async def test_stream_live_async_ends_with_the_session_while_stdin_stays_open(tmp_path):
    media = tmp_path / "one_second.wav"  # sent at real-time pace: keep it short
    soundfile.write(media, demo_speech()[:16000], 16000)

    async def short_session(ws: ServerConnection) -> None:
        async for message in ws:
            if isinstance(message, str) and "runtime.session.finish" in message:
                break
        await ws.send(delta("hello"))
        await ws.close(1000, "session finished")

    async with fake_server(short_session) as url:
        reader, writer = os.pipe()  # stdin that never reaches end of file while the example runs
        try:
            done = await asyncio.to_thread(run_example, str(EXAMPLES / "stream_live_async.py"), str(media),
                                           url, stdin=reader, timeout=30)
        finally:
            os.close(writer)
            os.close(reader)
    assert done.returncode == 0, done.stderr
    assert "hello" in done.stdout

