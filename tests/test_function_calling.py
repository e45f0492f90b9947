"""Function calling through the official `openai` SDK (`client.realtime.connect`) against `runtime serve`, answered by
the real SmolLM2-135M-Instruct on the local engine, whose chat template takes no tools (Qwen2.5's own format:
test_function_calling_qwen.py): session tools, a forced call decoded under the function's JSON Schema, its
`function_call` item and argument events (each validated strictly against the SDK's models), the client's
`function_call_output` going back in, and the answer that continues from it."""

from __future__ import annotations

import contextlib
import json

import pytest
from openai import AsyncOpenAI
from session_fakes import WordASR
from test_openai_realtime import Conversation
from weights_common import packaged_or_skip

from runtime.errors import ConfigError
from runtime.loaded_models import Models
from runtime.models.lm import load_answerer
from runtime.profile_files import load_profile
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker, Priority

pytestmark = pytest.mark.asyncio

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def engine():
    packaged_or_skip("smollm2-135m-instruct")
    overrides = ["pipeline.metrics_interval_s=0", "pipeline.turn_detection=none"]
    try:  # SmolLM2's own profile: `small` once `demo` answers with Qwen2.5-Coder-1.5B (issue 51)
        profile = load_profile("small", overrides=overrides)
    except ConfigError:
        profile = load_profile("demo", overrides=overrides)
    assert profile.lm.model == "builtin:smollm2-135m-instruct", profile.lm.model
    with DeviceWorker() as worker:
        answerer = worker.call(Priority.CONTROL, load_answerer, profile.lm, device="cpu", dtype="float32")
        yield profile, worker, answerer


@contextlib.asynccontextmanager
async def talking(engine):
    """A server on the engine and one SDK connection to it, past its `session.created`."""
    profile, worker, answerer = engine
    server = await RealtimeServer(profile, Models(WordASR(per_item=1000), answerer), worker, port=0).start()
    client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            await talk.next("session.created")
            yield connection, talk
    finally:
        await server.stop()


async def say(connection, text: str) -> None:
    await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": text}]})


async def test_a_forced_call_is_valid_json_and_its_output_continues_the_conversation(engine):
    async with talking(engine) as (connection, talk):
        await connection.session.update(session={"type": "realtime", "tools": [WEATHER],
                                                 "tool_choice": {"type": "function", "name": "get_weather"}})
        updated = await talk.next("session.updated")
        assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather"]
        await say(connection, "What's the weather in Paris, in celsius?")
        await connection.response.create()
        done = await talk.next("response.done", timeout=120)
        assert done["response"]["status"] == "completed", done["response"]
        call = done["response"]["output"][0]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        arguments = json.loads(call["arguments"])  # valid JSON under the schema, from a 135M model
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
        assert "paris" in arguments["city"].lower()
        deltas = "".join(e["delta"] for e in talk.of("response.function_call_arguments.delta"))
        finished = talk.of("response.function_call_arguments.done")[-1]
        assert deltas == finished["arguments"] == call["arguments"] and finished["call_id"] == call["call_id"]
        # the client ran it: the output goes back in, and a text answer continues from it
        await connection.conversation.item.create(item={"type": "function_call_output",
                                                        "call_id": call["call_id"], "output": "21 degrees, sunny"})
        added = await talk.next("conversation.item.done")
        assert added["item"]["type"] == "function_call_output" and added["previous_item_id"] == call["id"]
        await connection.response.create(response={"tool_choice": "none"})
        done = await talk.next("response.done", timeout=120)
        assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
        text = done["response"]["output"][0]["content"][0]["text"]
        assert text.strip()
        assert "21" in text or "sunny" in text.lower(), text  # it read the function's output


async def test_required_with_two_tools_chooses_one_and_fills_its_schema(engine):
    async with talking(engine) as (connection, talk):
        await say(connection, "What time is it in Tokyo right now?")
        await connection.response.create(response={"tools": [WEATHER, TIME], "tool_choice": "required"})
        done = await talk.next("response.done", timeout=120)
        call = done["response"]["output"][0]
        assert call["type"] == "function_call" and call["name"] in ("get_weather", "get_time"), call
        arguments = json.loads(call["arguments"])
        required = {"get_weather": {"city", "unit"}, "get_time": {"city"}}[call["name"]]
        assert required <= set(arguments)


async def test_an_output_for_an_unknown_call_is_an_error_and_the_session_goes_on(engine):
    async with talking(engine) as (connection, talk):
        await connection.conversation.item.create(item={"type": "function_call_output", "call_id": "call_nope",
                                                        "output": "42"})
        error = await talk.next("error")
        assert error["error"]["code"] == "item_not_found" and error["error"]["param"] == "item.call_id"
        await connection.session.update(session={"type": "realtime", "tool_choice": "required"})
        error = await talk.next("error")  # required with no tools declared
        assert error["error"]["param"] == "session.tool_choice"
        await say(connection, "Say hello.")
        await connection.response.create()
        done = await talk.next("response.done", timeout=120)
        assert done["response"]["status"] in ("completed", "incomplete")


async def test_a_forced_call_among_many_long_tools_fits_the_question(engine):
    long = "Look the thing up in the company's systems and return what they say, with every detail they hold. " * 2
    tools = [{"type": "function", "name": f"lookup_{i}", "description": long, "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}} for i in range(8)]
    async with talking(engine) as (connection, talk):
        await say(connection, "Find the invoice for Acme.")
        await connection.response.create(response={"tools": [*tools, WEATHER],
                                                   "tool_choice": {"type": "function", "name": "lookup_3"}})
        done = await talk.next("response.done", timeout=120)
        # not failed with "the question is too long"; the arguments may run to max tokens (a 135M model adds keys)
        assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
        call = done["response"]["output"][0]
        assert call["name"] == "lookup_3" and call["arguments"].startswith('{"query":"'), call
