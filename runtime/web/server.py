"""The websocket server: `GET /healthz` (JSON) and `GET /v1/realtime` (one session per connection).

Each connection gets one `Session` over the process's shared `Models` and `DeviceWorker`, and two tasks:
a reader that parses client frames (in a thread: base64 and image decoding cost CPU) and drives the session,
and a writer that forwards `session.events` as JSON text frames. Backpressure: `send` waits while a client
reads slowly, so the session's bounded event channel fills and then slows its processors; nothing is dropped
and nothing grows without bound. A bad client event is answered with an `error` event (error.event_id names
it) and the session keeps its state. A disconnect, clean or abrupt, stops the session at once.

Who may connect (checked in `_route`, before the upgrade, so a refused request never costs a session): with a
token set, every upgrade must carry it (`Authorization: Bearer TOKEN` or `?token=TOKEN`), else 401. A request
with an `Origin` header (a browser) must come from an allowed origin, else 403, so a page on another site cannot
drive the models through a visitor's browser; requests without one (the SDK, curl) pass. `/healthz` is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from runtime.chunks import SAMPLE_RATE
from runtime.config import Profile
from runtime.events import SessionUpdated, error_event
from runtime.io.rechunk import AudioRechunker
from runtime.metrics import LoopLagMonitor
from runtime.session import Models, Session
from runtime.web.protocol import (
    MAX_MESSAGE_BYTES,
    AppendAudio,
    AppendFrame,
    CancelResponse,
    Command,
    CommitInput,
    CreateItem,
    CreateResponse,
    ProtocolError,
    UpdateSession,
    parse_client_event,
)

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
DRAIN_TIMEOUT_S = 30.0  # after a disconnect during finish, how long pending work may take before it is cut


class RealtimeServer:
    """Start with `await start()`, stop with `await stop()`; `port` is the bound port (pass port=0 in tests).

    `token`: when set, required on every websocket upgrade. `allow_origins`: the browser origins admitted; None
    means the demo page's own (`http://127.0.0.1:PORT`, `http://localhost:PORT`, PORT the bound port)."""

    def __init__(self, profile: Profile, models: Models, worker: Any, *, host: str = "127.0.0.1",
                 port: int = 8765, max_sessions: int = 8, token: str | None = None,
                 allow_origins: Sequence[str] | None = None) -> None:
        self.profile, self.models, self.worker = profile, models, worker
        self.host, self.requested_port, self.max_sessions = host, port, max_sessions
        self.token = token or None  # an empty token would admit anyone with an empty one: treat it as unset
        self.allow_origins = None if allow_origins is None else {o.rstrip("/") for o in allow_origins}
        self.sessions: dict[str, Session] = {}
        self.loop_lag = LoopLagMonitor(interval_s=0.01)  # the whole server's loop: every session shares it
        self._server: Server | None = None

    async def start(self) -> RealtimeServer:
        # websockets closes with 1009 past max_size; keep that as the hard cap and answer anything between
        # MAX_MESSAGE_BYTES and it with an error event instead, so an oversized frame costs no session.
        self._server = await serve(self._handle, self.host, self.requested_port, process_request=self._route,
                                   max_size=2 * MAX_MESSAGE_BYTES, max_queue=16)
        self.loop_lag.start()
        return self

    async def stop(self) -> None:
        await self.loop_lag.stop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> RealtimeServer:
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(next(iter(self._server.sockets)).getsockname()[1])

    def health(self, window_s: float = 10.0) -> dict[str, Any]:
        """What /healthz answers; `loop_lag_ms` covers the last `window_s` seconds (`?window=S`)."""
        return {
            "status": "ok",
            "device": self.profile.device,
            "profile": self.profile.name,
            "sessions": len(self.sessions),
            "max_sessions": self.max_sessions,
            "loop_lag_ms": self.loop_lag.percentiles(window_s),
            "rss_mb": round(rss_mb(), 1),
            "queues": {sid: {c.name: len(c) for c in (s.audio_in, s.video_in, s.questions, s.events)}
                       for sid, s in self.sessions.items()},
            "worker": self.worker.stats(),
        }

    def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        path, _, query = request.path.partition("?")
        if path == "/healthz":
            try:
                window = min(max(float(parse_qs(query).get("window", ["10"])[0]), 0.1), 3600.0)
            except ValueError:
                return connection.respond(400, "window must be a number of seconds\n")
            response = connection.respond(200, json.dumps(self.health(window)) + "\n")
            response.headers["Content-Type"] = "application/json"
            return response
        if path != REALTIME_PATH:
            return connection.respond(404, f"not found; the websocket is at {REALTIME_PATH}\n")
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/") not in self._allowed_origins():
            return connection.respond(403, f"origin {origin} is not allowed; start the server with "
                                           "--allow-origin to admit it\n")
        if self.token is not None and not self._token_ok(request, query):
            return connection.respond(401, "missing or wrong token; send Authorization: Bearer TOKEN "
                                           "or ?token=TOKEN\n")
        return None

    def _allowed_origins(self) -> set[str]:
        if self.allow_origins is not None:
            return self.allow_origins
        return {f"http://127.0.0.1:{self.port}", f"http://localhost:{self.port}"}

    def _token_ok(self, request: Request, query: str) -> bool:
        """The header or the query parameter (browsers cannot set headers on a websocket), compared in
        constant time so the response time says nothing about how much of a guess was right."""
        assert self.token is not None
        expected = self.token.encode()
        candidates = parse_qs(query).get("token", [])
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            candidates.append(credentials.strip())
        return any(hmac.compare_digest(c.encode(), expected) for c in candidates)

    async def _handle(self, ws: ServerConnection) -> None:
        if len(self.sessions) >= self.max_sessions:
            busy = error_event(f"server is at its limit of {self.max_sessions} sessions; try again later",
                               code="server_busy", type="server_error")
            with contextlib.suppress(ConnectionClosed):
                await ws.send(busy.to_json())
                await ws.close(1013, "server busy")
            return
        session = Session(self.profile, self.models, self.worker)
        self.sessions[session.id] = session  # before any await: the limit check above cannot race
        connection = _Connection(ws, session, self.profile)
        try:
            await connection.run()
        finally:
            self.sessions.pop(session.id, None)


