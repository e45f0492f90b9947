"""Client events of the websocket protocol, parsed and validated into typed commands.

Pure functions, no I/O: the server calls `parse_client_event` (in a thread, since base64 and image decoding
cost CPU) and either gets a command to act on or a `ProtocolError` that it turns into an `error` event naming
the client event at fault. Names follow the OpenAI Realtime API so its clients need no translation table;
see docs/protocol.md for a worked example of each message.

Binary messages are the media fast path (no base64, no JSON): a 5-byte header, kind then a client-chosen
sequence number that names the message in errors as `bin-SEQ`, then the payload:

    b"A" | u32 LE seq | PCM16 little-endian mono 16 kHz                       (= input_audio_buffer.append)
    b"V" | u32 LE seq | f64 LE timestamp (media seconds) | JPEG or PNG bytes   (= input_video_frame.append)
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, TypeVar

import av
import numpy as np

from runtime.chunks import VideoFrame
from runtime.events import Error, error_event
from runtime.io.file_source import scaled_size

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a client message larger than this is answered with an error
MAX_IMAGE_PIXELS = 4096 * 4096  # a decoded frame larger than this is refused before conversion to RGB
_EVENT_ID = re.compile(r'"event_id"\s*:\s*"([^"\\]{1,128})"')
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into JSON text
_SURROGATE = re.compile("[\ud800-\udfff]")
MODALITIES = {"text", "audio"}
ALLOWED_SESSION_FIELDS = {"input_audio_format", "modalities"}
BINARY_AUDIO, BINARY_FRAME = b"A"[0], b"V"[0]
BINARY_HEADER = struct.Struct("<BI")  # kind, sequence number
BINARY_TIMESTAMP = struct.Struct("<d")

K = TypeVar("K")  # the type a client event's field must have


class ProtocolError(ValueError):
    """A client event the server cannot act on; recoverable: the session keeps its state."""

    def __init__(self, message: str, *, code: str, param: str | None = None, event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.event_id = message, code, param, event_id

    def to_event(self, media_time: float | None = None) -> Error:
        return error_event(self.message, code=self.code, param=self.param, client_event_id=self.event_id,
                           media_time=media_time)


@dataclass(frozen=True)
class Command:
    event_id: str | None


@dataclass(frozen=True)
class UpdateSession(Command):
    session: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AppendAudio(Command):
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 mono 16 kHz


@dataclass(frozen=True)
class AppendFrame(Command):
    frame: VideoFrame | None = None


@dataclass(frozen=True)
class CreateItem(Command):
    text: str = ""


@dataclass(frozen=True)
class CreateResponse(Command):
    pass


@dataclass(frozen=True)
class CancelResponse(Command):
    response_id: str | None = None


@dataclass(frozen=True)
class CommitInput(Command):
    """End of the input: flush the audio, finish the session, close once its events are out."""


def event_id_of(message: str) -> str | None:
    """The `event_id` of a message that is not parsed (too large, too deep, or on a read-only connection),
    when it comes early in the text, as the SDK sends it."""
    found = _EVENT_ID.search(message[:1024])
    return found.group(1) if found else None


def parse_client_event(message: str | bytes, *, max_side: int = 640) -> Command:
    """One websocket message -> a command, or `ProtocolError` with a code a client can branch on."""
    if isinstance(message, bytes):
        return parse_binary(message, max_side=max_side)
    if len(message) > MAX_MESSAGE_BYTES:
        # Not parsed (that is the cost being refused); its event_id is found when it comes early, as the SDK sends it.
        raise ProtocolError(f"message of {len(message)} characters exceeds {MAX_MESSAGE_BYTES}",
                            code="message_too_large", event_id=event_id_of(message))
    try:
        data = json.loads(message)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"invalid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ProtocolError("invalid JSON: nested too deeply", code="invalid_json",
                            event_id=event_id_of(message)) from None
    if not isinstance(data, dict):
        raise ProtocolError("a client event is a JSON object", code="invalid_event")
    event_id = data.get("event_id")
    if _SURROGATE_ESCAPE.search(message) and _holds_lone_surrogate(data):
        # JSON may escape half a UTF-16 pair; such a string cannot be tokenized, nor sent back as UTF-8
        clean_id = isinstance(event_id, str) and not _holds_lone_surrogate(event_id)
        raise ProtocolError("a string holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape)",
                            code="invalid_json", event_id=event_id if clean_id else None)
    if event_id is not None and not isinstance(event_id, str):
        raise ProtocolError("event_id must be a string", code="invalid_value", param="event_id")
    if "type" not in data:
        raise ProtocolError(f"a client event needs a 'type', one of {sorted(_PARSERS)}", code="missing_field",
                            param="type", event_id=event_id)
    kind = data.get("type")
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise ProtocolError(f"unknown client event type {kind!r}; expected one of {sorted(_PARSERS)}",
                            code="unknown_event_type", param="type", event_id=event_id)
    try:
        return parser(data, event_id, max_side)
    except ProtocolError as e:
        e.event_id = event_id
        raise


def _holds_lone_surrogate(data: object) -> bool:
    """Whether any key or string value of parsed JSON holds a surrogate code point (json.loads joins escaped
    pairs into one character, so what is left is unpaired). A loop, not recursion: the nesting is the client's."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return True
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def binary_audio(seq: int, pcm16: bytes) -> bytes:
    """The binary fast path's audio message (what the SDK sends with `binary=True`)."""
    return BINARY_HEADER.pack(BINARY_AUDIO, seq & 0xFFFFFFFF) + pcm16


