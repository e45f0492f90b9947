"""Conversations held through the official `openai` SDK (`client.realtime.connect`) against a server started here:
manual turns, server VAD on speech with pauses, barge-in, cancel, clear, delete and a refused field. Every
server event is read raw and, when it is one of the API's types, validated strictly against the SDK's own model;
the runtime's own events are the `runtime.` ones.

The server runs stand-in ASR and answerer models (`session_fakes`: predictable words, a slow echo) beside the
real Silero VAD, so turn detection is the shipped model on real speech and the protocol is what is under test."""

from __future__ import annotations

import asyncio
import base64
import json
import typing

import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from session_fakes import EchoAnswerer, WordASR, profile_for
from weights_common import ON_QWEN_CODER

from runtime.io.sample import demo_speech
from runtime.loaded_models import Models, load_turn_models
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker

pytestmark = pytest.mark.asyncio

SDK_MODELS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
              for m in typing.get_args(typing.get_args(RealtimeServerEvent)[0])}
RATE = 24_000  # the API's PCM


def pcm24k(samples16k: np.ndarray) -> bytes:
    """16 kHz float audio as the API's 24 kHz PCM16 (linear interpolation is plenty for a VAD)."""
    t = np.arange(round(len(samples16k) * 1.5)) / RATE
    resampled = np.interp(t, np.arange(len(samples16k)) / 16_000, samples16k)
    return (np.clip(resampled, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()


def sentences() -> tuple[np.ndarray, np.ndarray]:
    """Two spoken sentences of the demo (espeak-ng), each followed by a second of silence."""
    speech, pause = demo_speech(), np.zeros(16_000, np.float32)
    return np.concatenate([speech[: int(2.7 * 16_000)], pause]), np.concatenate([speech[int(2.7 * 16_000):
                                                                                        int(6.1 * 16_000)], pause])


@pytest.fixture(scope="module")
def turn_models():
    models = load_turn_models()
    assert models is not None, "make install installs the turn-detection models (pipecat-ai, requirements/weights.txt)"
    return models


class Conversation:
    """One SDK connection: sends through the SDK's typed helpers, reads raw events and checks each one."""

    def __init__(self, connection) -> None:
        self.conn, self.events = connection, []

    async def next(self, kind: str, timeout: float = 30.0) -> dict:
        """Events up to and including the next of `kind` (all checked); returns that one."""
        while True:
            raw = await asyncio.wait_for(self.conn.recv_bytes(), timeout)
            event = json.loads(raw)
            check(event)
            self.events.append(event)
            if event["type"] == kind:
                return event

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    async def send_audio(self, samples16k: np.ndarray, chunk_s: float = 0.1) -> None:
        raw, step = pcm24k(samples16k), int(RATE * chunk_s) * 2
        for i in range(0, len(raw), step):
            await self.conn.input_audio_buffer.append(audio=base64.b64encode(raw[i : i + step]).decode())


def check(event: dict) -> None:
    """An API type validates strictly against the SDK's model; anything else is the runtime's own."""
    model = SDK_MODELS.get(event["type"])
    if model is None:
        assert event["type"].startswith("runtime."), f"neither the SDK's nor namespaced: {event['type']}"
        return
    model.model_validate(event, strict=True)


async def start(turn_models, answerer=None, **pipeline):
    profile = profile_for(metrics_interval_s=0, **pipeline)
    worker = DeviceWorker()
    worker.start()
    models = Models(WordASR(per_item=1000), answerer or EchoAnswerer(), turns=turn_models)
    server = await RealtimeServer(profile, models, worker, port=0).start()
    client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
    return server, worker, client


async def stop(server, worker) -> None:
    await server.stop()
    worker.stop()


async def test_two_manual_turns_in_one_session(turn_models):
    server, worker, client = await start(turn_models)
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            created = await talk.next("session.created")
            assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
            await connection.session.update(session={
                "type": "realtime", "instructions": "Answer briefly.",
                "audio": {"input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}}})
            updated = await talk.next("session.updated")
            assert updated["session"]["audio"]["input"]["turn_detection"] is None
            assert updated["session"]["instructions"] == "Answer briefly."
            first, second = sentences()
            answers, items = [], []
            for turn in (first, second):
                await talk.send_audio(turn)
                await connection.input_audio_buffer.commit()
                await connection.response.create()
                committed = await talk.next("input_audio_buffer.committed")
                items.append(committed["item_id"])
                done = await talk.next("response.done")
                answers.append(done["response"])
            # the second turn follows the first turn's answer in the conversation
            assert talk.of("input_audio_buffer.committed")[1]["previous_item_id"] == answers[0]["output"][0]["id"]
            completed = {e["item_id"]: e for e in talk.of("conversation.item.input_audio_transcription.completed")}
            assert set(completed) == set(items)
            assert [completed[i]["usage"]["seconds"] for i in items] == pytest.approx([3.7, 4.4], abs=0.11)
            assert all(r["status"] == "completed" and r["usage"]["output_tokens"] > 0 for r in answers)
            # each response answered its own turn, with the session's instructions: the echo spells back the
            # question it was given
            texts = [r["output"][0]["content"][0]["text"] for r in answers]
            assert [t.split("->")[0] for t in texts] == [completed[i]["transcript"] + "\n\nInstructions: Answer "
                                                         "briefly." for i in items]
            assert texts[0].endswith(completed[items[0]]["transcript"].split()[-1])
            kinds = [e["type"] for e in talk.events if e["type"].startswith("response.")]
            one = ["response.created", "response.output_item.added", "response.content_part.added"]
            assert kinds[:3] == one and kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                                                       "response.output_item.done", "response.done"]
    finally:
        await stop(server, worker)


async def test_server_vad_commits_at_the_pauses_and_answers_each_turn(turn_models):
    server, worker, client = await start(turn_models)
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            created = await talk.next("session.created")
            assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"  # the default
            # the audio goes faster than real time: the first answer would still run when the second sentence
            # starts, and barge-in (tested below) would cancel it
            await connection.session.update(session={"audio": {"input": {"turn_detection": {
                "type": "server_vad", "interrupt_response": False}}}})
            await talk.next("session.updated")
            first, second = sentences()
            await talk.send_audio(np.concatenate([first, second]))
            for _ in range(2):
                await talk.next("response.done")
            started = talk.of("input_audio_buffer.speech_started")
            stopped = talk.of("input_audio_buffer.speech_stopped")
            committed = talk.of("input_audio_buffer.committed")
            assert len(started) == len(stopped) == len(committed) == 2
            # speech starts near each sentence (prefix padding: 300 ms before the onset) and stops at its end
            assert started[0]["audio_start_ms"] < 400 and 3_300 < started[1]["audio_start_ms"] < 4_000
            assert 2_300 < stopped[0]["audio_end_ms"] < 2_900 and 6_600 < stopped[1]["audio_end_ms"] < 7_200
            assert [s["item_id"] for s in stopped] == [c["item_id"] for c in committed]
            answered = [r["response"]["output"][0]["content"][0]["text"] for r in talk.of("response.done")]
            assert len(answered) == 2 and all("->" in text for text in answered)  # no response.create was sent
    finally:
        await stop(server, worker)


async def test_speech_during_an_answer_cancels_it(turn_models):
    server, worker, client = await start(turn_models, EchoAnswerer(step_s=0.05))
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            await talk.next("session.created")
            await connection.session.update(session={"audio": {"input": {"turn_detection": {
                "type": "server_vad", "create_response": False, "interrupt_response": True}}}})
            await talk.next("session.updated")
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 400}]})
            await connection.response.create()
            await talk.next("response.output_text.delta")  # answering (400 steps of 50 ms)
            first, _ = sentences()
            await talk.send_audio(first)
            done = await talk.next("response.done")
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
            assert talk.of("input_audio_buffer.speech_started")  # what cut it short
    finally:
        await stop(server, worker)


