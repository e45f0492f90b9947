"""Client events of the websocket protocol, parsed and validated into typed commands.

Pure functions, no I/O: the server calls `parse_client_event` (in a thread, since base64 and image decoding
cost CPU) and either gets a command to act on or a `ProtocolError` that it turns into an `error` event naming
the client event at fault. Names follow the OpenAI Realtime API so its clients need no translation table;
see docs/protocol.md for a worked example of each message.

Binary messages (the media fast path: audio and frames with no base64 and no JSON) are framed and parsed in
`binary_messages.py`, which `parse_client_event` hands them to; it also decodes images (binary or base64 in
JSON alike) and holds the size bound of every client message.

Audio arrives as bytes in the session's `audio.input.format` (24 kHz PCM16 by default, as the API's; 16 kHz
PCM16, G.711 mu-law and A-law too); the driver's `AudioDecoder` turns them into the models' 16 kHz floats.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.chunks import VideoFrame
from runtime.function_tools import ToolError, parse_choice, parse_tools
from runtime.session_config import (
    ConfigFieldError,
    OutputAudio,
    max_tokens,
    parse_modalities,
    parse_output,
    unknown_field,
)
from runtime.web.binary_messages import MAX_MESSAGE_BYTES, decode_image, parse_binary
from runtime.web.commands import (
    AppendAudio,
    AppendFrame,
    CancelResponse,
    ClearInput,
    Command,
    CommitInput,
    CreateItem,
    CreateResponse,
    DeleteItem,
    FinishSession,
    ProtocolError,
    RetrieveItem,
    TruncateItem,
    UpdateSession,
)

_EVENT_ID = re.compile(r'"event_id"\s*:\s*"([^"\\]{1,128})"')
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into JSON text
_SURROGATE = re.compile("[\ud800-\udfff]")

K = TypeVar("K")  # the type a client event's field must have


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
    """Only the shape here: the fields are checked against the session's config (`session_config`)."""
    return UpdateSession(event_id, dict(_field(data, "session", dict, "an object")))


def _audio_append(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    return AppendAudio(event_id, _b64(data, "audio", "audio in the session's input format"))


def _frame_append(data: dict[str, Any], event_id: str | None, max_side: int) -> Command:
    raw = _b64(data, "image", "JPEG or PNG")
    timestamp = float(_field(data, "timestamp", (int, float), "media seconds >= 0"))
    if not timestamp >= 0 or timestamp == float("inf"):
        raise ProtocolError("timestamp must be finite media seconds >= 0", code="invalid_value", param="timestamp")
    return AppendFrame(event_id, VideoFrame(decode_image(raw, max_side), timestamp))


_TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "assistant": ("output_text", "text")}


