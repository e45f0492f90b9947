"""What a client may ask of its session, as typed commands: `protocol.parse_client_event` makes them from client
messages, the session driver (`driver.py`) applies them. A `ProtocolError` is a client event that cannot be
applied; it carries the code and the field a client can branch on, and the session keeps its state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.chunks import VideoFrame
from runtime.events import Error, error_event
from runtime.function_tools import FunctionTool


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
    audio: bytes = b""  # in the session's input format


@dataclass(frozen=True)
class AppendFrame(Command):
    frame: VideoFrame | None = None


@dataclass(frozen=True)
class CreateItem(Command):
    role: str = "user"  # user | system | assistant
    text: str = ""
    item_id: str | None = None
    previous_item_id: str | None = None
    audio: bytes | None = None  # a spoken user message (`input_audio` parts), in the session's input format
    kind: str = "message"  # message | function_call | function_call_output
    call_id: str = ""  # function calling: the call an item makes or answers
    name: str = ""  # function_call: the function called (`text` holds its JSON arguments)


@dataclass(frozen=True)
class DeleteItem(Command):
    item_id: str = ""


@dataclass(frozen=True)
class RetrieveItem(Command):
    item_id: str = ""


@dataclass(frozen=True)
class TruncateItem(Command):
    """Cut an assistant item's audio at `audio_end_ms` (what the user heard before interrupting)."""

    item_id: str = ""
    content_index: int = 0
    audio_end_ms: int = 0


@dataclass(frozen=True)
class CreateResponse(Command):
    """`response.create`'s parameters; None: the session's. `input`: the request's own question (its text
    messages and the texts of the items it references), instead of the conversation's newest user turn."""

    instructions: str | None = None
    max_tokens: int | None = None
    in_conversation: bool = True
    input_text: str | None = None
    input_refs: tuple[str, ...] = ()
    metadata: dict[str, Any] | None = None
    tools: tuple[FunctionTool, ...] | None = None  # this response's tools (None: the session's)
    tool_choice: str | None = None  # this response's tool choice (None: the session's)
    modalities: tuple[str, ...] | None = None  # this response's output_modalities (None: the session's)
    audio_output: dict[str, Any] | None = None  # this response's audio.output (format, voice), checked in shape


@dataclass(frozen=True)
class CancelResponse(Command):
    response_id: str | None = None


@dataclass(frozen=True)
class CommitInput(Command):
    """The audio so far becomes a user item (`input_audio_buffer.committed`); the session goes on."""


@dataclass(frozen=True)
class ClearInput(Command):
    """The audio since the last commit is dropped (`input_audio_buffer.cleared`)."""


@dataclass(frozen=True)
class FinishSession(Command):
    """The runtime's own `runtime.session.finish`: no more input; transcribe and answer what is pending, then
    close the connection with 1000."""