async def test_cancel_clear_delete_and_a_refused_field_keep_the_session(turn_models):
    server, worker, client = await start(turn_models, EchoAnswerer(step_s=0.05))
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            await talk.next("session.created")
            await connection.send({"type": "session.update", "event_id": "bad",
                                   "session": {"type": "realtime", "speed": 2}})
            error = await talk.next("error")
            assert error["error"]["event_id"] == "bad" and error["error"]["param"] == "session.speed"
            await connection.session.update(session={"audio": {"input": {"turn_detection": None}}})
            await talk.next("session.updated")
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "y" * 200}]})
            added = await talk.next("conversation.item.added")
            await connection.response.create()
            created = await talk.next("response.created")
            await connection.response.cancel(response_id=created["response"]["id"])
            done = await talk.next("response.done")
            assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
            first, _ = sentences()
            await talk.send_audio(first[:8000])
            await connection.input_audio_buffer.clear()
            await talk.next("input_audio_buffer.cleared")
            await connection.send({"type": "input_audio_buffer.commit", "event_id": "empty"})
            assert (await talk.next("error"))["error"]["code"] == "input_audio_buffer_commit_empty"
            # the cancelled answer is an assistant item of text: its audio is 0 ms long, so 0 is the only cut
            answer_item = done["response"]["output"][0]["id"]
            await connection.conversation.item.truncate(item_id=answer_item, content_index=0, audio_end_ms=0)
            assert (await talk.next("conversation.item.truncated"))["item_id"] == answer_item
            await connection.send({"type": "conversation.item.truncate", "event_id": "late", "item_id": answer_item,
                                   "content_index": 0, "audio_end_ms": 1500})
            late = (await talk.next("error"))["error"]
            assert late["code"] == "invalid_value" and "0 ms" in late["message"]
            item_id = added["item"]["id"]
            await connection.conversation.item.retrieve(item_id=item_id)
            assert (await talk.next("conversation.item.retrieved"))["item"]["id"] == item_id
            await connection.conversation.item.delete(item_id=item_id)
            assert (await talk.next("conversation.item.deleted"))["item_id"] == item_id
            await connection.send({"type": "conversation.item.retrieve", "event_id": "gone", "item_id": item_id})
            assert (await talk.next("error"))["error"]["code"] == "item_not_found"
            # still a working session: an out-of-band answer to a request's own input
            await connection.response.create(response={"conversation": "none", "input": [{
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
            done = await talk.next("response.done")
            assert done["response"]["status"] == "completed" and done["response"]["conversation_id"] is None
            assert done["response"]["output"][0]["content"][0]["text"].startswith("hi->")
    finally:
        await stop(server, worker)


@pytest.mark.slow
@ON_QWEN_CODER
async def test_a_spoken_question_is_answered_from_what_was_said_with_the_shipped_models(tmp_path):
    """The default profile's real models (Whisper tiny.en two-pass, Qwen2.5-Coder-1.5B-Instruct, Silero VAD) behind
    the SDK: a statement, then a spoken question; turn detection commits each and answers the question from the
    first."""
    from runtime.loaded_models import load_models
    from runtime.profile_files import load_profile
    from runtime.train.synthesizers import Voice, resample, synthesize

    profile = load_profile("demo", overrides=["pipeline.metrics_interval_s=0"])
    rng = np.random.default_rng(0)

    def said(text: str) -> np.ndarray:
        audio, rate, _ = synthesize(Voice("espeak", "en-us"), text, rng)
        return np.concatenate([resample(audio, rate, 16_000), np.zeros(16_000, np.float32)])

    with DeviceWorker() as worker:
        models = load_models(profile, worker)
        assert models.turns is not None
        async with RealtimeServer(profile, models, worker, port=0) as server:
            client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
            async with client.realtime.connect(model="gpt-realtime") as connection:
                talk = Conversation(connection)
                await talk.next("session.created")
                await connection.session.update(session={"audio": {"input": {"turn_detection": {
                    "type": "server_vad", "create_response": False}}}})
                await talk.next("session.updated")
                await talk.send_audio(said("The meeting moved to Thursday at ten."))
                statement = await talk.next("conversation.item.input_audio_transcription.completed")
                await connection.session.update(session={"audio": {"input": {"turn_detection": {
                    "type": "server_vad", "create_response": True}}}})
                await talk.next("session.updated")
                # "When is the meeting?", as espeak says it and the turn is cut, is "Well, it's the meeting." to
                # tiny.en in float32 (torch and the ONNX graph alike); only the bfloat16 pass heard it right. This
                # question is transcribed right by all three.
                await talk.send_audio(said("What day is the meeting?"))
                done = await talk.next("response.done", timeout=120)
    question = talk.of("conversation.item.input_audio_transcription.completed")[-1]["transcript"]
    answer = done["response"]["output"][0]["content"][0]["text"]
    assert "thursday" in statement["transcript"].lower() and "meeting" in question.lower(), (statement, question)
    # The words of the answer may vary with how the prefill happened to be cut into jobs (the context is the same,
    # the float rounding of a chunked prefill is not). Either way it answers from the statement.
    assert done["response"]["status"] in ("completed", "incomplete"), done["response"]
    assert "thursday" in answer.lower() or "at ten" in answer.lower(), answer


async def test_a_spoken_message_sent_whole_is_transcribed_and_answered(turn_models):
    server, worker, client = await start(turn_models)
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            await talk.next("session.created")
            first, _ = sentences()
            audio = base64.b64encode(pcm24k(first[:16_000])).decode()  # one second
            await connection.conversation.item.create(item={
                "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]})
            completed = await talk.next("conversation.item.input_audio_transcription.completed")
            done = await talk.next("conversation.item.done")
            # its own ASR stream, in the session's 100 ms chunks: the stand-in hears one word per chunk
            assert completed["transcript"] == " ".join(f"w{i}" for i in range(10))
            assert done["item"]["id"] == completed["item_id"]
            assert done["item"]["content"] == [{"type": "input_audio", "transcript": completed["transcript"]}]
            await connection.response.create()
            answer = await talk.next("response.done")
            assert answer["response"]["output"][0]["content"][0]["text"].startswith(completed["transcript"] + "->")
    finally:
        await stop(server, worker)


async def test_silence_after_an_answer_triggers_the_idle_timeout_and_an_answer(turn_models):
    server, worker, client = await start(turn_models)
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            await talk.next("session.created")
            await connection.session.update(session={"audio": {"input": {"turn_detection": {
                "type": "server_vad", "idle_timeout_ms": 5000}}}})
            await talk.next("session.updated")
            first, _ = sentences()
            await talk.send_audio(first)
            await talk.next("response.done")  # the spoken turn, answered
            await talk.send_audio(np.zeros(7 * 16_000, np.float32))  # then nobody speaks
            timeout = await talk.next("input_audio_buffer.timeout_triggered")
            committed = await talk.next("input_audio_buffer.committed")
            done = await talk.next("response.done")
            assert committed["item_id"] == timeout["item_id"]
            assert 4_900 <= timeout["audio_end_ms"] - timeout["audio_start_ms"] <= 5_200
            assert done["response"]["output"][0]["content"][0]["text"].startswith("(The user has said nothing")
            assert len(talk.of("input_audio_buffer.timeout_triggered")) == 1  # once per answer
    finally:
        await stop(server, worker)


async def test_the_sdks_beta_client_is_told_this_is_the_ga_api(turn_models):
    """The beta protocol's events and fields differ, so its client would wait in silence: it hears why at once,
    and a beta field name in its update says where the GA API has it. The GA client hears no such thing."""
    server, worker, client = await start(turn_models)
    try:
        async with client.beta.realtime.connect(model="gpt-realtime") as connection:
            events = [json.loads(await asyncio.wait_for(connection.recv_bytes(), 30)) for _ in range(2)]
            assert [e["type"] for e in events] == ["session.created", "error"]
            assert events[1]["error"]["code"] == "beta_protocol"
            assert "client.realtime.connect" in events[1]["error"]["message"]
            await connection.session.update(session={"modalities": ["text"]})
            error = json.loads(await asyncio.wait_for(connection.recv_bytes(), 30))
            assert error["error"]["code"] == "unknown_parameter"
            assert "the GA API's is session.output_modalities" in error["error"]["message"]
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Conversation(connection)
            await talk.next("session.created")
            await connection.session.update(session={"type": "realtime", "parallel_tool_calls": False})
            await talk.next("session.updated")
            assert not talk.of("error")
    finally:
        await stop(server, worker)