def binary_frame(seq: int, timestamp: float, image: bytes) -> bytes:
    return BINARY_HEADER.pack(BINARY_FRAME, seq & 0xFFFFFFFF) + BINARY_TIMESTAMP.pack(timestamp) + image


def parse_binary(message: bytes, *, max_side: int = 640) -> Command:
    """One binary websocket message (the media fast path, see the module docstring) -> a command."""
    if len(message) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE_BYTES}", code="message_too_large")
    if len(message) < BINARY_HEADER.size:
        raise ProtocolError(f"binary message of {len(message)} bytes is shorter than its {BINARY_HEADER.size}-byte "
                            "header (kind, u32 sequence)", code="invalid_binary_header")
    kind, seq = BINARY_HEADER.unpack_from(message)
    event_id = f"bin-{seq}"
    body = memoryview(message)[BINARY_HEADER.size :]
    try:
        if kind == BINARY_AUDIO:
            return AppendAudio(event_id, decode_pcm16(bytes(body)))
        if kind == BINARY_FRAME:
            if len(body) < BINARY_TIMESTAMP.size:
                raise ProtocolError("binary frame message ends before its f64 timestamp", code="invalid_binary_header")
            (timestamp,) = BINARY_TIMESTAMP.unpack_from(body)
            if not timestamp >= 0 or timestamp == float("inf"):
                raise ProtocolError("timestamp must be finite media seconds >= 0", code="invalid_value",
                                    param="timestamp")
            image = decode_image(bytes(body[BINARY_TIMESTAMP.size :]), max_side)
            return AppendFrame(event_id, VideoFrame(image, timestamp))
        raise ProtocolError(f"unknown binary message kind 0x{kind:02x}; expected 0x41 'A' (audio) or 0x56 'V' "
                            "(frame)", code="invalid_binary_header")
    except ProtocolError as e:
        e.event_id = event_id
        raise


