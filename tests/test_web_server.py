"""The websocket server with the real tiny models, driven through the SDK: a full round trip, /healthz, bad
client events answered with errors while the session carries on, disconnects that leave nothing behind, and
the session limit."""

import asyncio
import base64
import gc
import json
import math
import time
import urllib.request
import weakref

import numpy as np
import pytest
from cli_common import one_error_line, run_cli
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from runtime import cli
from runtime.client import AsyncRealtimeClient, encode_jpeg, pcm16_bytes
from runtime.config import with_overrides
from runtime.errors import UserError
from runtime.io.sample import demo_speech, render_frame
from runtime.loaded_models import load_models
from runtime.profile_files import load_profile
from runtime.session import Session
from runtime.web.binary_messages import MAX_MESSAGE_BYTES, binary_audio, binary_frame
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker

CHUNK = 1600  # 100 ms


@pytest.fixture(scope="module")
def tiny():
    profile = load_profile("tiny", overrides=["pipeline.metrics_interval_s=0", "lm.max_new_tokens=8"])
    with DeviceWorker() as worker:
        yield profile, load_models(profile, worker), worker  # RealtimeServer(*tiny) order


def url(server: RealtimeServer) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/realtime"


async def stream_demo(client: AsyncRealtimeClient, seconds: float = 3.0) -> None:
    speech = demo_speech()[: int(seconds * 16000)]
    for i in range(0, len(speech), CHUNK):
        await client.append_audio(speech[i : i + CHUNK])
        if i % 16000 == 0:
            await client.append_frame(render_frame(i / 16000, 160, 120), i / 16000)


def check_round_trip(events: list) -> None:
    types = [e.type for e in events]
    assert types[0] == "session.created"
    assert types[-1] == "runtime.metrics"  # final metrics, then the server closes
    assert "conversation.item.input_audio_transcription.completed" in types
    created, done = types.index("response.created"), types.index("response.done")
    deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert created < min(deltas) and max(deltas) < done
    done_event = events[done]
    assert done_event.response["status"] in ("completed", "incomplete")  # random weights may hit the token limit
    assert done_event.media_time == pytest.approx(3.0)
    heard = [e.media_time for e in events if e.type.startswith("conversation.item.input_audio")]
    assert heard == sorted(heard) and all(0 < t <= 3.0 + 1e-6 for t in heard)


@pytest.mark.asyncio
async def test_sdk_round_trip_and_healthz(tiny):
    async with RealtimeServer(*tiny, port=0) as server:
        health = json.loads(await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10).read()))
        assert health["sessions"] == 0 and health["device"] == "cpu" and "worker" in health
        async with AsyncRealtimeClient(url(server)) as client:
            await client.update_session(instructions="Answer briefly.")
            await stream_demo(client)
            await client.ask("what moved?")
            await wait_until(lambda: server.sessions)  # the session opens on the worker after the handshake
            health = json.loads(await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10).read()))
            assert health["sessions"] == 1 and set(next(iter(health["queues"].values()))) == {
                "audio", "video", "questions", "events"}
            await client.finish()
            events = [e async for e in client.events()]
        assert "session.updated" in [e.type for e in events]
        check_round_trip(events)
        assert events[-1].metrics["video"]["frames_in"] == 3
        await wait_until(lambda: not server.sessions)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_binary_media_fast_path_round_trip(tiny):
    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server), binary=True) as client:
        await stream_demo(client)
        assert client._seq == 33  # 30 audio chunks and 3 frames went as binary messages
        await client.ask("what moved?")
        await client.finish()
        events = [e async for e in client.events()]
    assert not [e for e in events if e.type == "error"]
    check_round_trip([e for e in events])
    assert events[-1].metrics["video"]["frames_in"] == 3 and events[-1].metrics["asr"]["pushed_until"] >= 3.0


