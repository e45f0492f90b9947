"""Client events parse into typed commands; each kind of bad input becomes a `ProtocolError` with a code a
client can branch on and the event_id of the event at fault, never another exception."""

import base64
import json

import numpy as np
import pytest

from runtime.client import encode_jpeg, pcm16_bytes
from runtime.events import parse_event
from runtime.web.binary_messages import MAX_MESSAGE_BYTES, binary_audio, binary_frame
from runtime.web.commands import (
    AppendAudio,
    AppendFrame,
    CancelResponse,
    ClearInput,
    CommitInput,
    CreateItem,
    CreateResponse,
    DeleteItem,
    FinishSession,
    ProtocolError,
    RetrieveItem,
    TruncateItem,
    UpdateSession,
)
from runtime.web.protocol import parse_client_event


def msg(type_, **fields):
    return json.dumps({"type": type_, "event_id": "c1", **fields})


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` and holds no pixel: what a decompression bomb's header says."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(
        b"IEND", b"")


@pytest.mark.parametrize("side", [4097, 20000])  # past ours; far past Pillow's own bomb limit
def test_an_oversized_image_is_refused_from_its_header_before_decoding(side):
    import tracemalloc

    tracemalloc.start()
    with pytest.raises(ProtocolError) as info:
        parse_client_event(msg("runtime.input_video_frame.append", image=b64(png_header(side, side)), timestamp=0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert info.value.code == "image_too_large" and info.value.event_id == "c1"
    assert peak < 16 * 2**20  # nothing of the claimed 50 MB to 1.2 GB of pixels was allocated
    with pytest.raises(ProtocolError) as info:
        parse_client_event(binary_frame(1, 0.0, png_header(side, side)))  # the binary path reads the same header
    assert info.value.code == "image_too_large"


def test_audio_is_passed_on_as_bytes_in_the_sessions_format():
    raw = pcm16_bytes(np.linspace(-1, 1, 1600, dtype=np.float32))
    command = parse_client_event(msg("input_audio_buffer.append", audio=b64(raw)))
    assert command == AppendAudio("c1", raw)  # decoded by the session's AudioDecoder, which knows the format


def test_frame_decodes_and_shrinks_to_max_side():
    image = np.zeros((96, 128, 3), np.uint8)
    image[:, :64] = 255
    command = parse_client_event(msg("runtime.input_video_frame.append", image=b64(encode_jpeg(image)), timestamp=1.5),
                                 max_side=64)
    assert isinstance(command, AppendFrame)
    assert command.frame.time == 1.5 and command.frame.image.shape == (48, 64, 3)
    assert command.frame.image[10, 5].min() > 200 and command.frame.image[10, 60].max() < 40


def test_binary_fast_path_equals_the_json_events():
    samples = np.linspace(-1, 1, 1601, dtype=np.float32)
    as_json = parse_client_event(msg("input_audio_buffer.append", audio=b64(pcm16_bytes(samples))))
    as_binary = parse_client_event(binary_audio(4_000_000_000, pcm16_bytes(samples)))
    assert isinstance(as_binary, AppendAudio) and as_binary.event_id == "bin-4000000000"
    assert as_binary.audio == as_json.audio
    jpeg = encode_jpeg(np.full((96, 128, 3), 90, np.uint8))
    json_frame = parse_client_event(msg("runtime.input_video_frame.append", image=b64(jpeg), timestamp=2.25),
                                    max_side=64)
    binary = parse_client_event(binary_frame(3, 2.25, jpeg), max_side=64)
    assert isinstance(binary, AppendFrame) and binary.event_id == "bin-3" and binary.frame.time == 2.25
    assert np.array_equal(binary.frame.image, json_frame.frame.image)
    with pytest.raises(ProtocolError) as info:
        parse_client_event(binary_frame(5, float("inf"), jpeg))
    assert (info.value.code, info.value.event_id) == ("invalid_value", "bin-5")


def test_other_commands():
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what moved?"}]}
    assert parse_client_event(msg("conversation.item.create", item=item)) == CreateItem("c1", "user", "what moved?")
    system = {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "be brief"}]}
    assert parse_client_event(msg("conversation.item.create", item={**system, "id": "mine"},
                                  previous_item_id="root")) == CreateItem("c1", "system", "be brief", "mine", "root")
    spoken = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": b64(b"\x01\x00")}]}
    assert parse_client_event(msg("conversation.item.create", item=spoken)) == CreateItem("c1", "user",
                                                                                         audio=b"\x01\x00")
    assert parse_client_event(msg("response.create")) == CreateResponse("c1")
    assert parse_client_event(msg("response.create", response={
        "instructions": "in French", "max_output_tokens": 5, "conversation": "none", "metadata": {"k": "v"},
        "input": [item, {"type": "item_reference", "id": "item_1"}]})) == CreateResponse(
        "c1", "in French", 5, False, "what moved?", ("item_1",), {"k": "v"})
    spoken_answer = {"output_modalities": ["audio"], "audio": {"output": {"format": {"type": "audio/pcma"},
                                                                          "voice": "builtin:piper-en-us-joe-medium"}}}
    assert parse_client_event(msg("response.create", response=spoken_answer)) == CreateResponse(
        "c1", modalities=("audio",), audio_output=spoken_answer["audio"]["output"])
    assert parse_client_event(msg("response.cancel")) == CancelResponse("c1", None)
    assert parse_client_event(msg("input_audio_buffer.commit")) == CommitInput("c1")
    assert parse_client_event(msg("input_audio_buffer.clear")) == ClearInput("c1")
    assert parse_client_event(msg("conversation.item.delete", item_id="i")) == DeleteItem("c1", "i")
    assert parse_client_event(msg("conversation.item.retrieve", item_id="i")) == RetrieveItem("c1", "i")
    assert parse_client_event(msg("runtime.session.finish")) == FinishSession("c1")
    assert parse_client_event(msg("conversation.item.truncate", item_id="i", content_index=0,
                                  audio_end_ms=0)) == TruncateItem("c1", "i", 0, 0)
    # the session's fields are checked against its config (test_session_config.py); here only the shape
    assert parse_client_event(msg("session.update", session={"instructions": "x"})) == UpdateSession(
        "c1", {"instructions": "x"})
    assert parse_event({"type": "session.updated", "session": {}}).type == "session.updated"


def test_escaped_surrogate_pairs_and_plain_unicode_are_text():
    pair = parse_client_event('{"type": "conversation.item.create", "event_id": "c1", "item": {"content": '
                              '[{"type": "input_text", "text": "caf\\u00e9 \\ud83d\\ude00 \\u00fc"}]}}')
    assert pair == CreateItem("c1", "user", "caf\u00e9 \U0001f600 \u00fc")


@pytest.mark.parametrize("message, code", [
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    (b"\x00\x01", "invalid_binary_header"),
    (msg("nope.nothing"), "unknown_event_type"),
    (msg("input_audio_buffer.append"), "missing_field"),
    (msg("input_audio_buffer.append", audio=12), "invalid_value"),
    (msg("input_audio_buffer.append", audio="@@not base64@@"), "invalid_base64"),
    (msg("runtime.input_video_frame.append", image=b64(b"not an image at all"), timestamp=0), "invalid_image"),
    (msg("runtime.input_video_frame.append", image=b64(b"\xff\xd8\xff\xe0garbage"), timestamp=0), "invalid_image"),
    (msg("runtime.input_video_frame.append", image=b64(b"x"), timestamp=-1), "invalid_value"),
    (msg("runtime.input_video_frame.append", image=b64(b"x")), "missing_field"),
    (msg("conversation.item.create", item={"type": "message", "content": []}), "missing_field"),
    (msg("conversation.item.create", item={"content": [{"type": "input_audio"}]}), "missing_field"),
    (msg("conversation.item.create", item={"content": [{"type": "input_audio", "audio": "%%"}]}), "invalid_base64"),
    (msg("conversation.item.create", item={"content": [{"type": "input_audio", "audio": "AAAA"},
                                                       {"type": "input_text", "text": "x"}]}), "invalid_value"),
    (msg("conversation.item.create", item={"content": [{"type": "input_image", "image_url": "x"}]}),
     "unsupported_content"),
    (msg("conversation.item.create", item={"content": [{"type": "output_text", "text": "x"}]}), "invalid_value"),
    (msg("conversation.item.create", item={"role": "tool", "content": [{"type": "input_text", "text": "x"}]}),
     "invalid_value"),
    (msg("conversation.item.create", item={"type": "function_call"}), "missing_field"),
    (msg("conversation.item.create", item={"type": "function_call_output", "call_id": "c"}), "missing_field"),
    (msg("conversation.item.create", item={"type": "mcp_call"}), "unsupported_item"),
    (msg("conversation.item.create", item={"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}),
     "invalid_value"),
    (msg("conversation.item.create", item={"content": [{"type": "input_text", "text": "x"}]}, previous_item_id=3),
     "invalid_value"),
    (msg("conversation.item.delete"), "missing_field"),
    (msg("conversation.item.truncate", item_id="i", content_index=0), "missing_field"),
    (msg("conversation.item.truncate", item_id="i", content_index=0, audio_end_ms=-1), "invalid_value"),
    (msg("session.update", session="x"), "invalid_value"),
    (msg("response.create", response={"max_output_tokens": 0}), "invalid_value"),
    (msg("response.create", response={"conversation": "other"}), "invalid_value"),
    (msg("response.create", response={"output_modalities": ["text", "audio"]}), "unsupported_modality"),
    (msg("response.create", response={"output_modalities": "audio"}), "invalid_value"),
    (msg("response.create", response={"audio": {"output": {"voice": "alloy"}}}), "invalid_value"),
    (msg("response.create", response={"audio": {"output": {"format": {"type": "audio/ogg"}}}}), "invalid_value"),
    (msg("response.create", response={"audio": {"output": {"speed": 1.2}}}), "unknown_parameter"),
    (msg("response.create", response={"audio": {"input": {}}}), "unknown_parameter"),
    (msg("response.create", response={"audio": "loud"}), "invalid_value"),
    (msg("response.create", response={"tools": [{"type": "function"}]}), "invalid_value"),
    (msg("response.create", response={"tool_choice": "sometimes"}), "invalid_value"),
    (msg("response.create", response={"voice": "alloy"}), "unknown_parameter"),
    (msg("response.create", response={"input": [{"type": "item_reference"}]}), "missing_field"),
    (msg("response.cancel", response_id=3), "invalid_value"),
    ('{"event_id": "c1"}', "missing_field"),
    # half a UTF-16 pair, escaped: json.loads takes it, but it can be neither tokenized nor sent back as UTF-8
    ('{"type": "nope", "event_id": "c1", "x": "\\ud800"}', "invalid_json"),
    ('{"type": "conversation.item.create", "event_id": "c1", "item": {"content": [{"type": "input_text", '
     '"text": "hi \\udfff"}]}}', "invalid_json"),
    ('{"type": "response.create", "event_id": "c1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "invalid_json"),
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
