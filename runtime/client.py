"""A small async SDK for the websocket protocol (docs/protocol.md): send media and questions, read events.

    async with AsyncRealtimeClient("ws://127.0.0.1:8765/v1/realtime") as client:
        await client.append_audio(samples)          # float32 or int16, mono 16 kHz (or stream_file/_microphone)
        await client.ask("what moved?")
        await client.finish()                       # no more input: the server answers, then closes
        async for event in client.events():         # runtime.events objects, in order
            ...

`speak()` asks for spoken answers; their audio comes as `ResponseAudioDelta` events (`event.audio()` is the bytes),
or alone from `audio_chunks()`.

On connect the client tells the server it sends 16 kHz PCM (the API's default is 24 kHz) and, unless
`answer_turns`, that turn detection only splits the captions into utterances: a script streaming a talk asks
its own questions rather than getting an answer at every pause. `commit()` ends a user turn (the API's
`input_audio_buffer.commit`); `finish()` ends the session's input.

`events()` raises `websockets.exceptions.ConnectionClosedError` when the connection breaks (see its docstring),
so a script that reads every event fails loudly when the server does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import av
import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConcurrencyError, ConnectionClosed, ConnectionClosedError
from websockets.frames import CloseCode

from runtime.chunks import AudioChunk
from runtime.events import Event, ResponseAudioDelta, SessionCreated, new_id, parse_event
from runtime.web.binary_messages import binary_audio, binary_frame

if TYPE_CHECKING:
    from runtime.io.source import Source

P = ParamSpec("P")
T = TypeVar("T")

log = logging.getLogger(__name__)

# Close codes after which `events()` just ends: 1000 (the server finished the session after finish()), 1001 (the
# server is going away, e.g. shut down) and 1013 (server_busy: an `error` event saying so came first).
QUIET_CLOSE_CODES = frozenset({CloseCode.NORMAL_CLOSURE, CloseCode.GOING_AWAY, CloseCode.TRY_AGAIN_LATER})


def encode_jpeg(image: np.ndarray, quality: int = 5) -> bytes:
    """RGB uint8 [H, W, 3] -> JPEG bytes with PyAV's mjpeg encoder (`quality` is its qscale: 2 best)."""
    height, width = image.shape[:2]
    codec = av.CodecContext.create("mjpeg", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "yuvj420p"
    codec.time_base = Fraction(1, 25)
    codec.options = {"qscale": str(quality)}
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24").reformat(format="yuvj420p")
    packets = list(codec.encode(frame)) + list(codec.encode(None))
    return b"".join(bytes(p) for p in packets)


def pcm16_bytes(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] (clipped) or int16 -> PCM16 little-endian bytes."""
    array = np.asarray(samples)
    if array.dtype != np.int16:
        array = np.round(np.clip(array.astype(np.float32), -1.0, 32767 / 32768) * 32768).astype(np.int16)
    return array.astype("<i2").tobytes()


def read_server_event(message: str | bytes) -> Event | None:
    """One server message -> its event, forgiving where `parse_event` is strict, so that a newer server does not
    break an older SDK: fields this SDK does not know are dropped (the event is still yielded); a message it
    cannot read at all (an unknown event type, not JSON) is logged as a warning and gives None (skipped)."""
    text = message if isinstance(message, str) else message.decode(errors="replace")
    try:
        return parse_event(text, strict=False)
    except (ValueError, TypeError) as error:
        log.warning("skipping a server message this SDK cannot read (%s): %.200s", error, text)
        return None


async def _discard_incoming(ws: ClientConnection) -> None:
    """Read and drop messages until the connection closes. Unread events fill websockets' bounded incoming
    queue, which stops it reading from the socket, so the server's close frame would never be seen and
    close() would wait out its 10 s timeout and end with 1006. Someone else reading (ConcurrencyError)
    drains it just as well."""
    try:
        while True:
            await ws.recv(decode=False)
    except (ConnectionClosed, ConcurrencyError):
        pass


class _ClientConnection(ClientConnection):
    """websockets aborts the transport when a send or close finds the connection closed. A server that closes
    while we stream (it fails the connection, then reads our backlog) leaves asyncio's selector transport
    closed on EOF with our writes still buffered; once they drain it runs connection_lost without marking
    itself lost, and abort() then raises AttributeError ("'NoneType' object has no attribute 'call_soon'",
    CPython 3.11-3.13) instead of the ConnectionClosed the caller expects. After connection_lost there is
    nothing left to abort."""

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.transport.abort = lambda: None  # type: ignore[method-assign]


class AsyncRealtimeClient:
    """`token`: the server's `--token`, sent as an `Authorization: Bearer` header (kept out of the URL, which
    tends to end up in logs). `binary`: send audio and frames as binary messages (docs/protocol.md, "Binary
    media"): no base64, a third less to send; their event ids are then `bin-SEQ`. `keepalive_s`: how often
    to ping the server (a late pong closes nothing, see `connect`)."""

    def __init__(self, url: str, *, token: str | None = None, max_size: int = 16 * 1024 * 1024,
                 binary: bool = False, keepalive_s: float = 20.0, answer_turns: bool = False) -> None:
        self.url, self.token, self.max_size, self.binary = url, token, max_size, binary
        self.keepalive_s, self.answer_turns = keepalive_s, answer_turns
        self.ws: ClientConnection | None = None
        self.created: Event | None = None  # the server's session.created, read on connect (events() yields it)
        self.greeting_timeout_s = 30.0
        self._seq = 0

    async def connect(self) -> AsyncRealtimeClient:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        # Pings keep a quiet connection open; no pong deadline, as on the server: while the server reads our
        # backlog (flow control) its pong waits behind it, and that is not a dead connection.
        self.ws = await connect(self.url, max_size=self.max_size, additional_headers=headers,
                                ping_interval=self.keepalive_s, ping_timeout=None,
                                create_connection=_ClientConnection)
        try:
            first = read_server_event(await asyncio.wait_for(self.ws.recv(), self.greeting_timeout_s))
        except ConnectionClosed:  # refused at once: events() says how
            return self
        except TimeoutError:
            await self.close()
            raise ConnectionError(f"{self.url} sent no session.created within {self.greeting_timeout_s:g} s: is it "
                                  "a runtime server?") from None
        self.created = first
        if not isinstance(first, SessionCreated):  # server_busy: an error, then 1013
            return self
        audio: dict[str, object] = {"format": {"type": "audio/pcm", "rate": 16000}}
        detection = first.session.get("audio", {}).get("input", {}).get("turn_detection")
        if detection and not self.answer_turns:
            audio["turn_detection"] = {**detection, "create_response": False, "interrupt_response": False}
        with contextlib.suppress(ConnectionClosed):  # closed already: events() yields what came and says how
            await self.update_session(audio={"input": audio})
        return self

    async def close(self) -> None:
        """Close with code 1000. Events not read yet are discarded meanwhile, so closing without reading
        them (an exception mid-stream, say) is prompt and clean rather than a 10 s stall ending in 1006."""
        if self.ws is None:
            return
        drain = asyncio.create_task(_discard_incoming(self.ws))
        try:
            await self.ws.close()
        finally:
            drain.cancel()  # already finished unless close() itself was cancelled
            await asyncio.wait({drain})

    async def __aenter__(self) -> AsyncRealtimeClient:
        return await self.connect()

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    @property
    def close_code(self) -> int | None:
        return None if self.ws is None else self.ws.close_code

    async def send(self, type: str, **fields: object) -> str:
        """Send one client event; returns its event_id (what `error.event_id` names if it is refused)."""
        assert self.ws is not None, "connect() first"
        event_id = fields.pop("event_id", None) or new_id("cevt")
        await self.ws.send(json.dumps({"type": type, "event_id": event_id, **fields}))
        return event_id

    async def update_session(self, **session: object) -> str:
        return await self.send("session.update", session=session)

    async def append_audio(self, samples: np.ndarray) -> str:
        """Send mono 16 kHz samples (float32 in [-1, 1] or int16). A 2-D array is refused rather than sent:
        its channels would arrive interleaved, as twice as many mono samples (garbled, half speed)."""
        if np.ndim(samples) != 1:
            raise ValueError(f"append_audio takes mono 16 kHz float32 or int16 samples, 1-D; got shape "
                             f"{np.shape(samples)} (mix channels down first, e.g. samples.mean(axis=1))")
        if self.binary:
            return await self._send_binary(lambda seq: binary_audio(seq, pcm16_bytes(samples)))
        return await self.send("input_audio_buffer.append", audio=base64.b64encode(pcm16_bytes(samples)).decode())

    async def append_frame(self, image: np.ndarray | bytes, timestamp: float) -> str:
        data = image if isinstance(image, bytes) else encode_jpeg(image)
        if self.binary:
            return await self._send_binary(lambda seq: binary_frame(seq, timestamp, data))
        return await self.send("runtime.input_video_frame.append", image=base64.b64encode(data).decode(),
                               timestamp=timestamp)

    async def _send_binary(self, build: Callable[[int], bytes]) -> str:
        assert self.ws is not None, "connect() first"
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        await self.ws.send(build(self._seq))
        return f"bin-{self._seq}"

    async def ask(self, text: str) -> str:
        """conversation.item.create then response.create; returns the response.create event_id. While another
        response is queued or answering, the server refuses the response.create
        (`conversation_already_has_active_response`) and keeps the item: the next request answers it too."""
        await self.send("conversation.item.create",
                        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        return await self.send("response.create")

    async def cancel(self, response_id: str | None = None) -> str:
        return await self.send("response.cancel", **({"response_id": response_id} if response_id else {}))

    async def commit(self) -> str:
        """End the user's turn: the audio so far becomes a user item (turn detection does this by itself)."""
        return await self.send("input_audio_buffer.commit")

    async def clear(self) -> str:
        return await self.send("input_audio_buffer.clear")

    async def finish(self) -> str:
        """No more input: the server transcribes and answers what is pending, then closes with 1000."""
        return await self.send("runtime.session.finish")

    async def events(self) -> AsyncIterator[Event]:
        """Server events, in order, until the connection closes. It ends quietly on 1000 (after commit, once
        drained), 1001 (the server shutting down) and 1013 (busy: a `server_busy` error event came first);
        `close_code` tells which. Any other ending (the connection dropped: 1006; a server error: 1011) raises
        `websockets.exceptions.ConnectionClosedError` after every event received was yielded, so a failed
        session is never mistaken for a finished one. Forward compatible: unknown fields are dropped, messages
        of an unknown type are skipped with a logged warning (`read_server_event`)."""
        assert self.ws is not None, "connect() first"
        if self.created is not None:
            first, self.created = self.created, None
            yield first
        try:
            async for message in self.ws:
                if (event := read_server_event(message)) is not None:
                    yield event
        except ConnectionClosedError as exc:
            if exc.rcvd is None or exc.rcvd.code not in QUIET_CLOSE_CODES:
                raise

    async def speak(self, *, format: dict[str, object] | None = None, voice: str | None = None,
                    speed: float | None = None) -> str:
        """Ask for spoken answers from now on (`output_modalities: ["audio"]`): `format` as the API's
        (`{"type": "audio/pcm", "rate": 24000}` by default, `audio/pcmu`, `audio/pcma`), the server's `voice`, a
        `speed` from 0.25 to 1.5. Their audio then comes as `ResponseAudioDelta` events (`event.audio()`)."""
        output = {k: v for k, v in (("format", format), ("voice", voice), ("speed", speed)) if v is not None}
        return await self.update_session(output_modalities=["audio"], **({"audio": {"output": output}} if output
                                                                         else {}))

    async def audio_chunks(self) -> AsyncIterator[tuple[str, bytes]]:
        """(item_id, audio bytes) of every spoken answer, in order, as `events()` reads them (it consumes the events:
        use `events()` and `ResponseAudioDelta.audio()` to see the rest too)."""
        async for event in self.events():
            if isinstance(event, ResponseAudioDelta):
                yield event.item_id, event.audio()

    async def stream_file(self, path: str | Path, speed: float = 0.0, *, fps: float = 1.0) -> float:
        """Send a media file's audio (and frames as JPEG, `fps` per second); returns the media seconds sent.
        `speed` 1.0 paces it in real time; 0 sends as fast as the server takes it."""
        from runtime.io.file_source import FileSource

        return await self.stream_source(FileSource(path, speed=speed, fps=fps))

    async def stream_microphone(self, device: str = "default", *, backend: str = "alsa",
                                seconds: float | None = None) -> float:
        """Send a capture device's audio as it is recorded, for `seconds` (None: until cancelled)."""
        from runtime.io.devices import MicrophoneSource

        return await self.stream_source(MicrophoneSource(device, backend=backend), seconds=seconds)

    async def stream_source(self, source: Source, *, seconds: float | None = None) -> float:
        """Send what a `runtime.io` source yields (audio chunks, frames) until it ends or `seconds` of media;
        the source is closed either way. Returns the media seconds sent."""
        reached = 0.0
        try:
            async for item in source:
                if isinstance(item, AudioChunk):
                    await self.append_audio(item.samples)
                    reached = max(reached, item.end)
                else:
                    await self.append_frame(item.image, item.time)
                    reached = max(reached, item.time)
                if seconds is not None and reached >= seconds:
                    break
        finally:
            await source.aclose()
        return reached


class RealtimeClient:
    """The same SDK for code without an event loop: a private loop runs in a daemon thread and each call
    waits for its coroutine there.

        with RealtimeClient("ws://127.0.0.1:8765/v1/realtime") as client:
            client.stream_file("talk.mp4")
            client.ask("what was the plan?")
            client.finish()
            for event in client.events():
                print(event.to_json())

    A failed `connect()` closes the client (its thread ends); `close()` may be called any number of times, and
    any other call after it raises `RuntimeError("RealtimeClient is closed")`.
    """

    THREAD_NAME = "realtime-client"

    def __init__(self, url: str, *, token: str | None = None, max_size: int = 16 * 1024 * 1024,
                 binary: bool = False, keepalive_s: float = 20.0, answer_turns: bool = False) -> None:
        self._async = AsyncRealtimeClient(url, token=token, max_size=max_size, binary=binary,
                                          keepalive_s=keepalive_s, answer_turns=answer_turns)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def _call(self, make: Callable[P, Coroutine[object, object, T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `make(*args, **kwargs)` (a coroutine function) on the private loop and wait for it. The
        coroutine is only created once the client is known to be open: one made for a stopped loop would
        never be awaited (a RuntimeWarning on top of the error)."""
        if self._closed:
            raise RuntimeError("RealtimeClient is closed")
        return asyncio.run_coroutine_threadsafe(make(*args, **kwargs), self._loop).result()

    def connect(self) -> RealtimeClient:
        """Connect; on failure the client is closed (its loop stopped, its thread joined) before the error
        propagates, so failed attempts leave no threads behind."""
        try:
            self._call(self._async.connect)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Close the connection and stop the private loop; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self._async.close(), self._loop).result()
                asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop).result()
        finally:
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._loop.is_running() and not self._loop.is_closed():
                self._loop.close()

    def __enter__(self) -> RealtimeClient:
        return self.connect()

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def close_code(self) -> int | None:
        return self._async.close_code

    def update_session(self, **session: object) -> str:
        return self._call(self._async.update_session, **session)

    def append_audio(self, samples: np.ndarray) -> str:
        return self._call(self._async.append_audio, samples)

    def append_frame(self, image: np.ndarray | bytes, timestamp: float) -> str:
        return self._call(self._async.append_frame, image, timestamp)

    def ask(self, text: str) -> str:
        return self._call(self._async.ask, text)

    def cancel(self, response_id: str | None = None) -> str:
        return self._call(self._async.cancel, response_id)

    def commit(self) -> str:
        return self._call(self._async.commit)

    def clear(self) -> str:
        return self._call(self._async.clear)

    def finish(self) -> str:
        return self._call(self._async.finish)

    def stream_file(self, path: str | Path, speed: float = 0.0, *, fps: float = 1.0) -> float:
        return self._call(self._async.stream_file, path, speed, fps=fps)

    def stream_microphone(self, device: str = "default", *, backend: str = "alsa",
                          seconds: float | None = None) -> float:
        return self._call(self._async.stream_microphone, device, backend=backend, seconds=seconds)

    def events(self) -> Iterator[Event]:
        """Server events until the connection closes, one blocking wait per event; ends or raises as
        `AsyncRealtimeClient.events` does. Raises at once if the client is closed."""
        if self._closed:
            raise RuntimeError("RealtimeClient is closed")
        return self._iterate(self._async.events())

    def _iterate(self, stream: AsyncGenerator[Event, None]) -> Iterator[Event]:
        try:
            while True:
                try:
                    yield self._call(stream.__anext__)
                except StopAsyncIteration:
                    return
        finally:  # left early (break, an exception): finish the async generator on its own loop
            if not self._closed and threading.current_thread() is not self._thread:
                self._call(stream.aclose)