class _Connection:
    """One websocket and its session: the reader and writer tasks and the state between client events."""

    def __init__(self, ws: ServerConnection, session: Session, profile: Profile) -> None:
        self.ws, self.session, self.profile = ws, session, profile
        self.rechunker = AudioRechunker(SAMPLE_RATE * profile.pipeline.audio_chunk_ms // 1000)
        self.pending_text: list[str] = []
        self.finishing: asyncio.Task[None] | None = None

    async def run(self) -> None:
        session = self.session
        writer: asyncio.Task[None] | None = None
        reader: asyncio.Task[None] | None = None
        try:
            await session.start()
            writer = asyncio.create_task(self._write(), name=f"{session.id}:ws-writer")
            reader = asyncio.create_task(self._read(), name=f"{session.id}:ws-reader")
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done():  # drained after commit: say goodbye; the reader ends when the close completes
                with contextlib.suppress(ConnectionClosed):
                    await self.ws.close(1000, "session finished")
        finally:
            await self._cleanup(reader, writer)

    async def _cleanup(self, reader: asyncio.Task[None] | None, writer: asyncio.Task[None] | None) -> None:
        session = self.session
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if writer is not None:  # client gone: discard events so emit never blocks
            writer.cancel()  # a no-op when it is done, e.g. after ConnectionClosed on a client that vanished:
            await asyncio.gather(writer, return_exceptions=True)  # retrieve that, or asyncio logs it at GC
        sink = asyncio.create_task(self._discard())
        if self.finishing is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.finishing), DRAIN_TIMEOUT_S)
            except Exception:
                log.warning("session %s: finishing after disconnect failed or timed out", session.id)
        if self.finishing is None or not self.finishing.done():
            if self.finishing is not None:
                self.finishing.cancel()
                await asyncio.gather(self.finishing, return_exceptions=True)
            await session.stop()
        session.events.close()
        sink.cancel()
        await asyncio.gather(sink, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.ws.close()

    async def _discard(self) -> None:
        async for _ in self.session.events:
            pass

    async def _write(self) -> None:
        async for event in self.session.events:
            await self.ws.send(event.to_json())

    async def _read(self) -> None:
        async for message in self.ws:
            try:
                command = await asyncio.to_thread(parse_client_event, message, max_side=self.profile.video.max_side)
            except ProtocolError as e:
                await self._reply_error(e)
                continue
            try:
                await self._apply(command)
            except ProtocolError as e:
                e.event_id = command.event_id
                await self._reply_error(e)

    async def _reply_error(self, error: ProtocolError) -> None:
        event = error.to_event(media_time=self.session.media_time)
        if self.session.events.closed:  # after commit the session is gone; tell the client directly
            await self.ws.send(event.to_json())
        else:
            await self.session.emit(event)

    async def _apply(self, command: Command) -> None:
        session = self.session
        if self.finishing is not None:
            raise ProtocolError("the input was committed; this session takes no more events",
                                code="input_committed")
        if isinstance(command, AppendAudio):
            for chunk in self.rechunker.push(command.samples):
                await session.push_audio(chunk)
        elif isinstance(command, AppendFrame):
            assert command.frame is not None
            session.push_video(command.frame)
        elif isinstance(command, CreateItem):
            if len(self.pending_text) >= 16:
                raise ProtocolError("too many items waiting for response.create", code="too_many_items")
            self.pending_text.append(command.text)
        elif isinstance(command, CreateResponse):
            if not self.pending_text:
                raise ProtocolError("response.create needs a conversation.item.create with the question first",
                                    code="no_pending_item")
            text, self.pending_text = " ".join(self.pending_text), []
            await session.ask(text, client_event_id=command.event_id)
        elif isinstance(command, CancelResponse):
            if not session.cancel_response(command.response_id):
                raise ProtocolError("no response in progress to cancel", code="response_not_found",
                                    param="response_id" if command.response_id else None)
        elif isinstance(command, UpdateSession):
            await session.emit(SessionUpdated(session={**session.describe(), **command.session},
                                              media_time=session.media_time))
        elif isinstance(command, CommitInput):
            for chunk in self.rechunker.flush():
                await session.push_audio(chunk)
            self.finishing = asyncio.create_task(session.finish(), name=f"{session.id}:finish")


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), or 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


async def run_server(profile: Profile, models: Models, worker: Any, *, host: str = "127.0.0.1", port: int = 8765,
                     max_sessions: int = 8, token: str | None = None, allow_origins: Sequence[str] | None = None,
                     ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; sets `ready` once the socket is bound. `token`, `allow_origins`: RealtimeServer's."""
    server = await RealtimeServer(profile, models, worker, host=host, port=port, max_sessions=max_sessions,
                                  token=token, allow_origins=allow_origins).start()
    log.info("serving ws://%s:%d%s and http://%s:%d/healthz", host, server.port, REALTIME_PATH, host, server.port)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Future()
    finally:
        await server.stop()
