"""Stand-in models whose behaviour a test can predict, and helpers to drive a session with them: the ASR hears
one word per chunk, the answerer spells back the last word of its context one character a step."""

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import with_overrides
from runtime.memory.snapshot import Segment
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.lm import AnswerStep
from runtime.profile_files import load_profile
from runtime.session import Session

CHUNK = SAMPLE_RATE // 10  # 100 ms


class WordASR:
    """Hears one word per chunk: 'w<index>'; completes an item every `per_item` chunks."""

    name = "words"

    def __init__(self, per_item: int = 5, delay_s: float = 0.0, fail_on: int | None = None,
                 fail_close: bool = False) -> None:
        self.per_item, self.delay_s, self.fail_on, self.fail_close = per_item, delay_s, fail_on, fail_close
        self.streams: list[WordStream] = []

    def open_stream(self) -> "WordStream":
        self.streams.append(WordStream(self))
        return self.streams[-1]


@dataclass
class WordStream:
    model: WordASR
    chunks: list[int] = field(default_factory=list)
    item: int = 0
    words: list[str] = field(default_factory=list)
    item_start: float = 0.0
    closed: bool = False
    closes: int = 0
    threads: set[str] = field(default_factory=set)
    contexts: list[tuple[str, str]] = field(default_factory=list)  # each set_context's (previous, vocabulary)

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        self.threads.add(threading.current_thread().name)
        self.contexts.append((previous, vocabulary))

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        self.threads.add(threading.current_thread().name)
        index = chunk.start_sample // CHUNK
        if index == self.model.fail_on:
            raise RuntimeError("corrupt chunk")
        time.sleep(self.model.delay_s)
        self.chunks.append(index)
        self.words.append(f"w{index}")
        out = [TranscriptUpdate(f"item{self.item}", f"w{index} ", "", self.item_start, chunk.end)]
        if len(self.words) == self.model.per_item:
            out.append(self._complete(chunk.end))
        return out

    def _complete(self, end: float) -> TranscriptUpdate:
        update = TranscriptUpdate(f"item{self.item}", "", "", self.item_start, end, True, " ".join(self.words))
        self.item, self.words, self.item_start = self.item + 1, [], end
        return update

    def finish(self) -> list[TranscriptUpdate]:
        return [self._complete(len(self.chunks) * CHUNK / SAMPLE_RATE)] if self.words else []

    def close(self) -> None:
        self.closed = True
        self.closes += 1
        if self.model.fail_close:
            raise RuntimeError("the ASR state could not be released")


class EchoAnswerer:
    """Answers by spelling back the last word of its context, one character per step."""

    name = "echo"

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.contexts: list[str] = []
        self.released = 0

    def open_stream(self) -> None:
        return None

    def start(self, context: str, question: str, *, seed=None, stream=None, suffix=None,
              max_tokens=None) -> "EchoAnswer":
        self.contexts.append(context)
        last = context.split()[-1] if context.split() else "nothing"
        return EchoAnswer(self, f"{question}->{last}")

    def embed_text(self, text: str) -> None:
        return None


class EchoAnswer:
    prompt_ids: list[int] = [1, 2, 3]  # noqa: RUF012 - read only

    def __init__(self, answerer: EchoAnswerer, text: str) -> None:
        self.answerer, self.text, self.i = answerer, text, 0

    def step(self) -> AnswerStep:
        time.sleep(self.answerer.step_s)
        ch = self.text[self.i]
        self.i += 1
        done = self.i == len(self.text)
        return AnswerStep(ch, done, "stop" if done else None)

    def release(self) -> None:
        self.answerer.released += 1

    def stats(self) -> None:
        return None


class StreamingEchoAnswerer(EchoAnswerer):
    """Keeps per-stream state like the engine: records every context it was handed and prefills it in
    pieces of 5 characters (one worker job each)."""

    def open_stream(self) -> "StreamState":
        return StreamState()

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> "EchoAnswer":
        assert stream is not None and stream.pending() == 0, "the pipeline must prefill before answering"
        stream.prefilled_at_question.append(stream.prefilled)
        return super().start(context, question)


