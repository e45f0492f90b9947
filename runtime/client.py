"""A small async SDK for the websocket protocol (docs/protocol.md): send media and questions, read events.

    async with AsyncRealtimeClient("ws://127.0.0.1:8765/v1/realtime") as client:
        await client.append_audio(samples)          # float32 or int16, mono 16 kHz (or stream_file/_microphone)
        await client.ask("what moved?")
        await client.commit()
        async for event in client.events():         # runtime.events objects, in order
            ...
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from runtime.chunks import AudioChunk
from runtime.events import Event, new_id, parse_event
from runtime.web.protocol import binary_audio, binary_frame


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


class AsyncRealtimeClient:
    """`token`: the server's `--token`, sent as an `Authorization: Bearer` header (kept out of the URL, which
    tends to end up in logs). `binary`: send audio and frames as binary messages (docs/protocol.md, "Binary
    media"): no base64, a third less to send; their event ids are then `bin-SEQ`."""

    def __init__(self, url: str, *, token: str | None = None, max_size: int = 16 * 1024 * 1024,
                 binary: bool = False) -> None:
        self.url, self.token, self.max_size, self.binary = url, token, max_size, binary
        self.ws: ClientConnection | None = None
        self._seq = 0

    async def connect(self) -> AsyncRealtimeClient:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        self.ws = await connect(self.url, max_size=self.max_size, additional_headers=headers)
        return self

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()

    async def __aenter__(self) -> AsyncRealtimeClient:
        return await self.connect()

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    @property
    def close_code(self) -> int | None:
        return None if self.ws is None else self.ws.close_code

    async def send(self, type: str, **fields: Any) -> str:
        """Send one client event; returns its event_id (what `error.event_id` names if it is refused)."""
        assert self.ws is not None, "connect() first"
        event_id = fields.pop("event_id", None) or new_id("cevt")
        await self.ws.send(json.dumps({"type": type, "event_id": event_id, **fields}))
        return event_id

    async def update_session(self, **session: Any) -> str:
        return await self.send("session.update", session=session)

    async def append_audio(self, samples: np.ndarray) -> str:
        if self.binary:
            return await self._send_binary(lambda seq: binary_audio(seq, pcm16_bytes(samples)))
        return await self.send("input_audio_buffer.append", audio=base64.b64encode(pcm16_bytes(samples)).decode())

    async def append_frame(self, image: np.ndarray | bytes, timestamp: float) -> str:
        data = image if isinstance(image, bytes) else encode_jpeg(image)
        if self.binary:
            return await self._send_binary(lambda seq: binary_frame(seq, timestamp, data))
        return await self.send("input_video_frame.append", image=base64.b64encode(data).decode(),
                               timestamp=timestamp)

    async def _send_binary(self, build: Callable[[int], bytes]) -> str:
        assert self.ws is not None, "connect() first"
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        await self.ws.send(build(self._seq))
        return f"bin-{self._seq}"

    async def ask(self, text: str) -> str:
        """conversation.item.create then response.create; returns the response.create event_id."""
        await self.send("conversation.item.create",
                        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        return await self.send("response.create")

    async def cancel(self, response_id: str | None = None) -> str:
        return await self.send("response.cancel", **({"response_id": response_id} if response_id else {}))

    async def commit(self) -> str:
        return await self.send("input_audio_buffer.commit")

    async def events(self) -> AsyncIterator[Event]:
        """Server events until the connection closes: 1000 after commit once drained, 1013 when the server is
        busy (after a `server_busy` error). The iterator ends either way; `close_code` tells which."""
        assert self.ws is not None, "connect() first"
        try:
            async for message in self.ws:
                yield parse_event(message if isinstance(message, str) else message.decode())
        except ConnectionClosed:
            return

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

    async def stream_source(self, source: Any, *, seconds: float | None = None) -> float:
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
            client.commit()
            for event in client.events():
                print(event.to_json())
    """

    def __init__(self, url: str, *, token: str | None = None, **kwargs: Any) -> None:
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="realtime-client", daemon=True)
        self._thread.start()
        self._async = AsyncRealtimeClient(url, token=token, **kwargs)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def connect(self) -> RealtimeClient:
        self._call(self._async.connect())
        return self

    def close(self) -> None:
        """Close the connection and stop the private loop."""
        if self._loop.is_running():
            self._call(self._async.close())
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

    def update_session(self, **session: Any) -> str:
        return self._call(self._async.update_session(**session))

    def append_audio(self, samples: np.ndarray) -> str:
        return self._call(self._async.append_audio(samples))

    def append_frame(self, image: np.ndarray | bytes, timestamp: float) -> str:
        return self._call(self._async.append_frame(image, timestamp))

    def ask(self, text: str) -> str:
        return self._call(self._async.ask(text))

    def cancel(self, response_id: str | None = None) -> str:
        return self._call(self._async.cancel(response_id))

    def commit(self) -> str:
        return self._call(self._async.commit())

    def stream_file(self, path: str | Path, speed: float = 0.0, *, fps: float = 1.0) -> float:
        return self._call(self._async.stream_file(path, speed, fps=fps))

    def stream_microphone(self, device: str = "default", *, backend: str = "alsa",
                          seconds: float | None = None) -> float:
        return self._call(self._async.stream_microphone(device, backend=backend, seconds=seconds))

    def events(self) -> Iterator[Event]:
        """Server events until the connection closes, one blocking wait per event."""
        stream = self._async.events()
        while True:
            try:
                yield self._call(stream.__anext__())
            except StopAsyncIteration:
                return