@pytest.mark.asyncio
async def test_frames_over_the_rate_are_dropped_and_audio_over_it_waits(tiny):
    profile, models, worker = tiny
    bounded = with_overrides(profile, serve={"max_frames_per_s": 2.0, "max_audio_speed": 2.0, "audio_burst_s": 1.0})
    jpeg = encode_jpeg(render_frame(0.0, 160, 120))
    async with RealtimeServer(bounded, models, worker, port=0) as server, AsyncRealtimeClient(url(server)) as client:
        frame_ids = [await client.append_frame(jpeg, i * 0.1) for i in range(8)]  # 8 frames at once: 2 pass
        speech = demo_speech()[: 3 * 16000]
        started = time.perf_counter()
        for i in range(0, len(speech), CHUNK):  # as fast as the server takes it
            await client.append_audio(speech[i : i + CHUNK])
        await client.ask("what moved?")
        await client.finish()
        events = [e async for e in client.events()]
        waited = time.perf_counter() - started
    refused = [e for e in events if e.type == "error"]
    assert refused and all((e.error["code"], e.error["param"]) == ("rate_limited", "image") for e in refused)
    assert refused[0].error["event_id"] == frame_ids[2]  # the first frame over the burst
    types = [e.type for e in events]  # the session still transcribed and answered
    assert "conversation.item.input_audio_transcription.completed" in types and "response.done" in types
    final = events[-1].metrics
    assert 2 <= final["video"]["frames_in"] < 8
    # every frame drop is in the metrics, also those no error reported (at most one error a second)
    assert final["rate_limited"]["image"] == 8 - final["video"]["frames_in"] > len(refused)
    # no audio was lost: the burst holds 2 s (a wall second at 2x), the third second waited half a second, less the
    # time the client itself took to send what came before it (0.13 s once, on a loaded machine)
    assert final["asr"]["pushed_until"] == pytest.approx(3.0)
    assert waited >= 0.45 and 0.1 <= final["rate_limited"]["audio_paced_s"] <= waited


@pytest.mark.asyncio
async def test_bad_events_are_answered_and_the_session_carries_on(tiny):
    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server)) as client:
        bad = {
            "b1": ("not json at all", "invalid_json"),
            "b2": ({"type": "mystery.event"}, "unknown_event_type"),
            "b3": ({"type": "input_audio_buffer.append", "audio": "%%%"}, "invalid_base64"),
            "b4": ({"type": "input_audio_buffer.append", "audio": "AAEC"}, "invalid_audio"),  # 3 bytes
            "b5": ({"type": "runtime.input_video_frame.append", "image": "AAAA", "timestamp": 0.5}, "invalid_image"),
            "b6": ({"type": "runtime.input_video_frame.append", "image": "AAAA"}, "missing_field"),
            "b7": ({"type": "response.create", "response": {"output_modalities": ["audio"]}},
                   "unsupported_modality"),  # this server loaded no voice
            "b8": ({"type": "response.cancel"}, "response_not_found"),
            "b9": ({"type": "response.create", "pad": "x" * (MAX_MESSAGE_BYTES + 10)}, "message_too_large"),
        }
        for event_id, (body, _) in bad.items():
            if isinstance(body, dict):
                body = json.dumps({"event_id": event_id, **body})
            await client.ws.send(body)
        await stream_demo(client)
        await client.ask("what moved?")
        await client.finish()
        events = [e async for e in client.events()]
    errors = [e for e in events if e.type == "error"]
    codes = [(e.error["event_id"], e.error["code"]) for e in errors]
    expected = [(None if k == "b1" else k, code) for k, (_, code) in bad.items()]
    assert codes == expected
    assert all(e.error["message"] for e in errors)
    check_round_trip(events)


