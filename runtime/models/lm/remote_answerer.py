"""A remote answerer (`lm.backend = "openai"`): any server speaking OpenAI's `/v1/chat/completions` answers.

Why: a model that does not fit beside the runtime, or sessions that outgrow one process, belong on the serving
engines people already run (vLLM, SGLang, llama.cpp's server), which batch, shard and cache. The runtime stays
what it is (streaming ASR, turns, the conversation, the protocol) and becomes one more client of them.

What keeps it fast is the same idea as the local engine's streaming prefill, done with the server's own prefix
cache (vLLM's automatic prefix caching, SGLang's radix cache, llama.cpp's `cache_prompt`): the prompt is
append-only (the system prompt, then the transcript and notes so far, then the question), and while the context
grows `warm` sends a prefill-only request (`max_tokens: 1`) so the cache already holds the transcript when the
question comes. Only the question's own tokens are left to prefill then.

Nothing here computes: every call waits on a socket, so it runs on the event loop, never on the device worker.
Faults are the answer's, never the session's: connect errors are retried with backoff until
`lm.connect_deadline_s`; a 4xx/5xx, a stalled stream (`lm.request_timeout_s`) or a server gone mid-answer raise
`RemoteError` with one line saying which, and the next question tries again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.config import LMConfig
from runtime.errors import UserError
from runtime.events import new_id
from runtime.function_tools import ToolUse, chat_tool_choice, chat_tools
from runtime.models.lm.answering import AnswerRequest, CallDelta, PastCall, Step
from runtime.models.lm.prompt import EMPTY_CONTEXT, user_turn

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionChunk

INSTALL = "pip install 'runtime[remote]' (or: pip install openai)"
BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # waits between connect attempts; the last repeats until the deadline


class RemoteError(RuntimeError):
    """The LM server failed an answer; the message is one line a user can act on."""


def transcript_message(context: str) -> str:
    """The user message's head: a prefix of every question's message while the context only grows."""
    return user_turn(context or EMPTY_CONTEXT, "").removesuffix("\n\nQuestion: ")


def chat_messages(system_prompt: str, context: str, question: str,
                  calls: tuple[PastCall, ...] = ()) -> list[dict[str, Any]]:
    """system, user (transcript, then the question), then the calls being continued as the chat API has them: an
    assistant message with `tool_calls`, and a `tool` message per output."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt},
                                      {"role": "user", "content": user_turn(context or EMPTY_CONTEXT, question)}]
    if calls:
        messages.append({"role": "assistant", "content": "", "tool_calls": [  # "" not None: some servers need a string
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c.call_id, "content": c.output}
                     for c in calls if c.output is not None]
    return messages


@dataclass(eq=False)
class RemoteAnswer:
    """One streamed chat completion: `step` reads the next chunk; `close` closes the HTTP stream at once."""

    stream: Any  # openai.AsyncStream[ChatCompletionChunk]
    timeout_s: float
    url: str
    prompt_tokens: int = 0
    _chunks: AsyncIterator[ChatCompletionChunk] | None = None
    _calls: dict[int, CallDelta] = field(default_factory=dict)
    _ready: deque[Step] = field(default_factory=deque)  # a chunk's pieces beyond the first, one per step
    _done: bool = False
    _finish: str | None = None

    async def step(self) -> Step:
        if self._ready:
            return self._ready.popleft()
        if self._done:
            return Step(done=True, finish_reason=self._finish)
        from openai import APIError

        if self._chunks is None:
            self._chunks = aiter(self.stream)
        try:
            chunk = await asyncio.wait_for(anext(self._chunks), self.timeout_s)
        except StopAsyncIteration:
            if self._finish is None:  # a well-formed stream ends with a finish reason; a server that failed silently
                await self.close()    # (llama-cpp-python on a prompt over its context) ends it empty
                raise RemoteError(f"the LM server at {self.url} ended the answer's stream without finishing it (a "
                                  "failure it did not report: is the prompt longer than its context?)") from None
            return await self._end(self._finish)
        except TimeoutError:
            await self.close()
            raise RemoteError(f"the LM server at {self.url} sent nothing for {self.timeout_s:g} s") from None
        except (APIError, OSError, ConnectionError) as err:
            await self.close()
            raise RemoteError(f"the LM server at {self.url} went away mid-answer: {err}") from None
        except Exception as err:  # httpx2's transport errors (a closed connection) are not APIErrors
            if type(err).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore", "h11"):
                raise
            await self.close()
            raise RemoteError(f"the LM server at {self.url} went away mid-answer: {err}") from None
        if chunk.usage is not None:
            self.prompt_tokens = chunk.usage.prompt_tokens or self.prompt_tokens
        if not chunk.choices:
            return Step()
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            self._finish = "length" if choice.finish_reason == "length" else "stop"
        delta = choice.delta
        pieces = [Step(text=delta.content, tokens=1)] if delta.content else []
        for tc in delta.tool_calls or ():  # a chunk may open or continue several calls (parallel calls)
            known = self._calls.get(tc.index)
            name = (tc.function.name if tc.function else None) or (known.name if known else "")
            call_id = tc.id or (known.call_id if known else "") or new_id("call")  # a server that names none
            piece = (tc.function.arguments if tc.function else None) or ""
            self._calls[tc.index] = CallDelta(tc.index, call_id, name, (known.arguments if known else "") + piece)
            pieces.append(Step(call=CallDelta(tc.index, call_id, name, piece), tokens=1))
        if not pieces:
            return Step()
        self._ready.extend(pieces[1:])
        return pieces[0]

    async def _end(self, reason: str) -> Step:
        self._done, self._finish = True, reason
        await self.close()
        return Step(done=True, finish_reason=reason)

    async def close(self) -> None:
        self._done = True
        if self.stream is not None:
            stream, self.stream = self.stream, None
            try:
                await stream.close()
            except Exception:  # a stream that died already has nothing left to close
                pass


class RemoteAnswerer:
    """A `/v1/chat/completions` server as the answerer, shared by the sessions of a process."""

    def __init__(self, cfg: LMConfig, client: AsyncOpenAI) -> None:
        self.cfg, self.client = cfg, client
        self.name = f"{cfg.model}@{cfg.base_url}"
        self.warm_requests = 0
        self.warm_failures = 0

    @classmethod
    def load(cls, cfg: LMConfig, progress: Callable[[str], None] | None = None) -> RemoteAnswerer:
        """The client only: nothing is sent until the first warm-up or question, so a server that is down at
        start costs nothing until then."""
        try:
            from openai import AsyncOpenAI
        except ImportError:
            raise UserError(f"lm.backend = openai needs the openai package: {INSTALL}") from None
        key = "unused"
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env, "")
            if not key:
                raise UserError(f"lm.api_key_env names {cfg.api_key_env}, which is not set in the environment")
        client = AsyncOpenAI(base_url=cfg.base_url, api_key=key, max_retries=0, timeout=cfg.request_timeout_s)
        if progress:
            progress(f"lm: {cfg.model} on the server at {cfg.base_url} (answers stream from /chat/completions)")
        return cls(cfg, client)

    def open_stream(self) -> None:
        """No local KV: the server's prefix cache plays that part (`warm`)."""
        return None

    def embed_text(self, text: str) -> None:
        return None

    async def start(self, request: AnswerRequest) -> RemoteAnswer:
        limit = self.cfg.max_new_tokens if request.max_tokens is None else min(self.cfg.max_new_tokens,
                                                                               request.max_tokens)
        body: dict[str, Any] = {
            "model": self.cfg.model, "stream": True, "max_tokens": limit, "temperature": self.cfg.temperature,
            "stream_options": {"include_usage": True},  # vLLM and SGLang report usage in a stream only if asked
            "messages": chat_messages(self.cfg.system_prompt, request.context_before_calls or request.context,
                                      request.question, request.calls)}
        if self.cfg.top_p < 1.0:
            body["top_p"] = self.cfg.top_p
        if request.tools.active:
            body["tools"] = chat_tools(request.tools)
            body["tool_choice"] = chat_tool_choice(request.tools)
        stream = await self._create(body, deadline=time.monotonic() + self.cfg.connect_deadline_s)
        return RemoteAnswer(stream, self.cfg.request_timeout_s, self.cfg.base_url)

    async def warm(self, context: str, tools: ToolUse | None = None) -> None:
        """Prefill the transcript into the server's prefix cache: the head of every later question's prompt, one
        token generated. The session's tools go with it: a tool-aware chat template writes them ahead of the
        transcript, so without them the cached prefix would not be the question's. One attempt, no retries: a
        warm-up that fails only costs the next question its cache."""
        body: dict[str, Any] = {"model": self.cfg.model, "max_tokens": 1, "temperature": 0.0, "stream": False,
                                "messages": [{"role": "system", "content": self.cfg.system_prompt},
                                             {"role": "user", "content": transcript_message(context)}]}
        if tools is not None and tools.active:
            body["tools"], body["tool_choice"] = chat_tools(tools), chat_tool_choice(tools)
        self.warm_requests += 1
        try:
            await self._create(body, deadline=0.0)
        except RemoteError:
            self.warm_failures += 1
            raise

    async def _create(self, body: dict[str, Any], *, deadline: float) -> Any:  # noqa: ANN401 (a stream or a reply)
        from openai import APIConnectionError, APIStatusError

        attempt = 0
        while True:
            try:
                return await self.client.chat.completions.create(**body, extra_body={"cache_prompt": True})
            except APIStatusError as err:
                raise RemoteError(f"the LM server at {self.cfg.base_url} refused the request ({err.status_code}): "
                                  f"{_reason(err)}") from None
            except APIConnectionError as err:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteError(f"cannot reach the LM server at {self.cfg.base_url}: {err.__cause__ or err}"
                                      ) from None
                await asyncio.sleep(min(left, BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]))
                attempt += 1


def _reason(err: Exception) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"].splitlines()[0][:300]
        if isinstance(body.get("detail"), str):
            return body["detail"][:300]
    return str(err).splitlines()[0][:300]
