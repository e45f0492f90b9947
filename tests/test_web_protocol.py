"""Client events parse into typed commands; each kind of bad input becomes a `ProtocolError` with a code a
client can branch on and the event_id of the event at fault, never another exception."""

import base64
import json

import numpy as np
import pytest

from runtime.client import encode_jpeg, pcm16_bytes
from runtime.events import parse_event
from runtime.web.protocol import (
    MAX_MESSAGE_BYTES,
    AppendAudio,
    AppendFrame,
    CancelResponse,
    CommitInput,
    CreateItem,
    CreateResponse,
    ProtocolError,
    UpdateSession,
    binary_audio,
    binary_frame,
    parse_client_event,
)


def msg(type_, **fields):
    return json.dumps({"type": type_, "event_id": "c1", **fields})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_audio_round_trips_through_pcm16():
    samples = np.linspace(-1, 1, 1600, dtype=np.float32)
    command = parse_client_event(msg("input_audio_buffer.append", audio=b64(pcm16_bytes(samples))))
    assert isinstance(command, AppendAudio) and command.event_id == "c1"
    assert command.samples.dtype == np.float32 and len(command.samples) == 1600
    assert np.abs(command.samples - samples).max() < 1e-4
    ints = np.array([0, 16384, -32768], np.int16)
    parsed = parse_client_event(msg("input_audio_buffer.append", audio=b64(pcm16_bytes(ints)))).samples
    assert parsed.tolist() == [0.0, 0.5, -1.0]


def test_frame_decodes_and_shrinks_to_max_side():
    image = np.zeros((96, 128, 3), np.uint8)
    image[:, :64] = 255
    command = parse_client_event(msg("input_video_frame.append", image=b64(encode_jpeg(image)), timestamp=1.5),
                                 max_side=64)
    assert isinstance(command, AppendFrame)
    assert command.frame.time == 1.5 and command.frame.image.shape == (48, 64, 3)
    assert command.frame.image[10, 5].min() > 200 and command.frame.image[10, 60].max() < 40


def test_binary_fast_path_equals_the_json_events():
    samples = np.linspace(-1, 1, 1601, dtype=np.float32)
    as_json = parse_client_event(msg("input_audio_buffer.append", audio=b64(pcm16_bytes(samples))))
    as_binary = parse_client_event(binary_audio(4_000_000_000, pcm16_bytes(samples)))
    assert isinstance(as_binary, AppendAudio) and as_binary.event_id == "bin-4000000000"
    assert np.array_equal(as_binary.samples, as_json.samples)
    jpeg = encode_jpeg(np.full((96, 128, 3), 90, np.uint8))
    json_frame = parse_client_event(msg("input_video_frame.append", image=b64(jpeg), timestamp=2.25), max_side=64)
    binary = parse_client_event(binary_frame(3, 2.25, jpeg), max_side=64)
    assert isinstance(binary, AppendFrame) and binary.event_id == "bin-3" and binary.frame.time == 2.25
    assert np.array_equal(binary.frame.image, json_frame.frame.image)
    with pytest.raises(ProtocolError) as info:
        parse_client_event(binary_frame(5, float("inf"), jpeg))
    assert (info.value.code, info.value.event_id) == ("invalid_value", "bin-5")


def test_other_commands():
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what moved?"}]}
    assert parse_client_event(msg("conversation.item.create", item=item)) == CreateItem("c1", "what moved?")
    assert parse_client_event(msg("response.create")) == CreateResponse("c1")
    assert parse_client_event(msg("response.cancel")) == CancelResponse("c1", None)
    assert parse_client_event(msg("input_audio_buffer.commit")) == CommitInput("c1")
    assert parse_client_event(msg("session.update", session={"input_audio_format": "pcm16"})) == UpdateSession(
        "c1", {"input_audio_format": "pcm16"})
    assert parse_event({"type": "session.updated", "session": {}}).type == "session.updated"


def test_escaped_surrogate_pairs_and_plain_unicode_are_text():
    pair = parse_client_event('{"type": "conversation.item.create", "event_id": "c1", "item": {"content": '
                              '[{"type": "input_text", "text": "caf\\u00e9 \\ud83d\\ude00 \\u00fc"}]}}')
    assert pair == CreateItem("c1", "caf\u00e9 \U0001f600 \u00fc")
    assert parse_client_event(msg("session.update", session={"modalities": ["text", "audio"]})) == UpdateSession(
        "c1", {"modalities": ["text", "audio"]})


@pytest.mark.parametrize("message, code", [
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    (b"\x00\x01", "invalid_binary_header"),
    (msg("nope.nothing"), "unknown_event_type"),
    (msg("input_audio_buffer.append"), "missing_field"),
    (msg("input_audio_buffer.append", audio=12), "invalid_value"),
    (msg("input_audio_buffer.append", audio="@@not base64@@"), "invalid_base64"),
    (msg("input_audio_buffer.append", audio=b64(b"\x01\x02\x03")), "invalid_audio"),
    (msg("input_video_frame.append", image=b64(b"not an image at all"), timestamp=0), "invalid_image"),
    (msg("input_video_frame.append", image=b64(b"\xff\xd8\xff\xe0garbage"), timestamp=0), "invalid_image"),
    (msg("input_video_frame.append", image=b64(b"x"), timestamp=-1), "invalid_value"),
    (msg("input_video_frame.append", image=b64(b"x")), "missing_field"),
    (msg("conversation.item.create", item={"type": "message", "content": []}), "missing_field"),
    (msg("conversation.item.create", item={"content": [{"type": "input_audio"}]}), "invalid_value"),
    (msg("conversation.item.create", item={"type": "function_call"}), "unsupported_item"),
    (msg("session.update", session={"voice": "alloy"}), "unsupported_field"),
    (msg("session.update", session={"input_audio_format": "g711_ulaw"}), "invalid_value"),
    (msg("response.cancel", response_id=3), "invalid_value"),
    ('{"event_id": "c1"}', "missing_field"),
    # half a UTF-16 pair, escaped: json.loads takes it, but it can be neither tokenized nor sent back as UTF-8
    ('{"type": "nope", "event_id": "c1", "x": "\\ud800"}', "invalid_json"),
    ('{"type": "conversation.item.create", "event_id": "c1", "item": {"content": [{"type": "input_text", '
     '"text": "hi \\udfff"}]}}', "invalid_json"),
    ('{"type": "response.create", "event_id": "c1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid_json"),
    (msg("session.update", session={"modalities": "text"}), "invalid_value"),
    (msg("session.update", session={"modalities": ["audio"]}), "invalid_value"),
    (msg("session.update", session={"modalities": ["text", {}]}), "invalid_value"),
    (msg("session.update", session={"modalities": ["text", "text"]}), "invalid_value"),
    ('{"type": "response.create", "event_id": "c1", "pad": "' + "x" * MAX_MESSAGE_BYTES + '"}',
     "message_too_large"),
])
def test_bad_input_is_a_protocol_error(message, code):
    with pytest.raises(ProtocolError) as info:
        parse_client_event(message)
    assert info.value.code == code
    if isinstance(message, str) and message.startswith('{"type"'):
        assert info.value.event_id == "c1"
    event = info.value.to_event().to_dict()
    assert event["type"] == "error" and event["error"]["code"] == code