class StreamState:
    def __init__(self) -> None:
        self.target, self.prefilled, self.contexts, self.prefilled_at_question = "", "", [], []
        self.threads: set[str] = set()

    def set_context(self, text: str) -> None:
        self.contexts.append(text)
        keep = 0
        while keep < min(len(text), len(self.prefilled)) and text[keep] == self.prefilled[keep]:
            keep += 1
        self.target, self.prefilled = text, self.prefilled[:keep]  # update mode: keep the common prefix

    def pending(self) -> int:
        return len(self.target) - len(self.prefilled)

    def prefill_step(self) -> int:
        self.threads.add(threading.current_thread().name)
        n = min(5, self.pending())
        self.prefilled = self.target[: len(self.prefilled) + n]
        return n


def profile_for(**pipeline):
    return with_overrides(load_profile("tiny"), pipeline={"metrics_interval_s": 0.0, **pipeline})


def audio_chunks(n_chunks: int, start: int = 0) -> list[AudioChunk]:
    return [AudioChunk(np.zeros(CHUNK, np.float32), (start + i) * CHUNK) for i in range(n_chunks)]


async def collect(session: Session) -> list:
    return [event async for event in session.events]


def types_of(events) -> list[str]:
    return [e.type for e in events]


class TwoStepAnswer:
    """Says "a note" in two steps; logs its release."""
    prompt_ids: list[int] = [1, 2, 3]  # noqa: RUF012 - read only

    def __init__(self, log: list[str]) -> None:
        self.log, self.i = log, 0

    def step(self) -> AnswerStep:
        self.i += 1
        return AnswerStep(["a ", "note"][self.i - 1], self.i == 2, "stop" if self.i == 2 else None)

    def release(self) -> None:
        self.log.append("release")

    def stats(self) -> None:
        return None


def closed_segment(i: int) -> Segment:
    """A closed segment [i, i + 1) s whose keyframe is 4 rows of 8 features, all equal to i."""
    z = torch.full((4, 8), float(i))
    return Segment(id=i, start=float(i), end=i + 1.0, frames=1, mean=z[0], keyframe=z, keyframe_time=float(i),
                   closed=True)


class ScriptAnswerer(EchoAnswerer):
    """Answers every question with the same `text`, one word (and the space before it) a step."""

    name = "script"

    def __init__(self, text: str, step_s: float = 0.0) -> None:
        super().__init__(step_s)
        self.text = text
        self.questions: list[str] = []

    def start(self, context: str, question: str, *, seed=None, stream=None, suffix=None,
              max_tokens=None) -> "EchoAnswer":
        self.contexts.append(context)
        self.questions.append(question)
        return WordAnswer(self, self.text)


class WordAnswer(EchoAnswer):
    def __init__(self, answerer: EchoAnswerer, text: str) -> None:
        super().__init__(answerer, text)
        self.words = [w if i == 0 else f" {w}" for i, w in enumerate(text.split())]

    def step(self) -> AnswerStep:
        time.sleep(self.answerer.step_s)
        word = self.words[self.i]
        self.i += 1
        done = self.i == len(self.words)
        return AnswerStep(word, done, "stop" if done else None)


class ToneVoice:
    """A voice in a few lines of numpy: each word is `word_s` of a tone at 22,050 Hz (what Piper's voices give), so a
    test knows how long each clause sounds. Counts its calls and the threads they ran on."""

    name = "builtin:piper-en-us-joe-medium"
    sample_rate = 22050

    def __init__(self, word_s: float = 0.1, delay_s: float = 0.0) -> None:
        self.word_s, self.delay_s = word_s, delay_s
        self.spoken: list[str] = []
        self.threads: set[str] = set()

    def synthesize(self, text: str, speed: float = 1.0):
        from runtime.models.tts.voice import Speech

        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        self.spoken.append(text)
        n = round(len(text.split()) * self.word_s / speed * self.sample_rate)
        t = np.arange(n) / self.sample_rate
        return Speech((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), self.sample_rate)