DOCUMENTED_CODES = {  # docs/protocol.md, "Errors"
    "invalid_json", "invalid_event", "invalid_binary_header", "rate_limited", "unknown_event_type", "missing_field",
    "invalid_value",
    "invalid_base64", "invalid_audio", "invalid_image", "image_too_large", "unsupported_field", "unsupported_item",
    "message_too_large", "no_pending_item", "response_not_found", "session_finishing", "empty_question",
    "question_queue_full", "audio_from_track", "unknown_parameter", "unsupported_modality", "unsupported_content",
    "item_not_found", "duplicate_item_id", "input_audio_buffer_commit_empty", "prompt_too_long",
    "conversation_already_has_active_response", "beta_protocol",
    "invalid_tool_schema", "speech_failed"}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def malformed_messages() -> list[tuple[str | bytes, str | None, str | None]]:
    """(message, expected error.event_id, expected code) for client messages sent before any input, each
    refused with exactly one recoverable error; a code of None marks a well-formed message that sets up the
    next one (it gets no error). Frames past the websockets hard cap close the connection by design and are
    left to test_disconnects_leave_nothing_behind."""
    cases: list[tuple[str | bytes, str | None, str | None]] = []

    def add(body: dict, code: str | None) -> None:
        event_id = f"m{len(cases)}"
        cases.append((json.dumps({"event_id": event_id, **body}), event_id, code))

    def unparsed(message: str | bytes, code: str) -> None:  # no event_id can be named
        cases.append((message, None, code))

    # Not JSON: truncations of a valid event and assorted garbage.
    valid = json.dumps({"event_id": "never", "type": "response.create"})
    for cut in (1, 2, 10, 20, len(valid) // 2, len(valid) - 1):
        unparsed(valid[:cut], "invalid_json")
    for text in ("", " ", "\n", "not json at all", "{'type': 'response.create'}", '{"type": "response.create",}',
                 "{type: 1}", '{"a" 1}', "[1, 2", "nul", '"unterminated', "{}}", valid + valid, "\x00"):
        unparsed(text, "invalid_json")
    # JSON, but not an object.
    for text in ("[]", json.dumps([{"type": "response.create"}]), "1", "-2.5", '"response.create"', "null", "true",
                 "false", "NaN", "Infinity"):
        unparsed(text, "invalid_event")
    # An event_id that is not a string cannot be echoed.
    for bad_id in (7, 1.5, [], {}, True):
        unparsed(json.dumps({"event_id": bad_id, "type": "response.create"}), "invalid_value")
    # Unknown, missing or mistyped `type`.
    for kind in ("mystery.event", "", "response.create ", "Response.Create", "response", "session.create",
                 "input_video_frame.append", "runtime.session.end", "response.cancelled", "input_video_frame",
                 "input_text", "error", None, 5, ["response.create"], {"name": "response.create"}, True):
        add({"type": kind}, "unknown_event_type")
    add({}, "missing_field")
    # Half a UTF-16 pair (json.loads takes it; it could be neither tokenized nor sent back) and deep nesting.
    cases.append(('{"type": "response.create", "event_id": "sur1", "x": "\\ud800"}', "sur1", "invalid_json"))
    cases.append(('{"event_id": "sur2", "type": "conversation.item.create", "item": {"content": [{"type": '
                  '"input_text", "text": "why \\udc00"}]}}', "sur2", "invalid_json"))
    cases.append(('{"event_id": "deep", "type": "response.create", "x": ' + "[" * 5000 + "]" * 5000 + "}", "deep",
                  "invalid_json"))
    # session.update
    add({"type": "session.update"}, "missing_field")
    for session in ("pcm16", [], None, 1):
        add({"type": "session.update", "session": session}, "invalid_value")
    for session in ({"voice": "alloy"}, {"modalities": ["text"]}, {"input_audio_format": "pcm16"}):
        add({"type": "session.update", "session": session}, "unknown_parameter")
    add({"type": "session.update", "session": {"audio": {"input": {"noise_reduction": {}}}}}, "unsupported_field")
    for session in ({"tools": [{"type": "function", "name": "no spaces"}]}, {"tool_choice": "required"}):
        add({"type": "session.update", "session": session}, "invalid_value")
    add({"type": "session.update", "session": {"output_modalities": ["audio"]}}, "unsupported_modality")
    for fmt in ("g711_ulaw_x", None, 16000, {"type": "audio/pcm", "rate": 44100}, {"type": "audio/opus"}):
        add({"type": "session.update", "session": {"audio": {"input": {"format": fmt}}}}, "invalid_value")
    for modalities in ({"not": "a list"}, "text", ["text", 1], ["text", "text"]):
        add({"type": "session.update", "session": {"output_modalities": modalities}}, "invalid_value")
    for detection in ({"type": "push_to_talk"}, {"threshold": -1}, {"silence_duration_ms": "long"}, "server_vad"):
        add({"type": "session.update", "session": {"audio": {"input": {"turn_detection": detection}}}},
            "invalid_value")
    # input_audio_buffer.append: field, base64, PCM
    append = "input_audio_buffer.append"
    add({"type": append}, "missing_field")
    for audio in (123, None, [], True, {"data": "AAAA"}, 1.5):
        add({"type": append, "audio": audio}, "invalid_value")
    for text in ("%%%", "abc", "A", "AA=A", "ÿÿÿÿ", "AB CD", "====", "YQ", "-_-_", "AAA*"):
        add({"type": append, "audio": text}, "invalid_base64")
    for n in (1, 3, 5, 7, 101, 3201):
        add({"type": append, "audio": b64(bytes(n))}, "invalid_audio")
    # input_video_frame.append: fields, timestamp values, images that do not decode
    frame = "runtime.input_video_frame.append"
    jpeg = encode_jpeg(render_frame(1.0, 160, 120))
    add({"type": frame, "timestamp": 0.5}, "missing_field")
    add({"type": frame, "image": b64(jpeg)}, "missing_field")
    for image in (1, None, [], True):
        add({"type": frame, "image": image, "timestamp": 0.5}, "invalid_value")
    for text in ("%%%", "not base64!"):
        add({"type": frame, "image": text, "timestamp": 0.5}, "invalid_base64")
    for timestamp in ("0.5", None, [0.5], True, {}, -1, -0.001, math.nan, math.inf, -math.inf,
                      1e6, 1e12):  # the last two: far beyond any media time the session can have reached
        add({"type": frame, "image": b64(jpeg), "timestamp": timestamp}, "invalid_value")
    garbage = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8).tobytes()
    for raw in (b"", garbage, b"\x89PNG\r\n\x1a\n" + garbage, b"\xff\xd8\xff" + bytes(500), b"GIF89a" + bytes(30),
                jpeg[:2] + bytes(len(jpeg) - 2), jpeg[:2], jpeg[:20], jpeg[:100], jpeg[:400]):
        add({"type": frame, "image": b64(raw), "timestamp": 0.5}, "invalid_image")
    # conversation.item.create
    item = "conversation.item.create"
    add({"type": item}, "missing_field")
    for value in ("what moved?", [], None):
        add({"type": item, "item": value}, "invalid_value")
    for value in ({"type": "function_call"}, {"type": "function_call_output"}, {"type": "function_call_output",
                                                                              "call_id": "call_1"}):
        add({"type": item, "item": value}, "missing_field")
    add({"type": item, "item": {"type": "function_call_output", "call_id": "call_1", "output": "x"}}, "item_not_found")
    for value in ({"type": "mcp_call"}, {"type": "mcp_approval_response"}):
        add({"type": item, "item": value}, "unsupported_item")
    for value in ({}, {"content": []}, {"content": "what moved?"}, {"role": "assistant"}, {"role": "system"}):
        add({"type": item, "item": value}, "missing_field")
    for content in ([{"type": "input_text", "text": 5}], ["what moved?"], [{"type": "input_text"}],
                    [{"type": "input_text", "text": "hi"}, None]):
        add({"type": item, "item": {"content": content}}, "invalid_value")
    add({"type": item, "item": {"content": [{"type": "input_audio", "audio": "AAAA"}]}}, "invalid_audio")  # 3 bytes
    add({"type": item, "item": {"content": [{"type": "input_audio", "audio": b64(bytes(200))}]}}, "invalid_audio")
    add({"type": item, "item": {"content": [{"type": "input_image", "image_url": "x"}]}}, "unsupported_content")
    add({"type": item, "item": {"role": "user", "content": [{"type": "input_text", "text": "x"}]},
         "previous_item_id": "item_nope"}, "item_not_found")
    for kind in ("conversation.item.delete", "conversation.item.retrieve"):
        add({"type": kind, "item_id": "item_nope"}, "item_not_found")
    add({"type": "conversation.item.truncate", "item_id": "x", "content_index": 0, "audio_end_ms": 0},
        "item_not_found")
    add({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty")
    # Out of order: nothing to cancel; a blank question is nothing to answer; no voice to speak with.
    add({"type": "response.create", "response": {"output_modalities": ["audio"]}}, "unsupported_modality")
    add({"type": "response.create", "response": {"modalities": ["text"]}}, "unknown_parameter")
    add({"type": "response.create", "response": {"input": [{"type": "item_reference", "id": "item_nope"}]}},
        "item_not_found")
    for given in ([], [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": " "}]}]):
        add({"type": "response.create", "response": {"conversation": "none", "input": given}}, "no_pending_item")
    add({"type": "response.cancel"}, "response_not_found")
    add({"type": "response.cancel", "response_id": "resp_nope"}, "response_not_found")
    for response_id in (5, []):
        add({"type": "response.cancel", "response_id": response_id}, "invalid_value")
    add({"type": item, "item": {"content": [{"type": "input_text", "text": "   "}]}}, None)
    # Over MAX_MESSAGE_BYTES but under the hard cap: refused unparsed; the event_id is named when it comes early.
    pad = "x" * (MAX_MESSAGE_BYTES + 10)
    add({"type": "response.create", "pad": pad}, "message_too_large")
    unparsed(json.dumps({"pad": pad, "event_id": "late", "type": "response.create"}), "message_too_large")
    unparsed("y" * (MAX_MESSAGE_BYTES + 1), "message_too_large")
    # Binary fast path: short or unknown headers, then well-framed messages with bad payloads (named bin-SEQ).
    for raw in (b"", b"\x00", b"A", b"V\x01\x00\x00"):  # shorter than the header: no sequence to name
        unparsed(raw, "invalid_binary_header")
    for raw in (b"\xff" * 16, valid.encode(), b"a\x00\x00\x00\x00" + bytes(8), jpeg,
                pcm16_bytes(np.ones(CHUNK, np.float32))[1:]):  # unknown kinds; bytes 1-4 still read as the sequence
        cases.append((raw, f"bin-{int.from_bytes(raw[1:5], 'little')}", "invalid_binary_header"))
    cases.append((bytes(MAX_MESSAGE_BYTES + 10), "bin-0", "message_too_large"))
    cases.append((binary_audio(15, bytes(MAX_MESSAGE_BYTES + 10)), "bin-15", "message_too_large"))
    for seq, raw, code in ((7, binary_audio(7, bytes(3)), "invalid_audio"),
                           (8, binary_frame(8, 0.5, garbage), "invalid_image"),
                           (9, binary_frame(9, -1.0, jpeg), "invalid_value"),
                           (10, binary_frame(10, math.nan, jpeg), "invalid_value"),
                           (11, binary_frame(11, 0.5, b"")[:9], "invalid_binary_header"),
                           (12, b"Q" + (12).to_bytes(4, "little") + jpeg, "invalid_binary_header"),
                           (13, binary_frame(13, 1e9, jpeg), "invalid_value"),
                           # under the size limit but longer than the audio burst (120 s): never admissible
                           (14, binary_audio(14, bytes(2 * 16000 * 125)), "message_too_large")):
        cases.append((raw, f"bin-{seq}", code))
    return cases


@pytest.mark.asyncio
async def test_one_response_at_a_time_joins_the_conversation_and_a_failed_one_leaves_the_turn_to_answer(tiny):
    """As the Realtime API does: a second `response.create` while one is queued or running is refused at once (an
    out-of-band one may run beside it), and a response the answerer refuses adds no item, so a retry answers the
    same turn."""
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what moved?"}]}

    async def send(*bodies: dict) -> None:
        for body in bodies:
            await client.ws.send(json.dumps(body))

    async def until_done(count: int) -> list:
        seen = []
        async for event in client.events():
            seen.append(event)
            if sum(e.type == "response.done" for e in seen) == count:
                return seen
        raise AssertionError("the session ended first")

    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server)) as client:
        await send({"type": "conversation.item.create", "item": user}, {"type": "response.create", "event_id": "r1"},
                   {"type": "response.create", "event_id": "r2"},
                   {"type": "response.create", "event_id": "r3", "response": {"conversation": "none",
                                                                              "input": [user]}})
        first = await until_done(2)
        await send({"type": "conversation.item.create", "item": user},
                   {"type": "response.create", "event_id": "long", "response": {"instructions": "be brief " * 300}})
        second = await until_done(1)
        await send({"type": "response.create", "event_id": "retry"})
        await client.finish()
        third = [e async for e in client.events()]
    errors = [(e.error["event_id"], e.error["code"]) for e in first + second + third if e.type == "error"]
    assert errors == [("r2", "conversation_already_has_active_response"), ("long", "prompt_too_long")]
    created = [e.response["conversation_id"] for e in first if e.type == "response.created"]
    assert created == ["auto", None]  # r1, and r3 out of band beside it; r2 made no response
    failed = next(e.response for e in second if e.type == "response.done")
    assert failed["status"] == "failed" and failed["output"] == []
    assert [e.item["role"] for e in second if e.type == "conversation.item.added"] == ["user"]  # no empty answer
    retried = [e.response for e in third if e.type == "response.done"]
    assert len(retried) == 1 and retried[0]["status"] in ("completed", "incomplete")  # random weights: any length
    assert retried[0]["output"][0]["role"] == "assistant"


@pytest.mark.asyncio
async def test_a_hundred_malformed_messages_each_get_an_error_and_the_session_still_answers(tiny):
    cases = malformed_messages()
    assert sum(code is not None for _, _, code in cases) >= 100
    assert len({message for message, _, _ in cases}) == len(cases)  # all distinct
    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server)) as client:
        for message, _, _ in cases:
            await client.ws.send(message)
        await stream_demo(client)
        await client.ask("what moved?")
        await client.finish()
        late = [await client.finish(), await client.append_audio(np.zeros(CHUNK, np.float32))]  # after the end
        events = [e async for e in client.events()]
        await wait_until(lambda: not server.sessions)
    errors = [e for e in events if e.type == "error"]
    expected = [(event_id, code) for _, event_id, code in cases if code is not None]
    expected += [(event_id, "session_finishing") for event_id in late]
    assert [(e.error["event_id"], e.error["code"]) for e in errors] == expected
    assert all(e.error["message"] and e.error["code"] in DOCUMENTED_CODES for e in errors)
    assert sum(e.type == "response.created" for e in events) == 1  # "what moved?": no refused request made one
    late_errors = [e for e in errors if e.error["event_id"] in late]
    check_round_trip([e for e in events if all(e is not x for x in late_errors)])
    video = events[-1].metrics["video"]  # no refused frame moved the clock: the demo's three frames all count
    assert (video["frames_in"], video["fps_skipped"]) == (3, 0)


