"""`session.update` in the GA shape: every field the API defines is applied or refused with the field named,
and a refused update leaves the config as it was."""

import pytest

from runtime.io.audio_formats import AudioFormat
from runtime.session_config import ConfigFieldError, OutputAudio, SessionConfig, TurnDetection, parse_update


def test_ga_fields_apply_and_echo_in_the_apis_shape():
    config = parse_update(SessionConfig(), {
        "type": "realtime", "model": "gpt-realtime", "instructions": "Answer in one sentence.",
        "output_modalities": ["text"], "max_output_tokens": 40,
        "audio": {"input": {"format": {"type": "audio/pcmu"}, "transcription": {"model": "whisper-1"},
                            "turn_detection": {"type": "server_vad", "threshold": 0.6, "silence_duration_ms": 700,
                                               "create_response": False, "idle_timeout_ms": None},
                            "noise_reduction": None},
                  "output": {"voice": "builtin:piper-en-us-joe-medium"}}})
    assert config.instructions == "Answer in one sentence." and config.max_output_tokens == 40
    assert config.input_format == AudioFormat("audio/pcmu", 8000) and config.transcription_model == "whisper-1"
    assert config.turn_detection == TurnDetection(threshold=0.6, silence_duration_ms=700, create_response=False)
    api = config.to_api()
    assert api["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert api["audio"]["input"]["transcription"] == {"model": "whisper-1"}
    assert api["audio"]["input"]["turn_detection"] == {
        "type": "server_vad", "create_response": False, "interrupt_response": True, "threshold": 0.6,
        "prefix_padding_ms": 300, "silence_duration_ms": 700, "idle_timeout_ms": None}
    assert api["max_output_tokens"] == 40 and api["type"] == "realtime"
    # "inf" and null turn detection; a semantic_vad keeps its eagerness and drops server_vad's fields
    assert parse_update(config, {"max_output_tokens": "inf"}).max_output_tokens is None
    idle = parse_update(config, {"audio": {"input": {"turn_detection": {"idle_timeout_ms": 6000}}}})
    assert idle.turn_detection.idle_timeout_ms == 6000 and idle.turn_detection.to_api()["idle_timeout_ms"] == 6000
    assert parse_update(config, {"audio": {"input": {"turn_detection": None}}}).turn_detection is None
    semantic = parse_update(config, {"audio": {"input": {"turn_detection": {"type": "semantic_vad",
                                                                            "eagerness": "high"}}}})
    assert semantic.turn_detection.to_api() == {"type": "semantic_vad", "create_response": True,
                                                "interrupt_response": True, "eagerness": "high"}


def test_an_update_changes_only_what_it_names():
    config = parse_update(SessionConfig(), {"instructions": "a"})
    again = parse_update(config, {"audio": {"input": {"turn_detection": {"threshold": 0.3}}}})
    assert again.instructions == "a" and again.turn_detection.threshold == 0.3
    assert again.turn_detection.silence_duration_ms == 500  # kept from before


@pytest.mark.parametrize("session, param, code", [
    ({"voice": "alloy"}, "session.voice", "unknown_parameter"),
    ({"type": "transcription"}, "session.type", "invalid_value"),
    ({"instructions": 3}, "session.instructions", "invalid_value"),
    ({"output_modalities": ["text", "audio"]}, "session.output_modalities", "unsupported_modality"),
    ({"output_modalities": ["video"]}, "session.output_modalities", "invalid_value"),
    ({"audio": {"output": {"voice": "alloy"}}}, "session.audio.output.voice", "invalid_value"),
    ({"audio": {"output": {"voice": {"id": "voice_1234"}}}}, "session.audio.output.voice", "invalid_value"),
    ({"audio": {"output": {"speed": 2.0}}}, "session.audio.output.speed", "invalid_value"),
    ({"audio": {"output": {"speed": 0.2}}}, "session.audio.output.speed", "invalid_value"),
    ({"audio": {"output": {"speed": "fast"}}}, "session.audio.output.speed", "invalid_value"),
    ({"audio": {"output": {"speed": True}}}, "session.audio.output.speed", "invalid_value"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 44100}}}}, "session.audio.output.format",
     "invalid_value"),
    ({"audio": {"output": {"format": "mp3"}}}, "session.audio.output.format", "invalid_value"),
    ({"audio": {"output": {"pitch": 1}}}, "session.audio.output.pitch", "unknown_parameter"),
    ({"audio": {"output": "loud"}}, "session.audio.output", "invalid_value"),
    ({"output_modalities": "text"}, "session.output_modalities", "invalid_value"),
    ({"max_output_tokens": 0}, "session.max_output_tokens", "invalid_value"),
    ({"max_output_tokens": True}, "session.max_output_tokens", "invalid_value"),
    ({"tools": [{"type": "mcp", "server_url": "x"}]}, "session.tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "session.tools[0].name", "invalid_value"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "session.tools[0].parameters",
     "invalid_value"),
    ({"tool_choice": {"type": "function", "name": "nowhere"}}, "session.tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "session.tool_choice", "invalid_value"),
    ({"tool_choice": "always"}, "session.tool_choice", "invalid_value"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 44100}}}}, "session.audio.input.format",
     "invalid_value"),
    ({"audio": {"input": {"turn_detection": {"type": "push_to_talk"}}}},
     "session.audio.input.turn_detection.type", "invalid_value"),
    ({"audio": {"input": {"turn_detection": {"threshold": 2}}}}, "session.audio.input.turn_detection.threshold",
     "invalid_value"),
    ({"audio": {"input": {"turn_detection": {"create_response": "yes"}}}},
     "session.audio.input.turn_detection.create_response", "invalid_value"),
    ({"audio": {"input": {"turn_detection": {"eagerness": "eager"}}}},
     "session.audio.input.turn_detection.eagerness", "invalid_value"),
    ({"audio": {"input": {"turn_detection": {"volume": 1}}}}, "session.audio.input.turn_detection.volume",
     "unknown_parameter"),
    ({"audio": {"input": {"turn_detection": {"idle_timeout_ms": 100}}}},
     "session.audio.input.turn_detection.idle_timeout_ms", "invalid_value"),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction",
     "unsupported_field"),
    ({"audio": {"input": {"transcription": {"model": "x", "delay": 1}}}}, "session.audio.input.transcription.delay",
     "unknown_parameter"),
    ({"audio": {"echo": {}}}, "session.audio.echo", "unknown_parameter"),
])
def test_a_bad_field_is_named(session, param, code):
    with pytest.raises(ConfigFieldError) as info:
        parse_update(SessionConfig(), session)
    assert (info.value.param, info.value.code) == (param, code)
    assert str(info.value)


