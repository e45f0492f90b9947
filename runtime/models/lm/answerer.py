"""The slice's answerer: prefill the prompt at question time, then decode one token per call.

One token per `step()` keeps each unit of device work short, so the worker can run ASR chunks between
tokens and a cancelled answer stops within one step. Later backends keep the same surface but prefill the
transcript while it streams in and decode speculatively; greedy output must stay token-identical to
`model.generate(do_sample=False)`, which the tests check against this loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from runtime.config import LMConfig
from runtime.errors import ConfigError, UserError
from runtime.models.loading import load_progress, resolve_checkpoint, torch_dtype

BACKENDS = ("generate", "engine")
CUT_MARK = "... "  # prefixed to a context that was cut from the front


def new_text(tokenizer: PreTrainedTokenizerBase, generated: list[int], emitted: str, *, final: bool) -> str:
    """The text that `generated` adds after `emitted`. Byte-level tokens can end mid-character: until the
    answer is final, a trailing U+FFFD is held back so a delta never carries half a character."""
    text = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not final:
        text = text.rstrip("\ufffd")
    return text[len(emitted):] if text.startswith(emitted) else ""


class AnswerBackend(Protocol):
    """What the pipeline calls, on the device worker: a per-stream session (None when the backend keeps no
    stream state; else it has `set_context(text)` and `prefill_step() -> int`, and with a vision-language
    model `set_context(text, suffix)` for the video memory), then start/step/release."""

    name: str

    def open_session(self) -> Any: ...

    def start(self, context: str, question: str, *, seed: int | None = None, session: Any = None) -> Any: ...

    def step(self, state: Any) -> AnswerStep: ...

    def release(self, state: Any) -> None: ...


@dataclass
class AnswerState:
    """Everything one answer needs between steps; dropped by `release()`."""

    prompt_ids: list[int]
    cache: DynamicCache | None
    next_logits: torch.Tensor | None  # logits for the next token, from the last forward
    generator: torch.Generator | None  # sampling only; seeded per answer
    generated: list[int] = field(default_factory=list)
    emitted: str = ""  # text sent so far (a prefix of the decoded generated ids)
    context_tokens: int = 0  # tokens of context kept in the prompt
    context_cut: bool = False  # True when the context was cut from the front to fit
    done: bool = False
    finish_reason: str | None = None


@dataclass(frozen=True)
class AnswerStep:
    delta: str  # new text (may be "" while a multi-byte character is incomplete)
    done: bool
    finish_reason: str | None  # "stop" (eos) | "length" (max_new_tokens) | None
    tokens: int = 1  # output tokens this step produced (speculative steps may accept several)


class Answerer:
    """A causal LM answering questions about the transcript; shared by sessions, state per answer."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cfg: LMConfig,
        *,
        name: str,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.name = name
        self.seed = seed
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)

    @classmethod
    def load(
        cls,
        cfg: LMConfig,
        *,
        device: str,
        dtype: str,
        seed: int = 0,
        progress: Callable[[str], None] | None = None,
    ) -> Answerer:
        with load_progress(progress, "lm", cfg.model, device, dtype):
            path = resolve_checkpoint(cfg.model, role="lm", progress=progress)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).to(device).eval()
        return cls(model, tokenizer, cfg, name=cfg.model, seed=seed)

    # -- prompt ---------------------------------------------------------------------------------------

    def prompt_text(self, context: str, question: str) -> str:
        user = f"Transcript so far:\n{context or '(nothing yet)'}\n\nQuestion: {question}"
        if getattr(self.tokenizer, "chat_template", None):
            messages = [
                {"role": "system", "content": self.cfg.system_prompt},
                {"role": "user", "content": user},
            ]
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return f"{self.cfg.system_prompt}\n\n{user}\nAnswer:"  # a base model without a chat template

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def build_prompt(self, context: str, question: str) -> tuple[list[int], int, bool]:
        """Prompt ids within `max_context_tokens`, keeping the END of the context (the latest speech).

        Returns (ids, context tokens kept, whether the context was cut)."""
        budget = self.cfg.max_context_tokens
        ids = self._ids(self.prompt_text(context, question))
        if len(ids) <= budget:
            return ids, len(self._ids(context)), False
        overhead = len(self._ids(self.prompt_text(CUT_MARK, question)))
        if overhead > budget:
            raise UserError(
                f"the question needs {overhead} prompt tokens, more than lm.max_context_tokens={budget}; "
                "ask a shorter question or raise lm.max_context_tokens"
            )
        context_ids = self._ids(context)
        keep = budget - overhead
        while True:  # re-tokenising at the cut can merge differently: shrink until it fits
            tail = self._decode(context_ids[max(0, len(context_ids) - keep) :] if keep else []).lstrip("\ufffd")
            ids = self._ids(self.prompt_text(CUT_MARK + tail, question))
            if len(ids) <= budget or keep == 0:
                return ids, keep, True
            keep = max(0, keep - (len(ids) - budget))

    # -- decoding -------------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @torch.inference_mode()
    def open_session(self) -> None:
        """No per-stream state: this answerer prefills everything at question time."""
        return None

    def start(self, context: str, question: str, *, seed: int | None = None, session: None = None) -> AnswerState:
        """Build and prefill the prompt; the first token is chosen by the first `step()`."""
        ids, kept, cut = self.build_prompt(context, question)
        cache = DynamicCache(config=self.model.config)
        input_ids = torch.tensor([ids], device=self.model.device)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        generator = None
        if self.cfg.temperature > 0:
            generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        return AnswerState(
            prompt_ids=ids,
            cache=cache,
            next_logits=out.logits[0, -1],
            generator=generator,
            context_tokens=kept,
            context_cut=cut,
        )

    def _choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        if self.cfg.temperature <= 0 or generator is None:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.cfg.temperature, dim=-1)
        if self.cfg.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest head whose mass reaches top_p (always at least the most likely token)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.cfg.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))

    @torch.inference_mode()
    def step(self, state: AnswerState) -> AnswerStep:
        """Choose one token, stream its text, and run the forward that prepares the next one."""
        if state.done or state.next_logits is None:
            return AnswerStep("", True, state.finish_reason, 0)
        before = len(state.generated)
        token = self._choose(state.next_logits, state.generator)
        if token in self.eos_ids:
            state.done, state.finish_reason = True, "stop"
        else:
            state.generated.append(token)
            if len(state.generated) >= self.cfg.max_new_tokens:
                state.done, state.finish_reason = True, "length"
        delta = new_text(self.tokenizer, state.generated, state.emitted, final=state.done)
        state.emitted += delta
        if state.done:
            self.release(state)
        else:
            out = self.model(
                input_ids=torch.tensor([[token]], device=self.model.device),
                past_key_values=state.cache,
                use_cache=True,
            )
            state.next_logits = out.logits[0, -1]
        return AnswerStep(delta, state.done, state.finish_reason, len(state.generated) - before)

    def release(self, state: AnswerState) -> None:
        """Drop the KV cache now (a cancelled answer must not hold device memory until collected)."""
        state.cache = None
        state.next_logits = None
        state.generator = None
        if not state.done:
            state.done = True


class NoAnswerer:
    """The answerer of a session that takes no questions (`runtime transcribe`): no model, no stream state."""

    name = "none"

    def open_session(self) -> None:
        return None

    def start(self, context: str, question: str, *, seed: int | None = None, session: Any = None) -> Any:
        raise UserError("this session loaded no language model, so it answers no questions")

    def step(self, state: Any) -> AnswerStep:
        raise UserError("this session loaded no language model, so it answers no questions")

    def release(self, state: Any) -> None:
        return None


def load_answerer(
    cfg: LMConfig,
    *,
    device: str,
    dtype: str,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> AnswerBackend:
    if cfg.backend == "generate":
        return Answerer.load(cfg, device=device, dtype=dtype, seed=seed, progress=progress)
    if cfg.backend == "engine":
        from runtime.models.lm.engine_answerer import EngineAnswerer  # lazy: imports the engine's own model

        return EngineAnswerer.load(cfg, device=device, dtype=dtype, seed=seed, progress=progress)
    raise ConfigError(f"unknown lm.backend {cfg.backend!r} (known: {', '.join(BACKENDS)})")
