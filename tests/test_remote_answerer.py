"""The remote answerer (`lm.backend = "openai"`) against llama.cpp's real server (llama-cpp-python[server]) serving
the shipped SmolLM2 GGUF on 127.0.0.1: streaming, cancel, prefix-cache warming as the server itself reports it, a
function call and its output, faults (refused, too long, killed mid-answer, back again). No mock stands in."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from dataclasses import replace

import pytest
from llama_server import LlamaServer, free_port
from openai.types.chat import ChatCompletionChunk
from session_fakes import WordASR

from runtime.config import with_overrides
from runtime.function_tools import FunctionTool, ToolUse
from runtime.loaded_models import Models
from runtime.models.lm import NoAnswerer
from runtime.models.lm.answering import AnswerRequest, PastCall
from runtime.models.lm.remote_answerer import (
    RemoteAnswer,
    RemoteAnswerer,
    RemoteError,
    chat_messages,
    transcript_message,
)
from runtime.profile_files import load_profile
from runtime.session_builder import open_session

WEATHER = FunctionTool("get_weather", "Get the current weather in a city",
                       {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
MEETING = ["The weekly meeting moved to Thursday at ten in room four.",
           "Maria will bring the budget numbers for the third quarter.",
           "The launch of the new app is planned for the first of March."]


def remote_profile(base_url: str, **lm: object):
    settings = {"backend": "openai", "model": "smollm2", "base_url": base_url, "max_new_tokens": 32,
                "connect_deadline_s": 1.0, "request_timeout_s": 30.0, "warm_interval_s": 0.0, **lm}
    return with_overrides(load_profile("tiny"), lm=settings, pipeline={"metrics_interval_s": 0.0})


async def remote_session(worker, base_url: str, **lm: object):
    profile = remote_profile(base_url, **lm)
    models = Models(WordASR(), NoAnswerer(), remote=RemoteAnswerer.load(profile.lm))
    return await (await open_session(profile, models, worker)).start()


async def until_done(session, response_id: str, timeout_s: float = 120.0) -> list:
    """The session's events up to and including `response_id`'s `response.done`."""
    out = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        event = await asyncio.wait_for(session.events.get(), deadline - time.monotonic())
        assert event is not None, "the session ended before the response was done"
        out.append(event)
        if event.type == "response.done" and event.response["id"] == response_id:
            return out
    raise AssertionError("no response.done in time")


def done_of(events) -> dict:
    return next(e for e in events if e.type == "response.done").response


def text_of(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


# -- without a server --------------------------------------------------------------------------------------------

def test_the_warm_up_message_is_a_prefix_of_every_later_question():
    context = "[00:01.0] The meeting moved to Thursday."
    asked = chat_messages("Be brief.", context, "When is the meeting?")
    assert asked[1]["content"].startswith(transcript_message(context))
    assert asked[1]["content"] != transcript_message(context)
    longer = chat_messages("Be brief.", context + "\n[00:04.0] Bring the numbers.", "Who brings what?")
    assert longer[1]["content"].startswith(transcript_message(context))  # the context only grows


def test_calls_being_continued_go_to_the_server_as_tool_calls_and_tool_messages():
    calls = (PastCall("call_1", "get_weather", '{"city": "Paris"}', "18 C and sunny"),)
    messages = chat_messages("sys", "ctx", "What's the weather in Paris?", calls)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}


@pytest.mark.asyncio
async def test_a_server_that_is_not_there_fails_once_the_connect_deadline_passes():
    profile = remote_profile(f"http://127.0.0.1:{free_port()}/v1", connect_deadline_s=0.8)
    remote = RemoteAnswerer.load(profile.lm)
    started = time.monotonic()
    with pytest.raises(RemoteError, match="cannot reach the LM server"):
        await remote.start(AnswerRequest("", "hello?"))
    assert time.monotonic() - started >= 0.7  # retried with backoff until the deadline, not given up at once


def _chunk(delta: dict, finish: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                               "model": "m", "choices": [{"index": 0, "delta": delta,
                                                                          "finish_reason": finish}]})


class _Chunks:
    """A finished stream's chunks as the SDK hands them over (what a server sent, already parsed)."""

    def __init__(self, chunks: list[ChatCompletionChunk]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk

    async def close(self) -> None:
        pass


@pytest.mark.asyncio
async def test_parallel_calls_in_one_chunk_each_become_a_step():
    calls = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
             {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    stream = _Chunks([_chunk({"role": "assistant", "content": "Checking."}), _chunk({"tool_calls": calls}),
                      _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Paris"}'}}]}),
                      _chunk({}, "tool_calls")])
    answer = RemoteAnswer(stream, 5.0, "http://x/v1")
    steps = []
    while not (step := await answer.step()).done:
        steps.append(step)
    assert [s.text for s in steps if s.text] == ["Checking."]
    pieces = [(s.call.call_id, s.call.name, s.call.arguments) for s in steps if s.call]
    assert pieces == [("call_a", "get_weather", ""), ("call_b", "get_time", "{}"),
                      ("call_a", "get_weather", '{"city":"Paris"}')]
    assert step.finish_reason == "stop"


# -- against llama.cpp's server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    srv = LlamaServer().start()
    yield srv
    srv.stop()


@pytest.mark.asyncio
async def test_an_answer_streams_from_the_server(worker, server):
    session = await remote_session(worker, server.base_url)
    await session.add_item("user", MEETING[0])
    rid = await session.create_response(text="When is the weekly meeting?")
    events = await until_done(session, rid)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2  # streamed token by token, not in one piece
    done = done_of(events)
    assert done["status"] in ("completed", "incomplete"), done  # a 135M model may run on to max_new_tokens
    assert re.search(r"thursday|\bten\b|10", text_of(events), re.I), text_of(events)
    assert done["usage"]["output_tokens"] >= len(deltas)
    await session.stop()


@pytest.mark.asyncio
async def test_cancel_closes_the_stream_at_once_and_the_next_answer_works(worker, server):
    session = await remote_session(worker, server.base_url, max_new_tokens=400)
    await session.add_item("user", MEETING[1])
    rid = await session.create_response(text="Write a long story about a budget, with many chapters.")
    while (await asyncio.wait_for(session.events.get(), 120)).type != "response.output_text.delta":
        pass
    cancelled_at = time.monotonic()
    assert session.cancel_response(rid)
    events = await until_done(session, rid, timeout_s=10)
    assert time.monotonic() - cancelled_at < 2.0  # not the 400 tokens the answer could have run to
    assert done_of(events)["status"] == "cancelled"
    rid = await session.create_response(text="Who brings the budget numbers?")
    events = await until_done(session, rid)
    assert done_of(events)["status"] in ("completed", "incomplete") and text_of(events)
    await session.stop()


@pytest.mark.asyncio
async def test_warming_puts_the_transcript_in_the_servers_prefix_cache(worker, server):
    session = await remote_session(worker, server.base_url, warm_interval_s=0.2)
    # a transcript long enough that its prefill shows: a few hundred tokens
    for i in range(12):
        await session.add_item("user", f"{MEETING[i % 3]} (note {i})")
    for _ in range(300):  # the warmer sends once the conversation settles
        metrics = session.metrics().get("answers", {})
        if metrics.get("warm_requests", 0) >= 1 and session.warmer.caught_up:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"no warm-up was sent: {session.metrics()['answers']}")
    before = len(server.log())
    rid = await session.create_response(text="When is the meeting?")
    events = await until_done(session, rid)
    assert done_of(events)["status"] in ("completed", "incomplete")
    hits = re.findall(r"(\d+) prefix-match hit, remaining (\d+) prompt tokens", server.log()[before:])
    assert hits, server.log()[before:][-2000:]
    reused, remaining = map(int, hits[0])
    # the server found the whole transcript cached: only the question (and the template's tail) was left
    assert reused > 300 and remaining < 40, (reused, remaining)
    await session.stop()


@pytest.mark.asyncio
async def test_a_function_call_and_its_output_continue_the_conversation(worker, server):
    session = await remote_session(worker, server.base_url)
    await session.update_config(replace(session.settings.config, tools=ToolUse((WEATHER,), "function:get_weather")))
    await session.add_item("user", "What's the weather like in Paris today?")
    rid = await session.create_response()
    events = await until_done(session, rid)
    done = done_of(events)
    assert done["status"] == "completed", done
    call = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert call.name == "get_weather" and deltas == call.arguments
    assert "paris" in json.loads(call.arguments)["city"].lower()
    assert done["output"][0]["type"] == "function_call" and done["output"][0]["call_id"] == call.call_id
    # the client ran it; its output goes back in and the next response continues from it, in text
    await session.add_item("user", "18 degrees and sunny", kind="function_call_output", call_id=call.call_id,
                           name="get_weather")
    await session.update_config(replace(session.settings.config, tools=ToolUse((WEATHER,), "none")))
    rid = await session.create_response()
    events = await until_done(session, rid)
    assert done_of(events)["status"] in ("completed", "incomplete") and text_of(events), done_of(events)
    await session.stop()


@pytest.mark.asyncio
async def test_a_request_the_server_refuses_fails_the_response_not_the_session(worker, server):
    # the server may still be busy with the refused prompt when the next request comes, and under `make test` it runs
    # at the lowest CPU priority beside the realtime tests: 30 s without a chunk once failed the next answer there
    session = await remote_session(worker, server.base_url, request_timeout_s=150.0)
    rid = await session.create_response(text="word " * 6000)  # over the server's 4096-token context
    events = await until_done(session, rid)
    error = next(e for e in events if e.type == "error")
    # llama-cpp-python answers 200 and ends the stream empty where vLLM answers 400: both are a clear failure
    assert re.search(r"refused the request \(400\)|ended the answer's stream without finishing", error.error["message"])
    assert done_of(events)["status"] == "failed"
    # llama-cpp-python's server, after the exception it raised inside the refused stream, once dropped the next
    # stream mid-answer (2026-11-30, CI: its log says "Disconnected from client" while the client saw "Connection
    # error"): a failure of the peer's that the session reports as such and survives. So the next answer may fail
    # that way, once; the one after must be answered.
    for attempt in range(2):
        rid = await session.create_response(text="Say hello.")
        done = done_of(await until_done(session, rid, timeout_s=180.0))
        if done["status"] in ("completed", "incomplete") or attempt == 1:
            break
        assert "went away mid-answer" in str(done.get("status_details")), done.get("status_details")
    assert done["status"] in ("completed", "incomplete"), done.get("status_details")
    await session.stop()


@pytest.mark.asyncio
async def test_a_server_killed_mid_answer_fails_that_answer_and_the_next_works_once_it_is_back(worker):
    own = LlamaServer().start()
    try:
        session = await remote_session(worker, own.base_url, max_new_tokens=400, connect_deadline_s=0.5)
        rid = await session.create_response(text="Write a long story about a dragon, with many chapters.")
        while (await asyncio.wait_for(session.events.get(), 120)).type != "response.output_text.delta":
            pass
        own.stop(signal.SIGKILL)
        events = await until_done(session, rid, timeout_s=30)
        error = next(e for e in events if e.type == "error")
        assert "went away mid-answer" in error.error["message"], error.error
        assert done_of(events)["status"] == "failed"
        rid = await session.create_response(text="Say hello.")  # down: refused within the connect deadline
        events = await until_done(session, rid, timeout_s=30)
        assert "cannot reach the LM server" in next(e for e in events if e.type == "error").error["message"]
        first_log = own.log_path
        own.start()  # back on the same port: the same session answers again
        rid = await session.create_response(text="Say hello.")
        assert done_of(await until_done(session, rid))["status"] in ("completed", "incomplete")
        await session.stop()
    finally:
        own.stop()
    assert not first_log.exists() and not own.log_path.exists()  # each run's log went with it (none left in /tmp)