@pytest.mark.asyncio
async def test_disconnects_leave_nothing_behind(tiny):
    """Clean closes, aborts without a close handshake, aborts while finishing, and frames past the hard size
    cap (websockets closes with 1009): every session is freed and every task is gone."""
    silence = base64.b64encode(pcm16_bytes(np.zeros(CHUNK * 3, np.float32))).decode()
    async with RealtimeServer(*tiny, port=0) as server:
        for i in range(20):
            ws = await connect(url(server), max_size=None)
            await ws.recv()  # session.created: the session is up
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
            mode = i % 4
            if mode == 0:
                await ws.close()
            elif mode == 1:
                ws.transport.abort()
            elif mode == 2:
                for body in ({"type": "conversation.item.create", "item": {"content": [
                        {"type": "input_text", "text": "what moved?"}]}}, {"type": "response.create"},
                        {"type": "input_audio_buffer.commit"}):
                    await ws.send(json.dumps(body))
                ws.transport.abort()
            else:
                await ws.send("x" * (2 * MAX_MESSAGE_BYTES + 1))
                with pytest.raises(ConnectionClosed):
                    while True:
                        await ws.recv()
                assert ws.close_code == 1009
        await wait_until(lambda: not server.sessions)
        await wait_until(lambda: not [t for t in asyncio.all_tasks() if "sess_" in t.get_name()])
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.asyncio
async def test_a_hundred_abrupt_disconnects_leave_no_session_task_or_memory_behind(tiny):
    """Clean closes and aborts without a close handshake after audio, after a question and after commit:
    each server-side Session is tracked by a weak reference and must be freed once the connection is gone."""
    speech = demo_speech()[: CHUNK * 3]
    audio = [json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm16_bytes(speech[i : i + CHUNK]))})
             for i in range(0, len(speech), CHUNK)]
    question = [json.dumps(body) for body in (
        {"type": "conversation.item.create", "item": {"content": [{"type": "input_text", "text": "what moved?"}]}},
        {"type": "response.create"})]
    commit = [json.dumps({"type": "input_audio_buffer.commit"})]
    sessions: list[weakref.ref[Session]] = []
    # admission is not under test: aborted sessions may still be stopping when the next one connects
    async with RealtimeServer(*tiny, port=0, max_sessions=128) as server:
        for i in range(100):
            ws = await connect(url(server))
            created = json.loads(await ws.recv())
            sessions.append(weakref.ref(server.sessions[created["session"]["id"]]))
            mode = i % 4
            for message in audio + (question if mode >= 2 else []) + (commit if mode == 3 else []):
                await ws.send(message)
            if mode == 0:
                await ws.close()
            else:
                ws.transport.abort()
            del ws
        await wait_until(lambda: not server.sessions)
        await wait_until(lambda: not [t for t in asyncio.all_tasks() if "sess_" in t.get_name()])
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert len({id(ref) for ref in sessions}) == 100
    gc.collect()
    alive = [ref() for ref in sessions if ref() is not None]
    assert not alive, f"{len(alive)} of 100 sessions are still referenced after their connections closed"


