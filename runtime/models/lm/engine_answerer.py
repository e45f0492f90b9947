"""The language engine as the pipeline's answerer: streaming prefill per stream, speculative decoding per answer.

Each stream opens a `StreamLM` (its engine session, its drafter kept warm across questions, and a draft
model's session when one is configured). The pipeline feeds it the transcript as it grows
(`set_context` + `prefill_step` jobs), so a question only prefills itself. Each `step()` is one target
forward that may accept several draft tokens; they are streamed out at once, and a cancel lands between
steps. Greedy output is token-identical to plain greedy decoding of the same model (tests check it).
Sampled output has exactly the model's distribution; a fixed seed reproduces it only without a drafter, since
the draft depth adapts to measured time and drafts decide which random numbers are drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from runtime.config import LMConfig
from runtime.models.lm.answerer import AnswerStep, new_text
from runtime.models.lm.drafters import Drafter, make_drafter
from runtime.models.lm.engine import EngineSession, LMEngine, Piece
from runtime.models.lm.speculative import SpeculativeDecoder


@dataclass
class StreamLM:
    """Per-stream language state: the engine session, the drafter and the draft model's session."""

    session: EngineSession
    drafter: Drafter | None
    draft_session: EngineSession | None = None

    def set_context(self, text: str, suffix: Sequence[Piece] | None = None) -> None:
        """The transcript and (when given) the video-memory suffix; the draft model, whose embeddings are not
        the VLM's, sees only the suffix's text."""
        self.session.set_context(text, suffix)
        if self.draft_session is not None:
            text_only = None if suffix is None else [p for p in suffix if isinstance(p, str)]
            self.draft_session.set_context(text, text_only)

    def prefill_step(self) -> int:
        done = self.session.prefill_step()
        if self.draft_session is not None:
            done += self.draft_session.prefill_step()
        return done


@dataclass
class EngineAnswerState:
    stream: StreamLM
    decoder: SpeculativeDecoder
    prompt_ids: list[int]  # what the answer conditions on: pinned head, transcript window, question framing
    context_tokens: int  # transcript tokens in the window
    context_cut: bool  # True once the window has evicted older transcript
    generated: list[int] = field(default_factory=list)  # emitted token ids (no stop token)
    emitted: str = ""
    first: int | None = None  # the token `decoder.start` chose, not yet streamed
    done: bool = False
    finish_reason: str | None = None
    pooled: bool = False
    released: bool = False


class EngineAnswerer:
    max_idle_streams = 2

    def __init__(self, engine: LMEngine, draft_engine: LMEngine | None = None) -> None:
        self.engine, self.draft_engine = engine, draft_engine
        self.cfg, self.tokenizer, self.name, self.seed = engine.cfg, engine.tokenizer, engine.name, engine.seed
        self.eos_ids = set(engine.eos_ids)
        self._idle: list[StreamLM] = []

    @classmethod
    def load(cls, cfg: LMConfig, *, device: str, dtype: str, seed: int = 0,
             progress: Callable[[str], None] | None = None) -> EngineAnswerer:
        engine = LMEngine.load(cfg, device=device, dtype=dtype, seed=seed, progress=progress)
        draft = None
        if cfg.drafter == "draft-model":
            draft_cfg = replace(cfg, model=cfg.draft_model, drafter="none")
            draft = LMEngine.load(draft_cfg, device=device, dtype=dtype, seed=seed, progress=progress)
        return cls(engine, draft)

    def open_session(self) -> StreamLM:
        """A stream's state; the pipeline keeps it for the stream's life. Runs on the worker (allocates KV)."""
        draft_session = self.draft_engine.open_session() if self.draft_engine is not None else None
        drafter = None if self.cfg.drafter == "draft-model" else make_drafter(
            self.cfg, vocab_size=self.engine.model.args.vocab_size)
        return StreamLM(self.engine.open_session(), drafter, draft_session)

    def start(self, context: str, question: str, *, seed: int | None = None, session: StreamLM | None = None,
              suffix: Sequence[Piece] | None = None) -> EngineAnswerState:
        """Open an answer. With `session` (the pipeline's stream) the suffix it was last given is kept unless
        `suffix` replaces it; a pooled stream gets `suffix` or none."""
        pooled = session is None
        stream = session if session is not None else (self._idle.pop() if self._idle else self.open_session())
        stream.set_context(context, () if pooled and suffix is None else suffix)
        stream.session.begin_answer(question)
        generator = None
        if self.cfg.temperature > 0:
            generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        drafter = stream.drafter
        if stream.draft_session is not None:
            stream.draft_session.begin_answer(question)
            drafter = make_drafter(self.cfg, vocab_size=self.engine.model.args.vocab_size,
                                   draft_target=stream.draft_session,
                                   draft_fed=stream.draft_session.answer_ids(), generator=generator)
        decoder = SpeculativeDecoder(stream.session, drafter, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                     max_draft_tokens=self.cfg.max_draft_tokens, generator=generator,
                                     stop_ids=self.eos_ids)
        prompt = stream.session.answer_ids()
        first = decoder.start(stream.session.next_logits(), prompt)
        cache = stream.session.cache
        return EngineAnswerState(stream, decoder, prompt, max(0, cache.source_len - self.engine.sink),
                                 cache.evicted > 0, first=first, pooled=pooled)

    def step(self, state: EngineAnswerState) -> AnswerStep:
        """One target forward (the first call only streams the token the prompt's forward chose)."""
        if state.done:
            return AnswerStep("", True, state.finish_reason, 0)
        if state.first is not None:
            tokens, state.first = [state.first], None
        else:
            tokens = state.decoder.step(self.cfg.max_new_tokens - len(state.generated))
        before = len(state.generated)
        for token in tokens:
            if token in self.eos_ids:
                state.done, state.finish_reason = True, "stop"
                break
            state.generated.append(token)
            if len(state.generated) >= self.cfg.max_new_tokens:
                state.done, state.finish_reason = True, "length"
                break
        delta = new_text(self.tokenizer, state.generated, state.emitted, final=state.done)
        state.emitted += delta
        if state.done:
            self.release(state)
        return AnswerStep(delta, state.done, state.finish_reason, len(state.generated) - before)

    def release(self, state: EngineAnswerState) -> None:
        """End the answer (its target group is dropped); the stream's prefilled source stays."""
        if not state.released:
            state.released = True
            state.stream.session.end_answer()
            if state.stream.draft_session is not None:
                state.stream.draft_session.end_answer()
            if state.pooled and len(self._idle) < self.max_idle_streams:
                self._idle.append(state.stream)
        state.done = True

    def stats(self, state: EngineAnswerState) -> dict[str, Any]:
        return state.decoder.stats.as_dict()
