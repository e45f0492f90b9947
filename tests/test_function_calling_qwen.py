"""Function calling in Qwen2.5's own tool-call format through the official `openai` SDK against `runtime serve`,
answered by the real Qwen2.5-Coder-0.5B-Instruct on the local engine: the session's tools rendered by the model's
chat template, `auto` deciding at the first token, the call decoded under its grammar and streamed as a
`function_call` item with argument events (each event validated strictly against the SDK's models), and the client's
`function_call_output` going back in as a `tool` message that the answer reads."""

from __future__ import annotations

import json
import os

import pytest
from test_function_calling import WEATHER, say, talking
from weights_common import ON_QWEN_CODER

from runtime.errors import CheckpointNotFound
from runtime.models.lm import load_answerer
from runtime.models.loading import resolve_checkpoint
from runtime.profile_files import load_profile
from runtime.worker import DeviceWorker, Priority

# One xdist worker for the file: its module fixtures load the 0.5B and the 1.5B, which split across two workers
# were each loaded twice (20-60 s of setup per worker in the suite's runs)
pytestmark = [pytest.mark.asyncio, ON_QWEN_CODER]  # one worker: the module's fixtures load each model once

# An assistant's prompt: `demo`'s tells the model to reply "Not known yet" unless the transcript or the screen says,
# and both models then answer so with the function's output right before them (docs/llm.md)
ASSISTANT = "You are a helpful assistant. Answer in one short sentence."


def engine_for(model: str, worker: DeviceWorker, system_prompt: str | None = None):
    try:
        resolve_checkpoint(f"builtin:{model}", role="lm")
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))
    # eager steps (`lm.compile=off`): what these tests check is the calls and answers, which the compiled decode step
    # gives alike (tests/test_compiled_step.py holds it to the eager one); compiling cost 30-40 s a model here
    profile = load_profile("demo", overrides=[
        "pipeline.metrics_interval_s=0", "pipeline.turn_detection=none", f"lm.model=builtin:{model}",
        "lm.weights=native", "lm.grounded=false", "lm.max_new_tokens=48", "lm.compile=off",
        *([f"lm.system_prompt={system_prompt}"] if system_prompt else [])])
    answerer = worker.call(Priority.CONTROL, load_answerer, profile.lm, device="cpu", dtype="float32")
    assert answerer.tool_format is not None and answerer.tool_format.opener == "<tool_call>"
    return profile, worker, answerer


# Session-scoped: loaded once on the group's worker whatever order its tests run in (the module fixture was set up
# twice in CI, 15.5 s each, while pytest 9 left the xdist groups inert and these tests ran on both workers)
@pytest.fixture(scope="session")
def qwen05():
    with DeviceWorker() as worker:
        yield engine_for("qwen2.5-coder-0.5b-instruct", worker)


@pytest.fixture(scope="session")
def qwen15():
    with DeviceWorker() as worker:
        yield engine_for("qwen2.5-coder-1.5b-instruct", worker, ASSISTANT)


async def weather_call(connection, talk) -> dict:
    """Under `auto`, "What's the weather in Paris in celsius?" makes a get_weather call with exactly its arguments,
    streamed as argument deltas, never as text; returns the call item."""
    await connection.session.update(session={"type": "realtime", "tools": [WEATHER], "tool_choice": "auto"})
    await talk.next("session.updated")
    await say(connection, "What's the weather in Paris in celsius?")
    await connection.response.create()
    done = await talk.next("response.done", timeout=180)
    assert done["response"]["status"] == "completed", done["response"]
    call = done["response"]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather", call  # the model chose to call
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}, call["arguments"]
    deltas = "".join(e["delta"] for e in talk.of("response.function_call_arguments.delta"))
    finished = talk.of("response.function_call_arguments.done")[-1]
    assert deltas == finished["arguments"] == call["arguments"] and finished["call_id"] == call["call_id"]
    assert not talk.of("response.output_text.delta")  # the opener, the name and the closer are never text
    return call


async def answer_from_output(connection, talk, call: dict) -> str:
    """The client ran the call: its output goes back in (a `tool` message), and a `none` response answers."""
    await connection.conversation.item.create(item={"type": "function_call_output",
                                                    "call_id": call["call_id"], "output": "18 degrees, sunny"})
    await talk.next("conversation.item.done")
    await connection.response.create(response={"tool_choice": "none"})
    done = await talk.next("response.done", timeout=180)
    assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
    message = done["response"]["output"][0]
    assert message["type"] == "message", message
    return message["content"][0]["text"]


async def test_auto_calls_the_tool_a_question_needs_and_the_answer_after_the_output_misses_it(qwen05):
    """The call, then (a known failure, held as a strict xfail holds one: this fails once the 0.5B reads the output)
    the answer after its output. One conversation for both: the answer's check was a strict xfail test of its own
    that made the same call first (5 s of CPU here)."""
    async with talking(qwen05) as (connection, talk):
        text = await answer_from_output(connection, talk, await weather_call(connection, talk))
        # measured: Qwen2.5-Coder-0.5B answers "Not known yet." (demo's prompt) or writes the call again in a code
        # fence (a helpful-assistant prompt) after the output (docs/llm.md); the 1.5B reads it (the slow test below)
        assert "18" not in text, f"the 0.5B now reads the function's output: {text!r} (update docs/llm.md's table)"


async def hello(connection, talk) -> None:
    await connection.session.update(session={"type": "realtime", "tools": [WEATHER], "tool_choice": "auto"})
    await talk.next("session.updated")
    await say(connection, "Say hello.")
    await connection.response.create()
    done = await talk.next("response.done", timeout=180)
    output = done["response"]["output"]
    assert [o["type"] for o in output] == ["message"], output
    text = output[0]["content"][0]["text"]
    assert text.strip() and "<tool_call>" not in text and not text.lstrip().startswith("{"), text
    assert not talk.of("response.function_call_arguments.delta")


@pytest.mark.xfail(strict=True, reason="measured: Qwen2.5-Coder-0.5B starts every answer with a call when tools are "
                   "offered (call starts 0.85 of the first token's mass on 'Say hello.'; docs/llm.md)")
async def test_auto_answers_a_question_without_a_call_in_text(qwen05):
    async with talking(qwen05) as (connection, talk):
        await hello(connection, talk)


async def named_weather_call(connection, talk) -> dict:
    await connection.session.update(session={"type": "realtime", "tools": [WEATHER],
                                             "tool_choice": {"type": "function", "name": "get_weather"}})
    await talk.next("session.updated")
    await say(connection, "What's the weather in Paris in celsius?")
    await connection.response.create()
    done = await talk.next("response.done", timeout=300)
    call = done["response"]["output"][0]
    assert call["type"] == "function_call" and call["name"] == "get_weather", call
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}
    return call


async def test_a_named_function_is_called_in_the_template_format(qwen05):
    async with talking(qwen05) as (connection, talk):
        await named_weather_call(connection, talk)


@pytest.mark.slow  # loading the 1.5B takes 1.5-2 minutes on 2 shared cores; the test itself about 30 s
async def test_the_1_5b_calls_when_a_question_needs_it_and_answers_from_the_output(qwen15):
    async with talking(qwen15) as (connection, talk):
        text = await answer_from_output(connection, talk, await weather_call(connection, talk))
        assert "18" in text, text  # measured: "The weather in Paris is 18 degrees, sunny."


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="measured: the 1.5B calls get_weather for London on 'Say hello.' (docs/llm.md)")
async def test_the_1_5b_answers_hello_in_text(qwen15):
    async with talking(qwen15) as (connection, talk):
        await hello(connection, talk)