@pytest.mark.parametrize("field, ga", [
    ("modalities", "session.output_modalities"), ("input_audio_format", "session.audio.input.format"),
    ("turn_detection", "session.audio.input.turn_detection"), ("max_response_output_tokens",
                                                               "session.max_output_tokens")])
def test_a_beta_api_field_says_where_the_ga_api_has_it(field, ga):
    """The openai SDK's beta client sends these; the error says which API this server speaks and the GA name."""
    with pytest.raises(ConfigFieldError) as info:
        parse_update(SessionConfig(), {field: None})
    assert info.value.code == "unknown_parameter" and f"the GA API's is {ga}" in str(info.value)
    assert "client.realtime.connect" in str(info.value)
    with pytest.raises(ConfigFieldError, match="the GA API has no such field"):
        parse_update(SessionConfig(), {"temperature": 0.8})
    with pytest.raises(ConfigFieldError) as info:
        parse_update(SessionConfig(), {"colour": "blue"})
    assert str(info.value) == "unknown session field 'colour'"


def test_spoken_answers_take_the_output_format_voice_and_speed():
    """output_modalities ['audio'] with audio.output applied and echoed in the GA shape; speech() is what an answer
    is spoken with (None while answers are text)."""
    assert SessionConfig().speech() is None
    assert SessionConfig().to_api()["audio"]["output"] == {
        "format": {"type": "audio/pcm", "rate": 24000}, "voice": "builtin:piper-en-us-joe-medium", "speed": 1.0}
    config = parse_update(SessionConfig(), {"output_modalities": ["audio"], "audio": {"output": {
        "format": {"type": "audio/pcmu"}, "voice": "builtin:piper-en-us-joe-medium", "speed": 1.25}}})
    assert config.output_modalities == ("audio",)
    assert config.speech() == OutputAudio(AudioFormat("audio/pcmu", 8000), "builtin:piper-en-us-joe-medium", 1.25)
    api = config.to_api()
    assert api["output_modalities"] == ["audio"]
    assert api["audio"]["output"] == {"format": {"type": "audio/pcmu"}, "voice": "builtin:piper-en-us-joe-medium",
                                      "speed": 1.25}
    again = parse_update(config, {"audio": {"output": {"speed": 0.5}}, "output_modalities": ["text"]})
    assert again.output.format.type == "audio/pcmu" and again.output.speed == 0.5  # the rest kept
    assert again.speech() is None
    with pytest.raises(ConfigFieldError, match="its voices: builtin:piper-en-us-joe-medium"):
        parse_update(config, {"audio": {"output": {"voice": "marin"}}})


def test_parallel_tool_calls_is_accepted_and_changes_nothing():
    assert parse_update(SessionConfig(), {"parallel_tool_calls": True}) == SessionConfig()