def _field(data: dict[str, Any], name: str, kind: type[K] | tuple[type[K], ...], what: str) -> K:
    if name not in data:
        raise ProtocolError(f"{data['type']}: missing '{name}' ({what})", code="missing_field", param=name)
    value = data[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProtocolError(f"{data['type']}: '{name}' must be {what}", code="invalid_value", param=name)
    return value


def _b64(data: dict[str, Any], name: str, what: str) -> bytes:
    text = _field(data, name, str, f"base64 {what}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{data['type']}: '{name}' is not valid base64", code="invalid_base64",
                            param=name) from None


def _session_update(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    session = _field(data, "session", dict, "an object")
    for key, value in session.items():
        if key not in ALLOWED_SESSION_FIELDS:
            raise ProtocolError(f"session.{key} cannot be changed on this server (the profile fixes it)",
                                code="unsupported_field", param=f"session.{key}")
        if key == "input_audio_format" and value != "pcm16":
            raise ProtocolError("input_audio_format must be 'pcm16' (16 kHz mono little-endian)",
                                code="invalid_value", param="session.input_audio_format")
        if key == "modalities" and not (isinstance(value, list) and all(isinstance(m, str) for m in value)
                                        and "text" in value and set(value) <= MODALITIES
                                        and len(set(value)) == len(value)):
            raise ProtocolError("modalities must be a list holding 'text' (and optionally 'audio', each once); "
                                "this server answers in text", code="invalid_value", param="session.modalities")
    return UpdateSession(event_id, dict(session))


def decode_pcm16(raw: bytes) -> np.ndarray:
    """PCM16 little-endian mono bytes -> float32 in [-1, 1]."""
    if len(raw) % 2:
        raise ProtocolError(f"PCM16 audio has an odd number of bytes ({len(raw)})", code="invalid_audio",
                            param="audio")
    return (np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0).astype(np.float32)


def _audio_append(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    return AppendAudio(event_id, decode_pcm16(_b64(data, "audio", "PCM16 LE mono 16 kHz")))


def decode_image(raw: bytes, max_side: int = 640) -> np.ndarray:
    """JPEG or PNG bytes -> RGB uint8 [H, W, 3], shrunk so its longer side is at most `max_side`."""
    try:
        with av.open(io.BytesIO(raw)) as container:
            frame = next(container.decode(video=0))
            if frame.width * frame.height > MAX_IMAGE_PIXELS:
                raise ProtocolError(f"image of {frame.width}x{frame.height} is too large", code="image_too_large",
                                    param="image")
            width, height = scaled_size(frame.width, frame.height, max_side)
            return frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
    except ProtocolError:
        raise
    except (av.FFmpegError, StopIteration, ValueError, IndexError) as e:
        raise ProtocolError(f"image could not be decoded as JPEG or PNG: {e}", code="invalid_image",
                            param="image") from None


def _frame_append(data: dict[str, Any], event_id: str | None, max_side: int) -> Command:
    raw = _b64(data, "image", "JPEG or PNG")
    timestamp = float(_field(data, "timestamp", (int, float), "media seconds >= 0"))
    if not timestamp >= 0 or timestamp == float("inf"):
        raise ProtocolError("timestamp must be finite media seconds >= 0", code="invalid_value", param="timestamp")
    return AppendFrame(event_id, VideoFrame(decode_image(raw, max_side), timestamp))


def _item_create(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    item = _field(data, "item", dict, "an object")
    if item.get("type", "message") != "message" or item.get("role", "user") != "user":
        raise ProtocolError("only user message items are supported", code="unsupported_item", param="item.type")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError("item.content must be a non-empty list", code="missing_field", param="item.content")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "input_text" or not isinstance(part.get("text"), str):
            raise ProtocolError(f"item.content[{i}] must be {{'type': 'input_text', 'text': str}}",
                                code="invalid_value", param=f"item.content[{i}]")
        texts.append(part["text"])
    return CreateItem(event_id, " ".join(texts))


def _response_create(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    return CreateResponse(event_id)


def _response_cancel(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    response_id = data.get("response_id")
    if response_id is not None and not isinstance(response_id, str):
        raise ProtocolError("response_id must be a string", code="invalid_value", param="response_id")
    return CancelResponse(event_id, response_id)


def _commit(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    return CommitInput(event_id)


_PARSERS = {
    "session.update": _session_update,
    "input_audio_buffer.append": _audio_append,
    "input_video_frame.append": _frame_append,
    "conversation.item.create": _item_create,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
    "input_audio_buffer.commit": _commit,
}
