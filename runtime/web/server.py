"""The server: one port for the demo page, `/healthz`, websocket sessions and WebRTC signalling.

Routes (all in `_route`, websockets' `process_request`, so a refused request never costs a session):
`GET /` and `GET /static/NAME` the browser demo page; `GET /healthz` JSON; `GET /readyz` (200 or 503, for a load
balancer) and `GET /metrics` (Prometheus; observability.py); `GET /v1/realtime` upgrades to a
websocket, one session per connection; `POST /v1/webrtc/offer` takes a browser's SDP offer and answers it, one
session per peer (webrtc.py; `http.py` lets the websockets library read that POST). Either way the session is
driven by a `SessionDriver` (driver.py): client events in, server events out, errors as `error` events.

Who may connect: with a token set, every upgrade and offer must carry it (`Authorization: Bearer TOKEN` or
`?token=TOKEN`), else 401. A request with an `Origin` header (a browser) must come from an allowed origin, else
403, so a page on another site cannot drive the models through a visitor's browser; requests without one (the
SDK, curl) pass. The page, `/healthz`, `/readyz` and `/metrics` are open. At `max_sessions` live sessions,
websockets and WebRTC alike, the next gets `server_busy` (a websocket error event then close 1013; HTTP 503 for
an offer).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from runtime.config import Profile
from runtime.events import error_event
from runtime.loaded_models import Models
from runtime.metrics import LoopLagMonitor, rss_mb
from runtime.session import Session
from runtime.session_builder import initial_config, open_session
from runtime.session_state import TransportStats
from runtime.web.binary_messages import MAX_MESSAGE_BYTES
from runtime.web.broadcast import Broadcast
from runtime.web.driver import SessionDriver
from runtime.web.http import (
    PostConnection,
    error_response,
    json_response,
    static_response,
    text_response,
    without_body,
)
from runtime.web.observability import ServerMetrics
from runtime.web.protocol import event_id_of
from runtime.worker import DeviceWorker

if TYPE_CHECKING:
    from runtime.web.webrtc import WebRTCPeer

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
OFFER_PATH = "/v1/webrtc/offer"
WATCH_PATH = "/v1/watch"


class RealtimeServer:
    """Start with `await start()`, stop with `await stop()`; `port` is the bound port (pass port=0 in tests).

    `token`: when set, required on every websocket upgrade. `allow_origins`: the browser origins admitted; None
    means the demo page's own (`http://127.0.0.1:PORT`, `http://localhost:PORT`, PORT the bound port).

    `keepalive_s`: how often each websocket is pinged, so proxies keep quiet connections open. A late pong
    never closes one: flow control (docs/protocol.md) stops reading a client that sends faster than the models
    run, and a client that stops reading stops answering, so a pong can trail by as long as the backlog
    takes; websockets' heartbeat would close those sessions with 1011. A peer that vanished is found by TCP
    instead, once the pings go unacknowledged (Linux gives up after about 15 minutes)."""

    def __init__(self, profile: Profile, models: Models, worker: DeviceWorker, *, host: str = "127.0.0.1",
                 port: int = 8765, max_sessions: int = 8, token: str | None = None,
                 allow_origins: Sequence[str] | None = None, keepalive_s: float = 20.0,
                 local: Broadcast | None = None) -> None:
        self.profile, self.models, self.worker = profile, models, worker
        self.keepalive_s = keepalive_s
        self.host, self.requested_port, self.max_sessions = host, port, max_sessions
        self.token = token or None  # an empty token would admit anyone with an empty one: treat it as unset
        self.allow_origins = None if allow_origins is None else {o.rstrip("/") for o in allow_origins}
        self.sessions: dict[str, Session] = {}
        self._opening = 0  # sessions being built: they hold a slot before their first await
        self.peers: set[asyncio.Task[None]] = set()  # one per WebRTC peer, cancelled by stop()
        self.local = local  # the terminal's own session (serve --camera/--source) that browsers may watch
        self.loop_lag = LoopLagMonitor(interval_s=0.01)  # the whole server's loop: every session shares it
        self.metrics = ServerMetrics(self)  # /readyz and /metrics
        self._server: Server | None = None

    async def start(self) -> RealtimeServer:
        # websockets closes with 1009 past max_size; keep that as the hard cap and answer anything between
        # MAX_MESSAGE_BYTES and it with an error event instead, so an oversized frame costs no session.
        self._server = await serve(self._handle, self.host, self.requested_port, process_request=self._route,
                                   create_connection=PostConnection, max_size=2 * MAX_MESSAGE_BYTES, max_queue=16,
                                   ping_interval=self.keepalive_s, ping_timeout=None)
        self.loop_lag.start()
        return self

    async def stop(self) -> None:
        await self.loop_lag.stop()
        for peer in list(self.peers):
            peer.cancel()
        await asyncio.gather(*self.peers, return_exceptions=True)
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

    def health(self, window_s: float = 10.0) -> dict[str, object]:
        """What /healthz answers; `loop_lag_ms` covers the last `window_s` seconds (`?window=S`)."""
        return {
            "status": "ok",
            "device": self.profile.device,
            "profile": self.profile.name,
            "sessions": len(self.sessions),
            "max_sessions": self.max_sessions,
            "local": None if self.local is None else {"source": self.local.description,
                                                      "watchers": len(self.local.watchers)},
            "loop_lag_ms": self.loop_lag.percentiles(window_s),
            "rss_mb": round(rss_mb()[0], 1),
            "queues": {sid: {c.name: len(c) for c in (s.audio_in, s.video_in, s.questions, s.events)}
                       for sid, s in self.sessions.items()},
            "worker": self.worker.stats(),
        }

    async def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        response = await self._answer(connection, request)
        return without_body(response) if response is not None and request.method == "HEAD" else response

    async def _answer(self, connection: ServerConnection, request: Request) -> Response | None:
        path, _, query = request.path.partition("?")
        pages = path in ("/", "/index.html", "/healthz", "/readyz", "/metrics") or path.startswith("/static/")
        allowed = "GET, HEAD" if pages else "POST" if path == OFFER_PATH else "GET" if path in (
            REALTIME_PATH, WATCH_PATH) else None  # None: no such path, whatever the method (404 below)
        if allowed is not None and request.method not in allowed.split(", "):
            response = error_response(connection, 405, f"{request.method} is not served at {path}; use {allowed}",
                                      "method_not_allowed")
            response.headers["Allow"] = allowed
            return response
        if isinstance(connection, PostConnection) and connection.body is not None:
            if connection.post_error is not None:
                return error_response(connection, connection.post_error.value, connection.post_error.phrase,
                                      "bad_http_request")
            if path != OFFER_PATH:
                return error_response(connection, 404, f"nothing to {request.method} at {path}; WebRTC offers "
                                                       f"are POSTed to {OFFER_PATH}", "not_found")
            return self._admit(connection, request, query) or await self._offer(connection, connection.body)
        if path == "/healthz":
            try:
                window = float(parse_qs(query).get("window", ["10"])[0])
            except ValueError:
                window = math.nan
            if not math.isfinite(window):
                return connection.respond(400, "window must be a number of seconds\n")
            window = min(max(window, 0.1), 3600.0)
            return json_response(connection, 200, self.health(window))
        if path == "/readyz":
            ready, why = await self.metrics.ready()
            return json_response(connection, 200 if ready else 503, {"status": "ready" if ready else "not_ready",
                                                                     "reason": why})
        if path == "/metrics":
            return text_response(connection, 200, self.metrics.text().decode(), CONTENT_TYPE_LATEST)
        if path in ("/", "/index.html") or path.startswith("/static/"):
            page = static_response(connection, "index.html" if path in ("/", "/index.html") else path[8:])
            return page or connection.respond(404, f"no file {path}\n")
        if path == WATCH_PATH and self.local is None:
            return connection.respond(404, "no local session to watch: start runtime serve with --camera, --mic "
                                           "or --source\n")
        if path not in (REALTIME_PATH, WATCH_PATH):
            return connection.respond(404, f"not found; the websocket is at {REALTIME_PATH}\n")
        return self._admit(connection, request, query)

    def _admit(self, connection: ServerConnection, request: Request, query: str) -> Response | None:
        """None when the request may open a session (origin and token), else the refusal."""
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/") not in self._allowed_origins():
            return error_response(connection, 403, f"origin {origin} is not allowed; start the server with "
                                                   "--allow-origin to admit it", "origin_not_allowed")
        if self.token is not None and not self._token_ok(request, query):
            return error_response(connection, 401, "missing or wrong token; send Authorization: Bearer TOKEN "
                                                   "or ?token=TOKEN", "unauthorized")
        return None

    async def _offer(self, connection: ServerConnection, body: bytes) -> Response:
        """WebRTC signalling: the browser's offer in, our answer out; the peer then runs as its own task."""
        from runtime.web.webrtc import WebRTCPeer  # aiortc loads only when a browser comes

        try:
            offer = json.loads(body)
        except ValueError:
            offer = None
        if not (isinstance(offer, dict) and offer.get("type") == "offer" and isinstance(offer.get("sdp"), str)):
            return error_response(connection, 400, 'the body must be JSON {"sdp": "...", "type": "offer"}',
                                  "invalid_offer")
        sdp = offer["sdp"].replace("\r\n", "\n")
        if "\nm=application" not in sdp:  # aiortc would answer even "x"
            return error_response(connection, 400, "the offer has no data channel: create one labelled 'events' "
                                                   "before createOffer (docs/protocol.md, WebRTC)", "invalid_offer")
        if "\na=fingerprint:" not in sdp:  # aiortc answers it, but DTLS can never start: a slot held for 30 s
            return error_response(connection, 400, "the offer has no DTLS fingerprint (a=fingerprint), so the "
                                                   "connection could never be secured", "invalid_offer")
        if self._full():
            return error_response(connection, 503, f"server is at its limit of {self.max_sessions} sessions; "
                                                   "try again later", "server_busy")
        stats = TransportStats()  # the peer's own measurements, which the session's metrics report
        session = await self._open(stats, answer_turns=False)  # the page captions; questions are typed
        peer = WebRTCPeer(session, self.profile, stats, observe=self.metrics.observe)
        try:
            answer = await peer.answer(offer["sdp"])
        except Exception as err:  # aiortc refuses an SDP it cannot use with ValueError and others
            self.sessions.pop(session.id, None)
            await peer.close()
            reason = str(err) or type(err).__name__  # some aiortc refusals carry no text
            return error_response(connection, 400, f"the offer could not be answered: {reason}", "invalid_offer")
        task = asyncio.create_task(self._run_peer(peer), name=f"{session.id}:webrtc")
        self.peers.add(task)
        task.add_done_callback(self.peers.discard)
        return json_response(connection, 200, {**answer, "session_id": session.id})

    def _full(self) -> bool:
        return len(self.sessions) + self._opening >= self.max_sessions

    async def _open(self, stats: TransportStats, *, answer_turns: bool) -> Session:
        """Build a session and register it; the slot is held from before the first await, so the limit check
        just made cannot race another connection."""
        self._opening += 1
        try:
            config = initial_config(self.profile, self.models, answer_turns=answer_turns)
            session = await open_session(self.profile, self.models, self.worker, transport=stats, config=config)
        finally:
            self._opening -= 1
        self.sessions[session.id] = session
        return session

    async def _run_peer(self, peer: WebRTCPeer) -> None:
        try:
            await peer.run()
        finally:
            self.sessions.pop(peer.session.id, None)

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
        if ws.request is not None and ws.request.path.partition("?")[0] == WATCH_PATH:
            return await self._watch(ws)
        if self._full():
            busy = error_event(f"server is at its limit of {self.max_sessions} sessions; try again later",
                               code="server_busy", type="server_error")
            with contextlib.suppress(ConnectionClosed):
                await ws.send(busy.to_json())
                await ws.close(1013, "server busy")
            return
        # the beta protocol's client (its header may come more than once: `get` would raise)
        beta = ws.request is not None and "realtime=v1" in ",".join(ws.request.headers.get_all("OpenAI-Beta"))
        stats = TransportStats()
        session = await self._open(stats, answer_turns=True)  # a Realtime client: each turn is answered
        try:
            driver = SessionDriver(session, self.profile, stats, observe=self.metrics.observe, beta_client=beta)
            if await driver.run(ws, ws.send):  # finished and drained: goodbye
                with contextlib.suppress(ConnectionClosed):
                    await ws.close(1000, "session finished")
        finally:
            self.sessions.pop(session.id, None)
            with contextlib.suppress(Exception):
                await ws.close()


    async def _watch(self, ws: ServerConnection) -> None:
        """A read-only view of the local session (broadcast.py): its events out; anything sent is refused."""
        watcher = self.local.watch() if self.local is not None else None
        if watcher is None:
            with contextlib.suppress(ConnectionClosed):
                await ws.close(1013, "too many watchers")
            return

        async def refuse_input() -> None:
            async for message in ws:
                refusal = error_event("this connection only watches the local session; open /v1/realtime to "
                                      "send media or questions", code="read_only",
                                      client_event_id=event_id_of(message) if isinstance(message, str) else None)
                await ws.send(refusal.to_json())

        reader = asyncio.create_task(refuse_input())
        behind = asyncio.create_task(watcher.behind.wait())

        async def unless_stopped(step: Coroutine[object, object, str | None]) -> tuple[bool, str | None]:
            """Run one step (a queue get, a send) unless the watcher leaves or falls behind meanwhile."""
            task = asyncio.create_task(step)
            done, _ = await asyncio.wait({task, reader, behind}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return True, task.result()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False, None

        try:
            while True:
                got, text = await unless_stopped(watcher.queue.get())
                if not got or not (await unless_stopped(ws.send(text)))[0]:
                    break
            if behind.done() and not reader.done():  # what is still queued is not sent: close at once
                with contextlib.suppress(ConnectionClosed):
                    await ws.close(1013, "fell behind; reconnect")
        except ConnectionClosed:
            pass
        finally:
            if self.local is not None:
                self.local.watchers.discard(watcher)
            for task in (reader, behind):
                task.cancel()
            await asyncio.gather(reader, behind, return_exceptions=True)


async def run_server(profile: Profile, models: Models, worker: DeviceWorker, *, host: str = "127.0.0.1",
                     port: int = 8765, max_sessions: int = 8, token: str | None = None,
                     allow_origins: Sequence[str] | None = None, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; sets `ready` once the socket is bound. `token`, `allow_origins`: RealtimeServer's."""
    server = await RealtimeServer(profile, models, worker, host=host, port=port, max_sessions=max_sessions,
                                  token=token, allow_origins=allow_origins).start()
    log.info("serving http://%s:%d/ (demo page, /healthz, %s) and ws://%s:%d%s", host, server.port, OFFER_PATH,
             host, server.port, REALTIME_PATH)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Future()
    finally:
        await server.stop()
