"""The plain HTTP beside the websocket on one port: the demo page's files, JSON answers, and one POST.

The websockets library serves HTTP only as far as its opening handshake needs: GET requests, answered from
`process_request`. WebRTC signalling is a `POST` with a JSON body, so `PostConnection` (given to `serve` as
its connection class) looks at the first bytes of each connection: a request of any method but GET and HEAD
is read here, head and body within fixed limits, and handed to `process_request` as a websockets `Request`
with its method and the body on `connection.body`; GET and HEAD go to websockets untouched. The answer then
travels the same path as any refused handshake, so the server has one routing function and one port.
"""

from __future__ import annotations

import dataclasses
import json
import mimetypes
from http import HTTPStatus
from pathlib import Path

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 256 * 1024  # an SDP offer is a few KiB
MAX_METHOD_BYTES = 16  # longer than any HTTP method


class PostConnection(ServerConnection):
    """A websockets server connection that also reads `POST` requests (see the module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:  # websockets' own arguments, passed through
        super().__init__(*args, **kwargs)
        self.body: bytes | None = None  # set for a POST once read whole
        self.post_error: HTTPStatus | None = None  # set instead when the POST could not be read
        self._buffer = bytearray()
        self._mode: str | None = None  # None until the method is known, then "post" or "websocket"

    def data_received(self, data: bytes) -> None:
        if self._mode == "websocket":
            return super().data_received(data)
        if self._mode == "post":
            if self.body is None:
                self._buffer += data
                self._read_post()
            return None
        self._buffer += data
        if b" " not in self._buffer[:MAX_METHOD_BYTES + 1]:
            if len(self._buffer) > MAX_METHOD_BYTES:  # no method at all: websockets' parser refuses it
                self._mode, pending = "websocket", bytes(self._buffer)
                self._buffer.clear()
                return super().data_received(pending)
            return None  # not enough to tell the method yet
        if self._buffer.startswith((b"GET ", b"HEAD ")):
            self._mode, pending = "websocket", bytes(self._buffer)
            self._buffer.clear()
            return super().data_received(pending)
        self._mode = "post"
        self._read_post()
        return None

    def _read_post(self) -> None:
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                self._deliver(Request("/", Headers(), method="POST"), error=HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
            return
        lines = bytes(self._buffer[:head_end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        headers = Headers()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep and name.strip():
                headers[name.strip()] = value.strip()
        request = Request(parts[1] if len(parts) == 3 else "/", headers, method=parts[0])
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return self._deliver(request, error=HTTPStatus.BAD_REQUEST)
        length = headers.get("Content-Length", "" if request.method == "POST" else "0")
        if not length.isdigit():
            return self._deliver(request, error=HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            return self._deliver(request, error=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        body = bytes(self._buffer[head_end + 4 :])
        if len(body) >= int(length):
            self._deliver(request, body=body[: int(length)])

    def _deliver(self, request: Request, *, body: bytes = b"", error: HTTPStatus | None = None) -> None:
        """What websockets' own parser does with a request it read: wake the handshake, which calls
        `process_request`; a request that could not be read arrives with `post_error` set instead."""
        if self.request_rcvd.done():
            return
        self.body, self.post_error = body, error
        self._buffer.clear()
        self.request = request
        self.request_rcvd.set_result(None)


def without_body(response: Response) -> Response:
    """The answer to HEAD: GET's status and headers (Content-Length included, as RFC 9110 allows), no body."""
    return dataclasses.replace(response, body=b"")


def _with_type(response: Response, kind: str, cache: str) -> Response:
    del response.headers["Content-Type"]  # websockets' Headers add a value on assignment: replace, not append
    response.headers["Content-Type"] = kind
    response.headers["Cache-Control"] = cache
    return response


def text_response(connection: ServerConnection, status: int, text: str, kind: str) -> Response:
    return _with_type(connection.respond(status, text), kind, "no-store")


def json_response(connection: ServerConnection, status: int, payload: object) -> Response:
    return _with_type(connection.respond(status, json.dumps(payload) + "\n"), "application/json", "no-store")


def error_response(connection: ServerConnection, status: int, message: str, code: str) -> Response:
    """An HTTP error with a body shaped like the `error` event, so a client parses one kind of error."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_response(connection, status, {"type": "error", "error": {"type": kind, "code": code,
                                                                         "message": message}})


def static_response(connection: ServerConnection, name: str) -> Response | None:
    """A file of the demo page from `runtime/web/static/`, or None when there is no such file."""
    path = (STATIC_DIR / name).resolve()
    if path.parent != STATIC_DIR or not path.is_file():  # no climbing out of the folder
        return None
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if kind.startswith("text/") or kind.endswith("javascript"):
        kind += "; charset=utf-8"
    response = connection.respond(200, path.read_text(encoding="utf-8"))
    return _with_type(response, kind, "no-cache")