def _item_create(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    item = _field(data, "item", dict, "an object")
    ids = {"item_id": _optional_id(item, "id", "item.id"),
           "previous_item_id": _optional_id(data, "previous_item_id", "previous_item_id")}
    if item.get("type") in ("function_call", "function_call_output"):
        return _call_item(item, event_id, ids)
    content = item.get("content")
    if item.get("role", "user") == "user" and isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") == "input_audio" for part in content):
        return CreateItem(event_id, "user", audio=_spoken(content), **ids)
    return CreateItem(event_id, *_message(item, "item"), **ids)


def _call_item(item: dict[str, Any], event_id: str | None, ids: dict[str, str | None]) -> Command:
    """A `function_call_output` (the client ran a call: its output goes back into the conversation) or a
    `function_call` (a client replaying a call into the history)."""
    call_id = _field(item, "call_id", str, "the id of the call")
    if item["type"] == "function_call_output":
        return CreateItem(event_id, "user", _field(item, "output", str, "a string"), kind="function_call_output",
                          call_id=call_id, **ids)
    arguments = _field(item, "arguments", str, "a JSON string")
    try:  # a server that continues the call parses them (vLLM refuses the request otherwise)
        json.loads(arguments)
    except json.JSONDecodeError:
        raise ProtocolError("item.arguments must be a JSON document (the call's arguments, encoded)",
                            code="invalid_value", param="item.arguments") from None
    return CreateItem(event_id, "assistant", arguments, kind="function_call", call_id=call_id,
                      name=_field(item, "name", str, "a function name"), **ids)


def _spoken(content: list[Any]) -> bytes:
    """A spoken user message: its `input_audio` parts' audio, in order (transcribed as one item)."""
    audio = b""
    for i, part in enumerate(content):
        where = f"item.content[{i}]"
        if not isinstance(part, dict) or part.get("type") != "input_audio":
            raise ProtocolError(f"{where}: a spoken message holds only input_audio parts (send text as its own "
                                "item)", code="invalid_value", param=where)
        audio += _b64(part, "audio", "audio in the session's input format")
    return audio


def _message(item: dict[str, Any], where: str) -> tuple[str, str]:
    """A message item's (role, text): text content parts joined; audio content is refused, naming the way in."""
    if item.get("type", "message") != "message":
        raise ProtocolError(f"{where}.type {item.get('type')!r} is not supported here: send message items (a "
                            "function_call_output goes in conversation.item.create)", code="unsupported_item",
                            param=f"{where}.type")
    role = item.get("role", "user")
    if role not in _TEXT_PARTS:
        raise ProtocolError(f"{where}.role must be 'user', 'system' or 'assistant'", code="invalid_value",
                            param=f"{where}.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError(f"{where}.content must be a non-empty list", code="missing_field",
                            param=f"{where}.content")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_audio", "input_image"):
            raise ProtocolError(f"{where}.content[{i}]: {kind} parts are not taken here (audio only in a user item "
                                "of its own; frames with runtime.input_video_frame.append)",
                                code="unsupported_content", param=f"{where}.content[{i}].type")
        if kind not in _TEXT_PARTS[role] or not isinstance(part.get("text"), str):
            raise ProtocolError(f"{where}.content[{i}] must be {{'type': '{_TEXT_PARTS[role][0]}', 'text': str}} "
                                f"for a {role} message", code="invalid_value", param=f"{where}.content[{i}]")
        texts.append(part["text"])
    return role, " ".join(texts)


def _optional_id(data: dict[str, Any], name: str, param: str) -> str | None:
    value = data.get(name)
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 64):
        raise ProtocolError(f"{param} must be a string of 1 to 64 characters", code="invalid_value", param=param)
    return value


def _item_id(data: dict[str, Any], event_id: str | None, _max_side: int) -> tuple[str | None, str]:
    return event_id, _field(data, "item_id", str, "an item id")


