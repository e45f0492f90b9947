"""The interface between the pipeline and any streaming ASR backend.

A loaded model (`StreamingASR`, chosen by `registry.load_asr`) is shared by sessions; each session opens its
own `ASRStream`, which holds all per-session state, so the device worker can interleave many streams on one
model. Backends report
progress as `TranscriptUpdate`s: text that became stable (never retracted), the unstable tail, and item
completion, all stamped with media time so latency is measurable. A stream is one input buffer (a turn); the
pipeline opens it with the text of the turns before (`set_context`), so a speaker cut at a pause is heard in context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from runtime.chunks import AudioChunk
from runtime.errors import ConfigError

TASKS = ("transcribe", "translate")
DETECT = ""  # the language to detect rather than give


@dataclass(frozen=True)
class Speech:
    """What a stream is asked to hear and write: its language (`DETECT`: the backend says which) and task
    (transcribe, or translate into English)."""

    language: str = DETECT
    task: str = "transcribe"


def check_task(task: str, what: str = "asr.task") -> str:
    if task not in TASKS:
        raise ConfigError(f"{what}={task!r} is not one of {', '.join(repr(t) for t in TASKS)}")
    return task


@dataclass(frozen=True)
class TranscriptUpdate:
    item_id: str  # one transcript item (segment); a new id after each completed one
    delta: str  # text that became stable with this update ("" if none)
    unstable: str  # the current tail that may still change
    start: float  # media seconds of the item's start
    end: float  # media seconds up to which audio has been heard
    completed: bool = False
    transcript: str = ""  # the item's full final text when completed
    language: str = ""  # the language the backend heard (given or detected); "" when it does not say


class ASRStream(Protocol):
    """Per-session state; every method runs on the device worker thread."""

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        """Before the first chunk: the text of the turns before this stream's (`previous`) and the user's own words
        (`vocabulary`, the session's `audio.input.transcription.prompt`), which a backend that reads text before
        the audio (Whisper's previous-text prompt) conditions on; a backend that cannot ignores them."""
        ...

    def set_speech(self, speech: Speech) -> None:
        """Before the first chunk: the language spoken (`DETECT`: the backend identifies it) and the task (transcribe,
        or translate into English); a ConfigError for what the model cannot do (models/asr/whisper_language.py).
        Only called when a session asks for either."""
        ...

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]: ...

    def finish(self) -> list[TranscriptUpdate]:
        """End of input: flush and complete the open item."""
        ...

    def close(self) -> None:
        """Release per-session state."""
        ...


@runtime_checkable
class SpeechEnds(Protocol):
    """A stream whose final pass can be told where the speech ended, and prepared during the pause that follows
    (pipeline/pause_pass.py); streams without it finish on all their audio when committed."""

    def end_speech(self, until_sample: int | None) -> str | None:
        """The final pass reads the audio up to `until_sample` (what follows is silence), computed now where it can
        be; None: speech went on, and the pass reads all the audio again. Returns the open item's final transcript
        as it will likely be (the commit may still differ), or None when the stream cannot tell."""
        ...


@runtime_checkable
class ReadsOn(Protocol):
    """A stream whose final pass can read the turn before it with its own (a reader's sentence carried across a
    pause; captions sessions, pipeline/turns_before.py)."""

    def read_on(self, before: object | None) -> None:
        """Before the first chunk: the turn before, as another stream of the same model gave it (`turn_before`);
        None, at any time before `finish`: none after all."""
        ...

    def turn_before(self) -> object | None:
        """After `finish`: this stream's turn for the next stream to read on from; None when it held no words."""
        ...


class StreamingASR(Protocol):
    """A loaded model shared by sessions."""

    name: str

    def open_stream(self) -> ASRStream: ...
