"""The seam between the pipeline and a language-model backend: what the pipeline calls, typed.

A backend (`AnswerBackend`) is shared by the sessions of a process. Per stream it may keep state that it
prefills as the transcript streams in (`open_stream() -> LMStream`, None when it prefills everything at
question time). Per question, `start()` returns an `Answer`, stepped until done and then released. Every
method runs on the device worker, one job each, so ASR chunks overtake decoding between steps and a cancel
lands within one step. `NoAnswerer` is the backend of a session that loaded no language model.

Backends: `generate_answerer.GenerateAnswerer` and `engine_answerer.EngineAnswerer`; `registry` picks one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from runtime.config import LMConfig
from runtime.errors import UserError
from runtime.models.lm.pieces import Piece
from runtime.models.lm.prompt import framing_line, may_become_framing
from runtime.models.lm.sampling import StopRule

DecodingStats = dict[str, float | int | list[float]]
JsonSchema = dict[str, Any]  # a JSON Schema object, as `json.loads` gives it


@dataclass(frozen=True)
class AnswerStep:
    delta: str  # new text (may be "" while a multi-byte character is incomplete)
    done: bool
    finish_reason: str | None  # "stop" (eos) | "length" (max_new_tokens) | None
    tokens: int = 1  # output tokens this step produced (speculative steps may accept several)


class Answer(Protocol):
    """One answer in progress; every method runs on the device worker."""

    prompt_ids: list[int]  # what it conditions on (a response's `usage.input_tokens`)

    def step(self) -> AnswerStep:
        """Decode and stream the next token(s); after the answer is done, an empty done step."""
        ...

    def release(self) -> None:
        """End the answer now and free its KV (idempotent: the pipeline releases in `finally`)."""
        ...

    def stats(self) -> DecodingStats | None:
        """Speculative-decoding counters, or None when the backend decodes plainly."""
        ...


class LMStream(Protocol):
    """Per-stream state of a backend that prefills context as it streams in."""

    def set_context(self, text: str, suffix: Sequence[Piece] | None = None) -> None:
        """The transcript so far and, when given, the video-memory suffix after it (None keeps the last one);
        cheap, safe from the event loop."""
        ...

    def prefill_step(self) -> int:
        """Prefill one job's worth of what changed; tokens prefilled, 0 when caught up."""
        ...


class AnswerBackend(Protocol):
    name: str

    def open_stream(self) -> LMStream | None:
        """A stream's state, kept for the stream's life; None: the backend prefills everything at question time."""
        ...

    def start(self, context: str, question: str, *, seed: int | None = None, stream: LMStream | None = None,
              suffix: Sequence[Piece] | None = None, max_tokens: int | None = None,
              schema: JsonSchema | None = None) -> Answer:
        """Open an answer to `question` about `context` (and a video-memory `suffix`), on `stream` when the
        backend keeps streams; at most `max_tokens` (and never more than `lm.max_new_tokens`).

        With `schema` (a JSON Schema object: a function's parameters) the answer's text is exactly one JSON
        value valid under it, compact, nothing before or after: a small model then still makes a valid call.
        The answer ends with "stop" as soon as the value is complete ("length" when `max_tokens` cuts it
        first). A backend that cannot constrain raises `UserError`; None changes nothing."""
        ...

    def embed_text(self, text: str) -> torch.Tensor | None:
        """Mean input embedding [hidden] (float32) of `text`'s tokens, for video-memory selection and notes;
        None for text without tokens, or a backend without input embeddings."""
        ...


def token_limit(cfg: LMConfig, max_tokens: int | None) -> int:
    """An answer's token budget: the profile's, or less when the request asks for less."""
    return cfg.max_new_tokens if max_tokens is None else max(1, min(cfg.max_new_tokens, max_tokens))


def answer_text(tokenizer: PreTrainedTokenizerBase, generated: list[int], *, final: bool,
                framing: bool) -> tuple[str, bool]:
    """(the text `generated` says so far, whether it stopped at a framing line). Byte-level tokens can end
    mid-character: until the answer is final, a trailing U+FFFD is held back so a delta never carries half a
    character. With `framing`, the text ends where a line starts as the prompt frames the conversation
    (`prompt.framing_line`), and a last line that may yet become one is held back (a trailing "\r" too: a
    "\r\n" may follow); an answer that ends there (max tokens) ends before it."""
    text = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not final:
        text = text.rstrip("\ufffd")
    if framing:
        cut = framing_line(text)
        if cut is not None:
            return text[:cut].rstrip(), True
        if may_become_framing(text):
            text = text[: text.rindex("\n")].rstrip()  # with the blank lines before it
        elif not final and text.endswith("\r"):
            text = text[:-1]
    return text, False


@dataclass(eq=False)
class AnswerText:
    """What an answer has said: its tokens under the stop rule, streamed as text that never carries half a
    character. Every backend's answer keeps one, so a step's tokens become an `AnswerStep` in one place.

    `framing` (free text; off for JSON under a schema): a small model that has answered often goes on writing
    the conversation: a timestamped line ("[00:42.0] On screen: ..."), the next "Question:". The answer ends
    where such a line starts, finish reason "stop", and that line is never streamed: in the conversation it would
    pass for something heard or shown."""

    tokenizer: PreTrainedTokenizerBase
    stop: StopRule
    generated: list[int] = field(default_factory=list)  # the answer's token ids (no stop token)
    emitted: str = ""  # text streamed so far (a prefix of the answer's text)
    finish_reason: str | None = None  # "stop" | "length" once the stop rule ended the answer
    framing: bool = True

    def take(self, tokens: Iterable[int]) -> AnswerStep:
        """Take a step's tokens in order until one ends the answer; the step carries the text they add."""
        before = len(self.generated)
        self.finish_reason = self.stop.take(tokens, self.generated)
        text, framed = answer_text(self.tokenizer, self.generated, final=self.finish_reason is not None,
                                   framing=self.framing)
        if framed:
            self.finish_reason = "stop"
            text = self.emitted if self.emitted.startswith(text) else text  # a space already streamed stays
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return AnswerStep(delta, self.finish_reason is not None, self.finish_reason, len(self.generated) - before)

    def room(self) -> int:
        """How many more tokens the answer may take."""
        return self.stop.room(len(self.generated))


class NoAnswerer:
    """The backend of a session that takes no questions (`runtime transcribe`): no model, no stream state."""

    name = "none"

    def open_stream(self) -> None:
        return None

    def start(self, context: str, question: str, *, seed: int | None = None, stream: LMStream | None = None,
              suffix: Sequence[Piece] | None = None, max_tokens: int | None = None,
              schema: JsonSchema | None = None) -> Answer:
        raise UserError("this session loaded no language model, so it answers no questions")

    def embed_text(self, text: str) -> None:
        return None