@pytest.mark.asyncio
async def test_max_sessions_refuses_with_server_busy(tiny):
    async with RealtimeServer(*tiny, port=0, max_sessions=1) as server:
        async with AsyncRealtimeClient(url(server)) as first:
            assert (await anext(first.events())).type == "session.created"
            async with AsyncRealtimeClient(url(server)) as second:
                events = [e async for e in second.events()]
                assert [e.error["code"] for e in events] == ["server_busy"]
                assert second.ws.close_code == 1013
        await wait_until(lambda: not server.sessions)
        async with AsyncRealtimeClient(url(server)) as third:  # the slot is free again
            assert (await anext(third.events())).type == "session.created"


def test_jpeg_frames_cost_little():
    assert len(encode_jpeg(render_frame(1.0, 160, 120))) < 20_000


async def wait_until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_stream_file_sends_audio_and_jpeg_frames(tiny, demo_file):
    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server)) as client:
        reached = await client.stream_file(demo_file, speed=0)
        await client.ask("what moved?")
        await client.finish()
        events = [e async for e in client.events()]
    assert client.close_code == 1000
    types = [e.type for e in events]
    assert "conversation.item.input_audio_transcription.completed" in types and "response.done" in types
    assert events[-1].metrics["video"]["frames_in"] >= int(reached) - 1
    assert events[-1].metrics["asr"]["pushed_until"] == pytest.approx(reached, abs=0.5)  # video may outlast audio


