"""The async seam between the question processor and whoever makes an answer, local or remote.

A local backend (`backend.AnswerBackend`: the engine, transformers' generate) computes, so the pipeline runs each
of its calls as a job on the device worker (`pipeline/local_answers.py`); a remote backend
(`remote_answerer.py`) only waits on a socket, so it runs on the event loop itself. Either way the processor
sees `Answering.start(request) -> RunningAnswer` and awaits one `Step` at a time: text, or a piece of a
function call's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from runtime.function_tools import ToolUse
from runtime.models.lm.backend import DecodingStats


@dataclass(frozen=True)
class CallDelta:
    """A piece of function call `index` of a response: its id and name (known from its first piece on) and the
    next piece of its JSON arguments."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Step:
    text: str = ""  # new answer text (may be "" while a multi-byte character is incomplete)
    call: CallDelta | None = None  # or a piece of a function call
    done: bool = False
    finish_reason: str | None = None  # "stop" | "length" once done
    tokens: int = 0  # output tokens this step produced


@dataclass(frozen=True)
class PastCall:
    """A function call of the exchange being continued, with its output once the client sent it."""

    call_id: str
    name: str
    arguments: str
    output: str | None = None


@dataclass(frozen=True)
class AnswerRequest:
    context: str  # the conversation so far, a line per item (function calls and outputs included)
    question: str  # what to answer, with the session's and the request's instructions
    max_tokens: int | None = None
    tools: ToolUse = field(default_factory=ToolUse)
    context_before_calls: str = ""  # the context without `calls` (a remote server gets those as messages)
    calls: tuple[PastCall, ...] = ()  # the calls and outputs since the user's last message


class RunningAnswer(Protocol):
    prompt_tokens: int  # what it conditions on (a response's `usage.input_tokens`)

    async def step(self) -> Step:
        """The next text or call piece; after the answer is done, an empty done step."""
        ...

    async def close(self) -> DecodingStats | None:
        """End the answer now (a remote one closes its stream) and free what it holds; its decoding counters.
        Safe to call twice."""
        ...


class Answering(Protocol):
    async def start(self, request: AnswerRequest) -> RunningAnswer: ...


@runtime_checkable
class Preparing(Protocol):
    """An `Answering` that can start on an answer before it is asked for (while the user's pause is timed): a
    `start` with the very request it prepared gets that answer, as started then; any other request drops it."""

    def prepare(self, request: AnswerRequest) -> None: ...

    def drop_prepared(self) -> None: ...


class TextAnswer:
    """An answer whose text is known without a model (`memory/grounding.py`'s "not known yet"): one step."""

    prompt_tokens = 0

    def __init__(self, text: str) -> None:
        self.text: str | None = text

    async def step(self) -> Step:
        text, self.text = self.text or "", None
        return Step(text=text, done=True, finish_reason="stop")

    async def close(self) -> DecodingStats | None:
        return None
