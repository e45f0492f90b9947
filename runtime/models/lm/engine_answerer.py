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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from runtime.config import LMConfig
from runtime.models.lm.backend import AnswerStep, AnswerText, DecodingStats, JsonSchema, LMStream, token_limit
from runtime.models.lm.draft_depth import Acceptance, StepCosts
from runtime.models.lm.drafter_choice import make_drafter
from runtime.models.lm.drafters import MODEL_DRAFTERS, Drafter
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_session import EngineSession, score_together
from runtime.models.lm.json_constraint import JsonGrammars
from runtime.models.lm.layer_skip import layer_skip_view
from runtime.models.lm.pieces import Piece
from runtime.models.lm.prompt import Tools
from runtime.models.lm.refusal_check import RefusalCheck
from runtime.models.lm.sampling import Sampler, StopRule, argmax_rows
from runtime.models.lm.speculative import SpeculativeDecoder, Tree
from runtime.models.lm.tokenizer import line_end_ids
from runtime.models.lm.tool_calls import (
    ToolCallConstraint,
    ToolFormat,
    ToolPrompt,
    call_grammar,
    call_starts,
    exchange_messages,
    tool_format,
)


@dataclass
class StreamLM:
    """Per-stream language state: the engine session, the drafter and the draft model's session."""

    session: EngineSession
    drafter: Drafter | None
    draft_session: EngineSession | None = None
    # its answers' measured step costs (the depth's price) and drafts' acceptance: the answerer's, which every stream
    # of it shares
    costs: StepCosts = field(default_factory=StepCosts)
    acceptance: Acceptance = field(default_factory=Acceptance)

    def set_context(self, text: str, suffix: Sequence[Piece] | None = None) -> None:
        """The transcript and (when given) the video-memory suffix; the draft model, whose embeddings are not
        the VLM's, sees only the suffix's text."""
        self.session.set_context(text, suffix)
        if self.draft_session is not None:
            text_only = None if suffix is None else [p for p in suffix if isinstance(p, str)]
            self.draft_session.set_context(text, text_only)

    def set_tools(self, tools: Tools) -> None:
        """The function tools the prompt's head renders (`EngineSession.set_tools`), in both sessions."""
        self.session.set_tools(tools)
        if self.draft_session is not None:
            self.draft_session.set_tools(tools)

    def prefill_step(self) -> int:
        done = self.session.prefill_step()
        if self.draft_session is not None:
            done += self.draft_session.prefill_step()
        return done


@dataclass(eq=False)
class EngineAnswer:
    """One answer on a stream: its speculative decoder and what it has streamed so far."""

    stream: StreamLM
    decoder: SpeculativeDecoder
    text: AnswerText
    prompt_ids: list[int]  # what the answer conditions on: pinned head, transcript window, question framing
    context_tokens: int  # transcript tokens in the window
    context_cut: bool  # True once the window has evicted older transcript
    first: int | None = None  # the token `decoder.start` chose, not yet streamed
    done: bool = False
    released: bool = False
    on_release: Callable[[StreamLM], None] | None = None  # a pooled stream goes back to its pool
    open_answers: list[EngineAnswer] | None = None  # its answerer's open answers: it leaves them at release
    ahead: AnswerStep | Exception | None = None  # a step decoded beside another answer's, before this one asked

    def step(self) -> AnswerStep:
        """One target forward (the first call only streams the token the prompt's forward chose; a step decoded
        ahead is returned at once)."""
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            if isinstance(ahead, Exception):
                raise ahead
            return ahead
        if self.done:
            return AnswerStep("", True, self.text.finish_reason, 0)
        if self.first is not None:
            tokens, self.first = [self.first], None
        else:
            tokens = self.decoder.step(self.text.room())
        return self._emit(tokens)

    @property
    def needs_forward(self) -> bool:
        """Whether its next step is a forward that `EngineAnswerer.step_together` may share with others'."""
        return (self.ahead is None and not self.done and self.first is None
                and self.stream.session.scores_together)

    def _emit(self, tokens: list[int]) -> AnswerStep:
        step = self.text.take(tokens)
        if step.done:
            self.release()
        return step

    @property
    def generated(self) -> list[int]:
        return self.text.generated

    def release(self) -> None:
        """End the answer (its target group is dropped); the stream's prefilled source stays."""
        if not self.released:
            self.released = True
            self.stream.session.end_answer()
            if self.stream.draft_session is not None:
                self.stream.draft_session.end_answer()
            if self.on_release is not None:
                self.on_release(self.stream)
            if self.open_answers is not None and self in self.open_answers:
                self.open_answers.remove(self)
        self.done = True

    def stats(self) -> DecodingStats:
        return self.decoder.stats.as_dict()