async def http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP exchange (the server closes after answering): status, headers, body as sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.asyncio
async def test_http_methods_head_and_bad_queries(tiny):
    async with RealtimeServer(*tiny, port=0) as server:
        port = server.port
        status, headers, body = await http(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and len(body) == int(headers["content-length"]) > 0
        for path in ("/", "/healthz"):  # HEAD: GET's status and length, no body
            status, headers, head_body = await http(port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 200 and head_body == b"" and int(headers["content-length"]) > 0
        for request, allowed in ((b"DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "GET, HEAD"),
                                 (b"OPTIONS / HTTP/1.1\r\nHost: x\r\n\r\n", "GET, HEAD"),
                                 (b"PUT / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", "GET, HEAD"),
                                 (b"GET /v1/webrtc/offer HTTP/1.1\r\nHost: x\r\n\r\n", "POST"),
                                 (b"POST /v1/realtime HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", "GET")):
            status, headers, body = await http(port, request)
            assert (status, headers["allow"]) == (405, allowed), request
            assert json.loads(body)["error"]["code"] == "method_not_allowed"
        status, _, body = await http(port, b"PATCH /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
        for window in ("nan", "inf", "-inf", "abc"):
            status, _, body = await http(port, f"GET /healthz?window={window} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 400 and b"window" in body
        status, _, body = await http(port, b"GET /healthz?window=1e9 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and json.loads(body)["status"] == "ok"  # clamped, and valid JSON
        # what it covered, not what was asked: the server keeps 200 s of 10 ms samples
        assert json.loads(body)["loop_lag_ms"]["window_s"] == pytest.approx(200.0)


async def refused(uri: str, **kwargs) -> tuple[int, str]:
    """The HTTP status and body of an upgrade the server refuses."""
    with pytest.raises(InvalidStatus) as refusal:
        await connect(uri, **kwargs)
    response = refusal.value.response
    return response.status_code, response.body.decode()


@pytest.mark.asyncio
async def test_a_token_is_required_on_every_upgrade_but_not_on_healthz(tiny):
    async with RealtimeServer(*tiny, port=0, token="s3cret") as server:
        for kwargs in ({}, {"additional_headers": {"Authorization": "Bearer wrong"}},
                       {"additional_headers": {"Authorization": "Basic s3cret"}}):
            status, body = await refused(url(server), **kwargs)
            assert status == 401 and "token" in body and body.count("\n") == 1
        status, _ = await refused(url(server) + "?token=wrong")
        assert status == 401
        assert not server.sessions
        async with AsyncRealtimeClient(url(server), token="s3cret") as client:
            assert (await anext(client.events())).type == "session.created"
        async with connect(url(server) + "?token=s3cret") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
        health = json.loads(await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10).read()))
        assert health["status"] == "ok"


@pytest.mark.asyncio
async def test_browser_origins_are_checked_and_clients_without_one_pass(tiny):
    async with RealtimeServer(*tiny, port=0) as server:
        status, body = await refused(url(server), origin="https://evil.example")
        assert status == 403 and "https://evil.example" in body
        assert not server.sessions
        for origin in (f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}", None):
            async with connect(url(server), origin=origin) as ws:  # the demo page's own origin, or no browser
                assert json.loads(await ws.recv())["type"] == "session.created"
    async with RealtimeServer(*tiny, port=0, allow_origins=["https://app.example/"]) as server:
        async with connect(url(server), origin="https://app.example") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
        status, _ = await refused(url(server), origin=f"http://127.0.0.1:{server.port}")  # the list replaces it
        assert status == 403


def test_serve_refuses_a_network_address_without_a_token_before_loading_models(capsys, monkeypatch):
    def setup(*_, **__):
        raise UserError("models would load here")

    monkeypatch.setattr(cli, "_setup", setup)
    monkeypatch.delenv("RUNTIME_TOKEN", raising=False)
    code, _, err = run_cli(capsys, "serve", "--host", "0.0.0.0")
    assert code == 1 and "0.0.0.0" in one_error_line(err) and "--token" in err
    assert "models would load here" not in err
    for argv, env in ((["--token", "s3cret"], None), ([], "s3cret")):  # with a token it goes on to load models
        if env is not None:
            monkeypatch.setenv("RUNTIME_TOKEN", env)
        code, _, err = run_cli(capsys, "serve", "--host", "0.0.0.0", *argv)
        assert code == 1 and "models would load here" in one_error_line(err)
    code, _, err = run_cli(capsys, "serve", "--host", "127.0.0.1")
    assert "models would load here" in one_error_line(err)


@pytest.mark.asyncio
async def test_the_sdk_streams_a_microphone(tiny):
    """A capture device through the SDK: FFmpeg's lavfi sine stands in for a microphone (no sound card here)."""
    async with RealtimeServer(*tiny, port=0) as server, AsyncRealtimeClient(url(server), binary=True) as client:
        sent = await client.stream_microphone("sine=frequency=440:sample_rate=48000", backend="lavfi", seconds=1.0)
        await client.finish()
        events = [e async for e in client.events()]
    assert sent == pytest.approx(1.0, abs=0.11)
    assert not [e for e in events if e.type == "error"]
    assert events[-1].metrics["asr"]["pushed_until"] == pytest.approx(sent, abs=1e-6)


@pytest.mark.asyncio
async def test_browsers_watch_the_local_session_without_slowing_it(tiny):
    from runtime.events import TranscriptionDelta
    from runtime.web.broadcast import WATCHER_QUEUE, Broadcast

    def caption(i: int) -> TranscriptionDelta:
        return TranscriptionDelta(item_id="item_1", delta=f"word{i} ", start=i * 0.1, end=i * 0.1 + 0.1,
                                  media_time=i * 0.1 + 0.1)

    async with RealtimeServer(*tiny, port=0) as server:
        watch_url = f"ws://127.0.0.1:{server.port}/v1/watch"
        with pytest.raises(InvalidStatus) as refused:  # nothing to watch without a local source
            async with connect(watch_url):
                pass
        assert refused.value.response.status_code == 404
    async with RealtimeServer(*tiny, port=0, local=Broadcast("camera test")) as server:
        watch_url = f"ws://127.0.0.1:{server.port}/v1/watch"
        assert server.local is not None
        for i in range(3):
            server.local.publish(caption(i))  # before anyone watches: kept as history
        async with connect(watch_url) as ws:
            assert [json.loads(await ws.recv())["delta"] for _ in range(3)] == ["word0 ", "word1 ", "word2 "]
            server.local.publish(caption(3))
            assert json.loads(await ws.recv())["delta"] == "word3 "
            await ws.send(json.dumps({"event_id": "w1", "type": "response.create"}))
            refusal = json.loads(await ws.recv())["error"]
            assert (refusal["code"], refusal["event_id"]) == ("read_only", "w1")
            health = json.loads(await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10).read()))
            assert health["local"] == {"source": "camera test", "watchers": 1}
            for i in range(WATCHER_QUEUE + 10):  # a watcher that stops reading is cut loose, publish never waits
                server.local.publish(caption(i))
            assert not server.local.watchers
            with pytest.raises(ConnectionClosed):
                while True:
                    await ws.recv()
            assert ws.close_code == 1013
