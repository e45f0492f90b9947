"""Every event that leaves a session, in one schema shared by the CLI, the websocket and the data channel.

Type names follow the OpenAI Realtime API where it has an equivalent, so a client written for that API
reads these without a translation table. Each event also carries `media_time` (seconds of input media it
refers to) and `wall_time` (unix seconds when it was emitted): the difference between two sessions' clocks
is how a user measures latency.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(kw_only=True)
class Event:
    type: ClassVar[str] = ""
    event_id: str = field(default_factory=lambda: new_id("evt"))
    media_time: float | None = None
    wall_time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))


_REGISTRY: dict[str, type[Event]] = {}


def _register(cls: type[Event]) -> type[Event]:
    _REGISTRY[cls.type] = cls
    return cls


@_register
@dataclass(kw_only=True)
class SessionCreated(Event):
    type: ClassVar[str] = "session.created"
    session: dict[str, Any]


@_register
@dataclass(kw_only=True)
class SessionUpdated(Event):
    """Reply to a client's `session.update`: the session as it now is."""

    type: ClassVar[str] = "session.updated"
    session: dict[str, Any]


@_register
@dataclass(kw_only=True)
class TranscriptionDelta(Event):
    """New stable text of one transcript item; `unstable` is the tail that may still change."""

    type: ClassVar[str] = "conversation.item.input_audio_transcription.delta"
    item_id: str
    content_index: int = 0
    delta: str
    unstable: str = ""
    start: float
    end: float
    language: str = ""  # the runtime's extension: the language the ASR heard (given or detected; "": not said)


@_register
@dataclass(kw_only=True)
class TranscriptionCompleted(Event):
    """`usage` is the API's duration form: seconds of audio the item holds."""

    type: ClassVar[str] = "conversation.item.input_audio_transcription.completed"
    item_id: str
    content_index: int = 0
    transcript: str
    start: float
    end: float
    language: str = ""  # the runtime's extension: the language the ASR heard (given or detected; "": not said)
    usage: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.usage:
            self.usage = {"type": "duration", "seconds": round(max(0.0, self.end - self.start), 3)}


@_register
@dataclass(kw_only=True)
class AudioBufferCommitted(Event):
    """The input audio buffer became the user item `item_id` (by the client's commit or by turn detection)."""

    type: ClassVar[str] = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None = None


@_register
@dataclass(kw_only=True)
class AudioBufferCleared(Event):
    type: ClassVar[str] = "input_audio_buffer.cleared"


@_register
@dataclass(kw_only=True)
class SpeechStarted(Event):
    """Turn detection heard speech begin at `audio_start_ms` of the session's audio (prefix padding included)."""

    type: ClassVar[str] = "input_audio_buffer.speech_started"
    item_id: str
    audio_start_ms: int


@_register
@dataclass(kw_only=True)
class SpeechStopped(Event):
    type: ClassVar[str] = "input_audio_buffer.speech_stopped"
    item_id: str
    audio_end_ms: int


@_register
@dataclass(kw_only=True)
class AudioBufferTimeout(Event):
    """`idle_timeout_ms` passed with no speech since the last answer (`audio_start_ms` to `audio_end_ms`): the
    buffer is committed and answered."""

    type: ClassVar[str] = "input_audio_buffer.timeout_triggered"
    item_id: str
    audio_start_ms: int
    audio_end_ms: int


@_register
@dataclass(kw_only=True)
class ItemAdded(Event):
    """An item joined the conversation after `previous_item_id`; `item` as `Item.to_api` writes it."""

    type: ClassVar[str] = "conversation.item.added"
    item: dict[str, Any]
    previous_item_id: str | None = None


@_register
@dataclass(kw_only=True)
class ItemDone(Event):
    """An item is final (a spoken one once its transcript completed, an answer once it ended)."""

    type: ClassVar[str] = "conversation.item.done"
    item: dict[str, Any]
    previous_item_id: str | None = None


@_register
@dataclass(kw_only=True)
class ItemDeleted(Event):
    type: ClassVar[str] = "conversation.item.deleted"
    item_id: str


@_register
@dataclass(kw_only=True)
class ItemTruncated(Event):
    type: ClassVar[str] = "conversation.item.truncated"
    item_id: str
    content_index: int = 0
    audio_end_ms: int = 0


@_register
@dataclass(kw_only=True)
class ItemRetrieved(Event):
    type: ClassVar[str] = "conversation.item.retrieved"
    item: dict[str, Any]


@_register
@dataclass(kw_only=True)
class VideoNote(Event):
    """A one-line note the model wrote about one memory segment (media seconds `start`-`end`); ours, no Realtime
    equivalent. A later note for a merged segment has a new `segment_id`."""

    type: ClassVar[str] = "runtime.video.note"
    segment_id: int
    text: str
    start: float
    end: float


@_register
@dataclass(kw_only=True)
class ScreenText(Event):
    """What is on screen (media seconds `start`-`end`, the span it has been seen), as lines read top to bottom;
    ours, no Realtime equivalent. Sent when a screen first is read and when it changes (a line added or read
    better); a new slide is a new `screen_id`."""

    type: ClassVar[str] = "runtime.screen.text"
    screen_id: str
    text: str
    lines: list[dict[str, Any]]
    start: float
    end: float