class EngineAnswerer:
    max_idle_streams = 2

    def __init__(self, engine: LMEngine, draft_engine: LMEngine | None = None) -> None:
        self.engine, self.draft_engine = engine, draft_engine
        self.cfg, self.tokenizer, self.name, self.seed = engine.cfg, engine.tokenizer, engine.name, engine.seed
        self.sampler = Sampler(self.cfg.temperature, self.cfg.top_p)
        self.eos_ids = frozenset(engine.eos_ids)
        self._idle: list[StreamLM] = []
        self._open: list[EngineAnswer] = []  # started, not released (touched on the worker only)
        self._grammars: JsonGrammars | None = None  # built on the first schema: plain answers never import it
        # read at load (on the worker): the pipeline asks for it on the event loop, and rendering takes ~0.1 s
        self._tool_format = tool_format(self.tokenizer)
        # what steps cost on this machine with this model and drafter, measured by every answer of every stream, so
        # that a new conversation's first answer does not start unpriced (draft_depth.StepCosts)
        self.costs = StepCosts()
        self.acceptance = Acceptance()  # how often each kind of draft was accepted (draft_depth.Acceptance)
        # where a copy drafter stops: at the end of the line it copies (drafters.NgramDrafter)
        self.line_ends = line_end_ids(self.tokenizer) if self.cfg.drafter in ("ngram", "auto") else frozenset()
        self._call_starts: torch.Tensor | None = None  # the tokens that start a call (`tool_calls.call_starts`)
        # an answer that would open with `lm.not_known_reply` asks the model whether the context answers it first
        self.refusal_check = (RefusalCheck.build(self.tokenizer, self.cfg.not_known_reply, self.cfg.not_known_check)
                              if self.cfg.not_known_reply else None)

    @classmethod
    def load(cls, cfg: LMConfig, *, device: str, dtype: str, seed: int = 0,
             progress: Callable[[str], None] | None = None) -> EngineAnswerer:
        engine = LMEngine.load(cfg, device=device, dtype=dtype, seed=seed, progress=progress)
        return cls(engine, cls._draft(engine, cfg, device=device, dtype=dtype, seed=seed, progress=progress))

    @classmethod
    def sharing(cls, engine: LMEngine, cfg: LMConfig, *, seed: int = 0,
                draft_engine: LMEngine | None = None) -> EngineAnswerer:
        """An answerer under `cfg` (its drafter, token limits, window) on the weights `engine` has loaded: no second
        load of the model (the benchmarks' rows; a draft model, `cfg.draft_model`, is loaded unless `draft_engine`,
        another answerer's, is given). Its decode step
        compiles anew if `cfg` wants one for a cache geometry or thread count that `engine`'s step has not compiled.
        `cfg` names the same model and format."""
        if (cfg.model, cfg.weights) != (engine.cfg.model, engine.cfg.weights):
            raise ValueError(f"an answerer sharing {engine.cfg.model} ({engine.cfg.weights}) cannot run "
                             f"{cfg.model} ({cfg.weights}, drafter {cfg.drafter})")
        target = LMEngine(engine.model, engine.tokenizer, cfg, name=engine.name, seed=seed, eos_ids=engine.eos_ids,
                          compiled=engine.compiled)
        if draft_engine is None:
            draft_engine = cls._draft(target, cfg, device=engine.model.device.type, dtype="float32", seed=seed,
                                      progress=None)
        return cls(target, draft_engine)

    @staticmethod
    def _draft(engine: LMEngine, cfg: LMConfig, *, device: str, dtype: str, seed: int,
               progress: Callable[[str], None] | None) -> LMEngine | None:
        """The draft engine `cfg.drafter` decodes with (draft-model and dyspec: another model, loaded; swift:
        `engine`'s own layers), or None."""
        draft = None
        if cfg.drafter in ("draft-model", "dyspec"):
            draft_cfg = replace(cfg, model=cfg.draft_model, drafter="none",  # verified in trees: eager
                                compile="off" if cfg.compile == "auto" else cfg.compile)
            draft = LMEngine.load(draft_cfg, device=device, dtype=dtype, seed=seed, progress=progress,
                                  exact_prefill=False)
        elif cfg.drafter == "swift":  # the model itself through a subset of its layers: shared weights
            draft = LMEngine(layer_skip_view(engine.model), engine.tokenizer,
                             replace(cfg, drafter="none", compile="off" if cfg.compile == "auto" else cfg.compile),
                             name=f"{cfg.model} (layer-skip draft)", seed=seed, eos_ids=engine.eos_ids,
                             exact_prefill=False)
        return draft

    def open_stream(self) -> StreamLM:
        """A stream's state; the pipeline keeps it for the stream's life. Runs on the worker (allocates KV)."""
        draft_session = self.draft_engine.open_session() if self.draft_engine is not None else None
        drafter = None if self.cfg.drafter in MODEL_DRAFTERS else make_drafter(
            self.cfg, vocab_size=self.engine.model.args.vocab_size,
            wide_trees=self.engine.model.device.type != "cpu", line_ends=self.line_ends)
        return StreamLM(self.engine.open_session(), drafter, draft_session, costs=self.costs,
                        acceptance=self.acceptance)

    def _pool(self, stream: StreamLM) -> None:
        if len(self._idle) < self.max_idle_streams:
            self._idle.append(stream)

    def grammars(self) -> JsonGrammars:
        """The schema compiler for this tokenizer (made once: reading the vocabulary takes about 0.5 s)."""
        if self._grammars is None:
            self._grammars = JsonGrammars(self.tokenizer, self.engine.model.args.vocab_size, self.eos_ids)
        return self._grammars

    @property
    def tool_format(self) -> ToolFormat | None:
        """How the model's chat template takes tools and writes calls (None: it does not; `tool_calls`)."""
        return self._tool_format

    def _tool_constraint(self, tools: ToolPrompt) -> ToolCallConstraint:
        """`tools.use.choice` as a constraint: auto decides at the first token, a forced choice starts with the
        opener, `none` forbids it (`tool_calls`)."""
        fmt = self.tool_format
        if fmt is None:
            raise ValueError(f"{self.name}'s chat template takes no tools")
        called, decided = tools.called(), tools.use.choice != "auto"
        call = self.grammars().lark_constraint(call_grammar(fmt, called, opener=decided)) if called else None
        vocab = self.engine.model.args.vocab_size
        if self._call_starts is None:
            self._call_starts = call_starts(self.tokenizer, fmt, vocab)
        return ToolCallConstraint(fmt, call, decided=decided, vocab=vocab, stop_ids=self.eos_ids,
                                  call_starts=self._call_starts)

    def start(self, context: str, question: str, *, seed: int | None = None, stream: LMStream | None = None,
              suffix: Sequence[Piece] | None = None, max_tokens: int | None = None,
              schema: JsonSchema | None = None, tools: ToolPrompt | None = None) -> EngineAnswer:
        """Open an answer. With `stream` (the pipeline's, from `open_stream`) the suffix it was last given is
        kept unless `suffix` replaces it; without one, a pooled stream gets `suffix` or none. With `schema`
        the answer is one JSON value under it (`json_constraint`), still decoded speculatively. With `tools` (a
        template that takes them: `tool_format`) the prompt renders them and the exchange of calls it continues,
        and the answer is text or a call in the template's format, as the choice allows (`tool_calls`)."""
        if stream is not None and not isinstance(stream, StreamLM):
            raise TypeError(f"an engine answer needs a stream from EngineAnswerer.open_stream, not {type(stream)}")
        # a bad schema fails first
        constraint = (self.grammars().constraint(schema) if schema is not None
                      else self._tool_constraint(tools) if tools is not None and tools.use.tools else None)
        after = exchange_messages(tools.calls) if tools is not None else []
        pooled = stream is None
        lm = stream if stream is not None else (self._idle.pop() if self._idle else self.open_stream())
        lm.set_tools(tools.chat_tools() if tools is not None and tools.use.tools else None)
        lm.set_context(context, () if pooled and suffix is None else suffix)
        lm.session.begin_answer(question, after)
        generator = self.sampler.generator(self.seed if seed is None else seed)
        drafter = lm.drafter
        if lm.draft_session is not None:
            lm.draft_session.begin_answer(question, after)
            drafter = make_drafter(self.cfg, vocab_size=self.engine.model.args.vocab_size,
                                   draft_target=lm.draft_session,
                                   draft_fed=lm.draft_session.answer_ids(), generator=generator)
        decoder = SpeculativeDecoder(lm.session, drafter, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                     max_draft_tokens=self.cfg.max_draft_tokens, generator=generator,
                                     stop_ids=self.eos_ids, constraint=constraint, costs=lm.costs,
                                     acceptance=lm.acceptance)
        first_logits = lm.session.next_logits()
        if self.refusal_check is not None and constraint is None and schema is None:
            first_logits = self.refusal_check.first_logits(lm.session, question, after)
        prompt = lm.session.answer_ids()
        first = decoder.start(first_logits, prompt)
        cache = lm.session.cache
        text = AnswerText(self.tokenizer, StopRule(frozenset(self.eos_ids), token_limit(self.cfg, max_tokens),
                                                   self.cfg.stop_repeats), framing=schema is None)
        answer = EngineAnswer(lm, decoder, text, prompt, max(0, cache.source_len - cache.sink), cache.evicted > 0,
                              first=first, on_release=self._pool if pooled else None, open_answers=self._open)
        self._open.append(answer)
        return answer

    def step_together(self, asking: Sequence[EngineAnswer]) -> list[AnswerStep | Exception]:
        """`step()` for each answer in `asking`, their forwards in one (`engine_session.score_together`), and every
        other open answer of this answerer stepped in the same forward, its step kept (`ahead`) until it asks. Why
        the others: each answer asks for its next step only when its last one has reached the pipeline, and two
        answers asking in turns would never meet on the worker; stepped ahead, the one that asks later finds its
        step done. Only when one of `asking` needs a forward does any other answer get a step, and at most one
        ahead. A step's error is that answer's result (raised when it asks); the others go on."""
        results: dict[int, AnswerStep | Exception] = {}
        shared: list[tuple[EngineAnswer, Tree]] = []
        forward = [a for a in asking if a.needs_forward]
        others = [a for a in self._open if a.needs_forward and all(a is not b for b in asking)] if forward else []
        # the trees share the forward's size: together about one deep tree's rows, where a CPU step is still bound
        # by reading the weights rather than by the arithmetic (two nine-node trees at once cost the 1.5B 150 ms at
        # one thread, a plain step 60)
        depth = max(1, self.cfg.max_draft_tokens // (len(forward) + len(others))) if len(forward) + len(others) > 1 \
            else None
        for answer in asking:
            if answer.needs_forward:
                self._plan(answer, shared, results, depth)
            else:
                results[id(answer)] = _attempt(answer.step)
        for other in others:
            self._plan(other, shared, results, depth)
        if len(shared) == 1:  # alone: the session's own scoring (its compiled or fixed-form step where it has one)
            answer, tree = shared[0]
            started = time.perf_counter()
            logits = _attempt(lambda: answer.stream.session.score(tree.tokens, tree.parents))
            self._finish(answer, tree, logits, time.perf_counter() - started, results)
        elif shared:
            started = time.perf_counter()
            batch = _attempt(lambda: score_together([(a.stream.session, t.tokens, t.parents) for a, t in shared]))
            took = time.perf_counter() - started
            rows = sum(len(tree.tokens) for _, tree in shared)  # the price of the whole forward, not of one tree
            for i, (answer, tree) in enumerate(shared):
                self._finish(answer, tree, batch if isinstance(batch, Exception) else batch[i], took, results, rows)
        for other in others:  # (one that finished was released meanwhile: it keeps its last step all the same)
            other.ahead = results[id(other)]
        return [results[id(a)] for a in asking]

    @staticmethod
    def _plan(answer: EngineAnswer, shared: list[tuple[EngineAnswer, Tree]],
              results: dict[int, AnswerStep | Exception], max_depth: int | None) -> None:
        planned = _attempt(lambda: answer.decoder.plan(answer.text.room(), max_depth))
        if isinstance(planned, Tree):
            shared.append((answer, planned))
        else:
            results[id(answer)] = planned if isinstance(planned, Exception) else _attempt(lambda: answer._emit(planned))

    @staticmethod
    def _finish(answer: EngineAnswer, tree: Tree, logits: torch.Tensor | Exception, verify_s: float,
                results: dict[int, AnswerStep | Exception], rows: int | None = None) -> None:
        if isinstance(logits, Exception):
            results[id(answer)] = logits
            return
        results[id(answer)] = _attempt(
            lambda: answer._emit(answer.decoder.finish(tree, logits, argmax_rows(logits), verify_s, rows)))

    def embed_text(self, text: str) -> torch.Tensor | None:
        return self.engine.embed_text(text)


R = TypeVar("R")


def _attempt(fn: Callable[[], R]) -> R | Exception:
    """`fn()`, or the exception it raised: one answer's failed step is its own result, not its neighbours'."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - returned to the answer that asked, raised there
        return err