def _response_create(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    params = data.get("response", {})
    if not isinstance(params, dict):
        raise ProtocolError("response must be an object", code="invalid_value", param="response")
    out: dict[str, Any] = {}
    for key, value in params.items():
        param = f"response.{key}"
        if key == "instructions":
            if not isinstance(value, str):
                raise ProtocolError(f"{param} must be a string", code="invalid_value", param=param)
            out["instructions"] = value
        elif key == "max_output_tokens":
            try:
                out["max_tokens"] = max_tokens(value, param)
            except ConfigFieldError as e:
                raise ProtocolError(str(e), code=e.code, param=e.param) from None
        elif key == "conversation":
            if value not in ("auto", "none"):
                raise ProtocolError(f"{param} must be 'auto' or 'none'", code="invalid_value", param=param)
            out["in_conversation"] = value == "auto"
        elif key == "output_modalities":
            out["modalities"] = _config_error(parse_modalities, value, param)
        elif key == "audio":
            out["audio_output"] = _response_audio(value, param)
        elif key == "metadata":
            if value is not None and not isinstance(value, dict):
                raise ProtocolError(f"{param} must be an object", code="invalid_value", param=param)
            out["metadata"] = value
        elif key == "input":
            out.update(_response_input(value, param))
        elif key == "tools":
            out["tools"] = _tool_error(parse_tools, value, param)
        elif key == "tool_choice":
            out["tool_choice"] = _tool_error(parse_choice, value, param)
        elif key != "prompt":
            raise ProtocolError(unknown_field("response", key), code="unknown_parameter", param=param)
    return CreateResponse(event_id, **out)


def _config_error(parse: Callable[[object, str], K], value: object, param: str) -> K:
    try:
        return parse(value, param)
    except ConfigFieldError as e:
        raise ProtocolError(str(e), code=e.code, param=e.param) from None


def _response_audio(value: object, param: str) -> dict[str, Any] | None:
    """`response.audio`: only `output` (format, voice), checked here against the defaults and applied to the
    session's own when the response is created."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"{param} must be an object", code="invalid_value", param=param)
    for key in value:
        if key != "output":
            raise ProtocolError(f"unknown field {key!r} in {param}", code="unknown_parameter", param=f"{param}.{key}")
    output = value.get("output")
    if output is None:
        return None
    _config_error(lambda v, p: parse_output(v, p, OutputAudio()), output, f"{param}.output")
    return dict(output)


def _tool_error(parse: Callable[[object, str], K], value: object, param: str) -> K:
    try:
        return parse(value, param)
    except ToolError as e:
        raise ProtocolError(str(e), code="invalid_value", param=e.param) from None


def _response_input(value: object, param: str) -> dict[str, Any]:
    """A request's own input: message items (their text is the question) and references to existing items."""
    if not isinstance(value, list):
        raise ProtocolError(f"{param} must be a list of items", code="invalid_value", param=param)
    texts, refs = [], []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"{where} must be an item object", code="invalid_value", param=where)
        if item.get("type") == "item_reference":
            refs.append(_field(item | {"type": "item_reference"}, "id", str, "an item id"))
        else:
            texts.append(_message(item, where)[1])
    return {"input_text": " ".join(texts), "input_refs": tuple(refs)}


def _response_cancel(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    response_id = data.get("response_id")
    if response_id is not None and not isinstance(response_id, str):
        raise ProtocolError("response_id must be a string", code="invalid_value", param="response_id")
    return CancelResponse(event_id, response_id)


def _truncate(data: dict[str, Any], event_id: str | None, _max_side: int) -> Command:
    ms = _field(data, "audio_end_ms", int, "milliseconds >= 0")
    if ms < 0:
        raise ProtocolError("audio_end_ms must be >= 0", code="invalid_value", param="audio_end_ms")
    return TruncateItem(event_id, _field(data, "item_id", str, "an item id"),
                        _field(data, "content_index", int, "a content index"), ms)


def _output_buffer_clear(data: dict[str, Any], event_id: str | None, max_side: int) -> Command:
    """The WebRTC peer answers this event itself (`webrtc.py`): it reaches here on connections without a voice."""
    raise ProtocolError("output_audio_buffer.clear applies where the server plays the audio out (a WebRTC connection "
                        "that receives its audio track); here the client plays what it was sent: stop it there and "
                        "send conversation.item.truncate", code="unsupported_event", param="type")


_PARSERS = {
    "session.update": _session_update,
    "input_audio_buffer.append": _audio_append,
    "input_audio_buffer.commit": lambda d, e, m: CommitInput(e),
    "input_audio_buffer.clear": lambda d, e, m: ClearInput(e),
    "conversation.item.create": _item_create,
    "conversation.item.delete": lambda d, e, m: DeleteItem(*_item_id(d, e, m)),
    "conversation.item.retrieve": lambda d, e, m: RetrieveItem(*_item_id(d, e, m)),
    "conversation.item.truncate": _truncate,
    "response.create": _response_create,
    "response.cancel": _response_cancel,
    "output_audio_buffer.clear": _output_buffer_clear,
    "runtime.input_video_frame.append": _frame_append,
    "runtime.session.finish": lambda d, e, m: FinishSession(e),
}