@_register
@dataclass(kw_only=True)
class ResponseCreated(Event):
    type: ClassVar[str] = "response.created"
    response: dict[str, Any]


@_register
@dataclass(kw_only=True)
class OutputItemAdded(Event):
    type: ClassVar[str] = "response.output_item.added"
    response_id: str
    output_index: int = 0
    item: dict[str, Any]


@_register
@dataclass(kw_only=True)
class OutputItemDone(Event):
    type: ClassVar[str] = "response.output_item.done"
    response_id: str
    output_index: int = 0
    item: dict[str, Any]


@_register
@dataclass(kw_only=True)
class ContentPartAdded(Event):
    type: ClassVar[str] = "response.content_part.added"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    part: dict[str, Any]


@_register
@dataclass(kw_only=True)
class ContentPartDone(Event):
    type: ClassVar[str] = "response.content_part.done"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    part: dict[str, Any]


@_register
@dataclass(kw_only=True)
class ResponseTextDelta(Event):
    type: ClassVar[str] = "response.output_text.delta"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    delta: str


@_register
@dataclass(kw_only=True)
class ResponseTextDone(Event):
    type: ClassVar[str] = "response.output_text.done"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    text: str


@_register
@dataclass(kw_only=True)
class ResponseAudioDelta(Event):
    """A piece of the spoken answer: base64 of audio in the session's `audio.output.format`."""

    type: ClassVar[str] = "response.output_audio.delta"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    delta: str

    def audio(self) -> bytes:
        """The piece of audio itself (`delta` decoded from base64)."""
        return base64.b64decode(self.delta)


@_register
@dataclass(kw_only=True)
class ResponseAudioDone(Event):
    type: ClassVar[str] = "response.output_audio.done"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0


@_register
@dataclass(kw_only=True)
class ResponseAudioTranscriptDelta(Event):
    """Text of the spoken answer as it is decoded (ahead of its audio: the voice speaks it clause by clause)."""

    type: ClassVar[str] = "response.output_audio_transcript.delta"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    delta: str


@_register
@dataclass(kw_only=True)
class ResponseAudioTranscriptDone(Event):
    type: ClassVar[str] = "response.output_audio_transcript.done"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    transcript: str


@_register
@dataclass(kw_only=True)
class OutputAudioBufferStarted(Event):
    """WebRTC: the first audio of response `response_id` began playing out on the voice track."""

    type: ClassVar[str] = "output_audio_buffer.started"
    response_id: str


@_register
@dataclass(kw_only=True)
class OutputAudioBufferStopped(Event):
    """WebRTC: response `response_id`'s audio has all played out and no more is coming (after its response.done)."""

    type: ClassVar[str] = "output_audio_buffer.stopped"
    response_id: str


@_register
@dataclass(kw_only=True)
class OutputAudioBufferCleared(Event):
    """WebRTC: the voice track's buffer was emptied (barge-in, or the client's `output_audio_buffer.clear`)."""

    type: ClassVar[str] = "output_audio_buffer.cleared"
    response_id: str


@_register
@dataclass(kw_only=True)
class FunctionCallArgumentsDelta(Event):
    """A piece of a function call's JSON arguments, streamed as the model writes them."""

    type: ClassVar[str] = "response.function_call_arguments.delta"
    response_id: str
    item_id: str
    output_index: int = 0
    call_id: str
    delta: str


@_register
@dataclass(kw_only=True)
class FunctionCallArgumentsDone(Event):
    type: ClassVar[str] = "response.function_call_arguments.done"
    response_id: str
    item_id: str
    output_index: int = 0
    call_id: str
    name: str
    arguments: str


@_register
@dataclass(kw_only=True)
class ResponseDone(Event):
    """`response.status` is completed, cancelled, incomplete (token limit) or failed."""

    type: ClassVar[str] = "response.done"
    response: dict[str, Any]


@_register
@dataclass(kw_only=True)
class Metrics(Event):
    """Queue depths, drops, event-loop lag and device-worker load, emitted periodically and at the end."""

    type: ClassVar[str] = "runtime.metrics"
    metrics: dict[str, Any]


@_register
@dataclass(kw_only=True)
class Error(Event):
    """`error` is {type, code, message, param, event_id}; `error.event_id` names the client event at fault."""

    type: ClassVar[str] = "error"
    error: dict[str, Any]


def error_event(
    message: str,
    *,
    code: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    client_event_id: str | None = None,
    media_time: float | None = None,
) -> Error:
    return Error(
        error={"type": type, "code": code, "message": message, "param": param, "event_id": client_event_id},
        media_time=media_time,
    )


def event_types() -> list[str]:
    return sorted(_REGISTRY)


def parse_event(data: dict[str, Any] | str, *, strict: bool = True) -> Event:
    """Rebuild an event from its JSON form (what `to_dict`/`to_json` produced); unknown types raise ValueError,
    and so do unknown fields unless `strict=False` (the SDK reading a newer server drops them)."""
    if isinstance(data, str):
        data = json.loads(data)
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError("an event is a JSON object with a 'type'")
    cls = _REGISTRY.get(data["type"])
    if cls is None:
        raise ValueError(f"unknown event type {data['type']!r}")
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names - {"type"}
    if unknown and strict:
        raise ValueError(f"{data['type']}: unknown fields {sorted(unknown)}")
    return cls(**{k: v for k, v in data.items() if k in names})
