"""What a client may set on its session (`session.update`), in the OpenAI Realtime API's GA shape.

One frozen `SessionConfig` per session, replaced whole on each update (the session holds the newest; processors
read it when they need it, so a change applies from the next chunk or the next answer). `parse_update` checks
every field a client sends and refuses an unknown or malformed one with a `ConfigFieldError` naming it, so the
session keeps its config and the client learns which field was wrong. `to_api` is what `session.created` and
`session.updated` echo.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from runtime.function_tools import ToolError, ToolUse, checked, parse_choice, parse_tools
from runtime.io.audio_formats import DEFAULT_FORMAT, AudioFormat, parse_audio_format
from runtime.models.asr.base import TASKS, Speech
from runtime.models.tts import DEFAULT_VOICE, VOICES
from runtime.models.tts.voice import check_speed

EAGERNESS = ("low", "medium", "high", "auto")
MODALITIES = (("text",), ("audio",))  # the GA API's two: text alone, or audio with its transcript
LANGUAGE_CODE = re.compile(r"[a-z]{2,3}")  # ISO 639-1 (Whisper's codes; also "haw", "yue")


class ConfigFieldError(ValueError):
    """A session field a client sent that cannot be applied; `param` names it (`session.audio.input.format`)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class TurnDetection:
    """`server_vad` (Silero VAD: speech, then `silence_duration_ms` of silence) or `semantic_vad` (Smart Turn
    judges from the audio whether the speaker has finished; `eagerness` sets how long it waits)."""

    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    eagerness: str = "auto"

    def to_api(self) -> dict[str, Any]:
        common = {"type": self.type, "create_response": self.create_response,
                  "interrupt_response": self.interrupt_response}
        if self.type == "semantic_vad":
            return {**common, "eagerness": self.eagerness}
        return {**common, "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "idle_timeout_ms": self.idle_timeout_ms}


# A live captioner's turns only split its captions into utterances: nothing is answered or cut short, and a line
# ends at a sentence's pause (read speech pauses 300-400 ms between sentences), sooner than a conversation's turn,
# which waits 500 ms so as not to cut a speaker off.
CAPTIONS = TurnDetection(silence_duration_ms=300, create_response=False, interrupt_response=False)


@dataclass(frozen=True)
class OutputAudio:
    """`audio.output`: how a spoken answer sounds and is encoded (`audio/pcm` at 24 kHz by default, as the API's;
    G.711 `audio/pcmu` / `audio/pcma` at 8 kHz). `voice` is one of this server's voices (`runtime.models.tts`):
    the API's own names (alloy, marin, ...) are not voices here and are refused, naming the ones there are."""

    format: AudioFormat = DEFAULT_FORMAT
    voice: str = DEFAULT_VOICE
    speed: float = 1.0

    def to_api(self) -> dict[str, Any]:
        return {"format": self.format.to_dict(), "voice": self.voice, "speed": self.speed}


@dataclass(frozen=True)
class SessionConfig:
    instructions: str = ""  # given with every question, after it (the profile's system prompt frames the context)
    output_modalities: tuple[str, ...] = ("text",)
    max_output_tokens: int | None = None  # None: "inf", the profile's lm.max_new_tokens
    input_format: AudioFormat = DEFAULT_FORMAT
    transcription_model: str = ""  # reported; the profile's ASR transcribes whatever name is given
    transcription: dict[str, Any] = field(default_factory=dict)
    turn_detection: TurnDetection | None = TurnDetection()
    tools: ToolUse = ToolUse()  # the functions answers may call, and the tool choice
    output: OutputAudio = OutputAudio()  # `audio.output`: used when `output_modalities` is ["audio"]

    def speech(self) -> OutputAudio | None:
        """How answers are spoken now, or None when they are text."""
        return self.output if self.output_modalities == ("audio",) else None

    def captions_only(self) -> bool:
        """Whether turn detection ends the user's turns without answering them (a captions session): the final pass
        then reads each turn on from the one before (pipeline/turns_before.py, "Reading on")."""
        return self.turn_detection is not None and not self.turn_detection.create_response

    def transcription_prompt(self) -> str:
        """`audio.input.transcription.prompt`: the user's own words (names, terms), which the ASR reads before each
        turn with the turns before it (Whisper's previous text; pipeline/turns_before.py)."""
        return str(self.transcription.get("prompt") or "")

    def transcription_speech(self, language: str, task: str) -> Speech | None:
        """`audio.input.transcription.language` and `.task` over the profile's `language` and `task` (the ASR's
        `Speech`), or None when the session sets neither."""
        given, asked = self.transcription.get("language"), self.transcription.get("task")
        if not given and not asked:
            return None
        return Speech(str(given or language), str(asked or task))

    def to_api(self) -> dict[str, Any]:
        transcription = {**self.transcription, "model": self.transcription_model} if self.transcription_model \
            else (self.transcription or None)
        return {
            "type": "realtime",
            "instructions": self.instructions,
            "output_modalities": list(self.output_modalities),
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "audio": {"input": {"format": self.input_format.to_dict(), "transcription": transcription,
                                "turn_detection": None if self.turn_detection is None
                                else self.turn_detection.to_api(),
                                "noise_reduction": None},
                      "output": self.output.to_api()},
            "tools": [t.to_api() for t in self.tools.tools],
            "tool_choice": self.tools.choice_to_api(),
        }


# accepted, no effect on this server (`parallel_tool_calls`: a local model makes at most one call a response)
_IGNORED = {"model", "tracing", "truncation", "include", "prompt", "parallel_tool_calls"}
# The beta Realtime API's names (the `OpenAI-Beta: realtime=v1` protocol) and where the GA API this server speaks
# puts each; None: the GA API has no such field.
_BETA_NAMES = {
    "session": {"modalities": "session.output_modalities", "input_audio_format": "session.audio.input.format",
                "output_audio_format": "session.audio.output.format",
                "turn_detection": "session.audio.input.turn_detection",
                "input_audio_transcription": "session.audio.input.transcription",
                "input_audio_noise_reduction": "session.audio.input.noise_reduction",
                "max_response_output_tokens": "session.max_output_tokens", "voice": "session.audio.output.voice",
                "temperature": None},
    "response": {"modalities": "response.output_modalities", "output_audio_format": "response.audio.output.format",
                 "max_response_output_tokens": "response.max_output_tokens", "voice": "response.audio.output.voice",
                 "temperature": None},
}


def unknown_field(kind: str, key: str) -> str:
    """The message for an unknown `session` or `response` field; a beta API name says where the GA API has it."""
    if key not in _BETA_NAMES[kind]:
        return f"unknown {kind} field {key!r}"
    ga = _BETA_NAMES[kind][key]
    where = f"the GA API's is {ga}" if ga else "the GA API has no such field"
    return (f"unknown {kind} field {key!r}: that is the beta Realtime API's name and this server speaks the GA "
            f"API ({where}; with the openai SDK use client.realtime.connect, not client.beta)")


def parse_update(config: SessionConfig, session: dict[str, Any]) -> SessionConfig:
    """`config` with the fields of a `session.update`'s `session` applied; raises ConfigFieldError."""
    changes: dict[str, Any] = {}
    for key, value in session.items():
        param = f"session.{key}"
        if key == "type":
            if value != "realtime":
                raise ConfigFieldError(param, "session.type must be 'realtime' (a transcription-only session is a "
                                              "realtime one with no response.create)")
        elif key == "instructions":
            changes["instructions"] = _typed(value, str, param, "a string")
        elif key == "output_modalities":
            changes["output_modalities"] = _modalities(value, param)
        elif key == "max_output_tokens":
            changes["max_output_tokens"] = max_tokens(value, param)
        elif key == "audio":
            changes.update(_audio(config, _typed(value, dict, param, "an object")))
        elif key in ("tools", "tool_choice"):
            tools = changes.get("tools", config.tools)
            try:
                changes["tools"] = replace(tools, tools=parse_tools(value, param)) if key == "tools" \
                    else replace(tools, choice=parse_choice(value, param))
            except ToolError as e:
                raise ConfigFieldError(e.param, str(e)) from None
        elif key not in _IGNORED:
            raise ConfigFieldError(param, unknown_field("session", key), code="unknown_parameter")
    if "tools" in changes:
        try:
            checked(changes["tools"], "session.tool_choice")
        except ToolError as e:
            raise ConfigFieldError(e.param, str(e)) from None
    return replace(config, **changes)


def max_tokens(value: object, param: str) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise ConfigFieldError(param, f"{param} must be an integer from 1 to 4096, or 'inf'")
    return value


def _typed(value: object, kind: type, param: str, what: str) -> Any:  # noqa: ANN401 - the JSON value, checked
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigFieldError(param, f"{param} must be {what}")
    return value


def _modalities(value: object, param: str) -> tuple[str, ...]:
    return parse_modalities(value, param)


def parse_modalities(value: object, param: str) -> tuple[str, ...]:
    """`output_modalities` (a session's or a response's): ['text'] or ['audio'] (spoken, with its transcript)."""
    if isinstance(value, list) and tuple(value) in MODALITIES:
        return tuple(value)
    if isinstance(value, list) and set(value) == {"text", "audio"}:
        raise ConfigFieldError(param, f"{param}: choose ['text'] or ['audio'], not both (a spoken answer comes "
                                      "with its transcript)", code="unsupported_modality")
    raise ConfigFieldError(param, f"{param} must be ['text'] or ['audio']")


def parse_output(value: object, param: str, current: OutputAudio) -> OutputAudio:
    """`audio.output` (a session's, or a response's: `format` and `voice` only) applied to `current`."""
    setting = _typed(value, dict, param, "an object")
    fields: dict[str, Any] = {}
    for name, v in setting.items():
        p = f"{param}.{name}"
        if name == "format":
            try:
                fields["format"] = parse_audio_format(v, p)
            except ValueError as e:
                raise ConfigFieldError(p, str(e)) from None
        elif name == "voice":
            if v not in VOICES:
                shown = " ".join(repr(v).split())[:80]
                raise ConfigFieldError(p, f"{p}: {shown} is not a voice of this server; its voices: "
                                          f"{', '.join(VOICES)}")
            fields["voice"] = v
        elif name == "speed" and param.startswith("session."):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ConfigFieldError(p, f"{p} must be a number from 0.25 to 1.5")
            try:
                fields["speed"] = check_speed(v)
            except ValueError as e:
                raise ConfigFieldError(p, f"{p}: {e}") from None
        else:
            raise ConfigFieldError(p, f"unknown field {name!r} in {param}", code="unknown_parameter")
    return replace(current, **fields)


def _audio(config: SessionConfig, audio: dict[str, Any]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for key, value in audio.items():
        if key == "output":
            changes["output"] = parse_output(value, "session.audio.output", config.output)
            continue
        if key != "input":
            raise ConfigFieldError(f"session.audio.{key}", f"unknown session field 'audio.{key}'",
                                   code="unknown_parameter")
        for name, setting in _typed(value, dict, "session.audio.input", "an object").items():
            param = f"session.audio.input.{name}"
            if name == "format":
                try:
                    changes["input_format"] = parse_audio_format(setting, param)
                except ValueError as e:
                    raise ConfigFieldError(param, str(e)) from None
            elif name == "transcription":
                if setting is None:
                    changes.update(transcription={}, transcription_model="")
                    continue
                setting = _typed(setting, dict, param, "an object or null")
                unknown = set(setting) - {"model", "language", "prompt", "task"}
                if unknown:
                    raise ConfigFieldError(f"{param}.{sorted(unknown)[0]}", f"unknown field in {param}: "
                                           f"{sorted(unknown)}", code="unknown_parameter")
                for key in ("language", "prompt", "task"):
                    if setting.get(key) is not None and not isinstance(setting[key], str):
                        raise ConfigFieldError(f"{param}.{key}", f"{param}.{key} must be a string or null")
                if setting.get("language") and not LANGUAGE_CODE.fullmatch(setting["language"]):
                    raise ConfigFieldError(f"{param}.language", f"{param}.language must be a language code like "
                                           f"'en' or 'de' (ISO 639-1), got {setting['language']!r}")
                if setting.get("task") and setting["task"] not in TASKS:
                    raise ConfigFieldError(f"{param}.task", f"{param}.task must be one of {', '.join(TASKS)} "
                                           f"(the runtime's extension: translate writes English captions), got "
                                           f"{setting['task']!r}")
                changes["transcription"] = dict(setting)
                changes["transcription_model"] = str(setting.get("model", ""))
            elif name == "turn_detection":
                changes["turn_detection"] = turn_detection(setting, param, config.turn_detection)
            elif name == "noise_reduction":
                if setting is not None:
                    raise ConfigFieldError(param, f"{param}: this server does no noise reduction; send null",
                                           code="unsupported_field")
            else:
                raise ConfigFieldError(param, f"unknown session field 'audio.input.{name}'", code="unknown_parameter")
    return changes


def turn_detection(value: object, param: str, current: TurnDetection | None) -> TurnDetection | None:
    """None turns it off (the client commits by hand); an object sets the type and the fields it names."""
    if value is None:
        return None
    setting = _typed(value, dict, param, "an object or null")
    kind = setting.get("type", current.type if current else "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise ConfigFieldError(f"{param}.type", f"{param}.type must be 'server_vad' or 'semantic_vad'")
    base = current if current is not None and current.type == kind else TurnDetection(type=kind)
    fields: dict[str, Any] = {}
    for name, v in setting.items():
        p = f"{param}.{name}"
        if name == "type":
            continue
        if name == "threshold":
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
                raise ConfigFieldError(p, f"{p} must be a number from 0 to 1")
            fields[name] = float(v)
        elif name == "idle_timeout_ms":
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 5_000 <= v <= 30_000):
                raise ConfigFieldError(p, f"{p} must be null or milliseconds from 5000 to 30000")
            fields[name] = v
        elif name in ("prefix_padding_ms", "silence_duration_ms"):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 <= v <= 60_000:
                raise ConfigFieldError(p, f"{p} must be milliseconds from 0 to 60000")
            fields[name] = int(v)
        elif name in ("create_response", "interrupt_response"):
            if not isinstance(v, bool):
                raise ConfigFieldError(p, f"{p} must be true or false")
            fields[name] = v
        elif name == "eagerness":
            if v not in EAGERNESS:
                raise ConfigFieldError(p, f"{p} must be one of {list(EAGERNESS)}")
            fields[name] = v
        else:
            raise ConfigFieldError(p, f"unknown field {name!r} in {param}", code="unknown_parameter")
    return replace(base, **fields)
