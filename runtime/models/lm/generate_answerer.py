"""The naive peer (`lm.backend = "generate"`): prefill the prompt at question time, then decode one token per
step with transformers.

One token per `step()` keeps each unit of device work short, so the worker can run ASR chunks between
tokens and a cancelled answer stops within one step. Greedy output must stay token-identical to
`model.generate(do_sample=False)`, which the tests check against this loop; the engine answerer must equal it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import __version__ as transformers_version

from runtime.config import LMConfig
from runtime.errors import ConfigError, PromptTooLong, UserError
from runtime.models.lm.backend import AnswerStep, AnswerText, JsonSchema, LMStream, token_limit
from runtime.models.lm.gguf_checkpoint import gguf_file
from runtime.models.lm.json_constraint import JsonConstraint, JsonGrammars
from runtime.models.lm.pieces import Piece
from runtime.models.lm.prompt import CUT_MARK, prompt_text
from runtime.models.lm.sampling import Sampler, StopRule, eos_ids
from runtime.models.lm.tokenizer import load_tokenizer
from runtime.models.loading import cache_dir, load_progress, resolve_checkpoint, torch_dtype


@dataclass(eq=False)
class GenerateAnswer:
    """One answer: everything it needs between steps; its KV is dropped by `release()`."""

    model: PreTrainedModel
    text: AnswerText
    sampler: Sampler
    prompt_ids: list[int]
    cache: DynamicCache | None
    next_logits: torch.Tensor | None  # logits for the next token, from the last forward
    generator: torch.Generator | None  # sampling only; seeded per answer
    context_tokens: int = 0  # tokens of context kept in the prompt
    context_cut: bool = False  # True when the context was cut from the front to fit
    constraint: JsonConstraint | None = None  # a JSON schema's grammar: tokens chosen from masked logits
    done: bool = False

    @torch.inference_mode()
    def step(self) -> AnswerStep:
        """Choose one token, stream its text, and run the forward that prepares the next one."""
        if self.done or self.next_logits is None:
            return AnswerStep("", True, self.text.finish_reason, 0)
        if self.constraint is None:
            tokens = [self.sampler.choose(self.next_logits, self.generator)]
        else:
            tokens = [self.sampler.choose(self.constraint.mask(self.next_logits), self.generator)]
            self.constraint.consume(tokens[0])
            if self.constraint.finished and tokens[0] not in self.constraint.stop_ids:
                tokens.append(self.constraint.stop)  # a complete value: the end needs no forward
        token = tokens[0]
        step = self.text.take(tokens)
        if step.done:
            self.release()
        else:
            out = self.model(
                input_ids=torch.tensor([[token]], device=self.model.device),
                past_key_values=self.cache,
                use_cache=True,
            )
            self.next_logits = out.logits[0, -1]
        return step

    @property
    def generated(self) -> list[int]:
        return self.text.generated

    def release(self) -> None:
        """Drop the KV cache now (a cancelled answer must not hold device memory until collected)."""
        self.cache = None
        self.next_logits = None
        self.generator = None
        self.done = True

    def stats(self) -> None:
        """Plain decoding: no speculative counters."""
        return None


def transformers_model(path: Path, dtype: torch.dtype, *, keep: bool = False) -> PreTrainedModel:
    """transformers' own causal LM for a checkpoint folder or a GGUF file (which transformers dequantises).

    `keep`: a GGUF file's conversion is saved once (its weights and config: `_save_dequantised`) into the runtime's
    cache and read from there after, keyed by the file's name, size and modification time, the dtype and the
    transformers version.
    transformers dequantises in Python (about 30 s for SmolLM2-135M on 2 cores, the larger part of a peer row or
    a test that checks the engine against it); what is read back is that same conversion. The bench and the tests
    keep it; a `generate` profile does not, since an fp32 copy of a large model would fill the disk."""
    file = gguf_file(path)
    if file is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if not keep:
        return AutoModelForCausalLM.from_pretrained(file.parent, dtype=dtype, gguf_file=file.name)
    stat = file.stat()
    dt = str(dtype).removeprefix("torch.")
    folder = (cache_dir() / "transformers-gguf"
              / f"{file.stem}-{stat.st_size}-{stat.st_mtime_ns}-{dt}-transformers{transformers_version}")
    if (folder / "config.json").is_file():
        try:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        except Exception:  # noqa: BLE001 - a truncated or foreign folder: converted again below
            shutil.rmtree(folder, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(file.parent, dtype=dtype, gguf_file=file.name)
    with contextlib.suppress(OSError):  # a full or read-only cache: converted again next time
        folder.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder.parent).free > 2 * model.num_parameters() * model.dtype.itemsize:
            tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
            try:
                _save_dequantised(model, tmp)
                os.replace(tmp, folder)  # whole or not at all (another process may have kept it first)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return model


def _save_dequantised(model: PreTrainedModel, folder: Path) -> None:
    """What `from_pretrained(folder)` reads back as `model`: its weights (dequantised already) and its config less
    the GGUF quantisation note, which makes `save_pretrained` refuse a model loaded from a GGUF file."""
    from safetensors.torch import save_model

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})


class GenerateAnswerer:
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
        self.sampler = Sampler(cfg.temperature, cfg.top_p)
        self.eos_ids = eos_ids(model.generation_config.eos_token_id, tokenizer.eos_token_id)
        self._grammars: JsonGrammars | None = None  # built on the first schema

    @classmethod
    def load(
        cls,
        cfg: LMConfig,
        *,
        device: str,
        dtype: str,
        seed: int = 0,
        progress: Callable[[str], None] | None = None,
    ) -> GenerateAnswerer:
        if cfg.weights not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"lm.weights = {cfg.weights} is a format of the engine's own model; lm.backend = "
                              "generate runs transformers' model in the profile's dtype (use lm.backend = engine)")
        if cfg.weights != "auto":
            dtype = {"fp32": "float32", "bf16": "bfloat16"}[cfg.weights]
        with load_progress(progress, "lm", cfg.model, device, dtype):
            path = resolve_checkpoint(cfg.model, role="lm", progress=progress)
            tokenizer, _ = load_tokenizer(path)
            model = transformers_model(path, torch_dtype(dtype)).to(device).eval()
        return cls(model, tokenizer, cfg, name=cfg.model, seed=seed)

    # -- prompt ---------------------------------------------------------------------------------------

    def prompt_text(self, context: str, question: str) -> str:
        return prompt_text(self.tokenizer, self.cfg.system_prompt, context, question)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def build_prompt(self, context: str, question: str) -> tuple[list[int], int, bool]:
        """Prompt ids within `max_context_tokens`, keeping the END of the context (the latest speech).

        Returns (ids, context tokens kept, whether the context was cut)."""
        budget = self.cfg.max_context_tokens
        ids = self._ids(self.prompt_text(context, question))
        if len(ids) <= budget:
            return ids, len(self._ids(context)), False
        overhead = len(self._ids(self.prompt_text(CUT_MARK, question)))
        if overhead > budget:
            raise PromptTooLong(
                f"the question and the instructions need {overhead} prompt tokens, more than "
                f"lm.max_context_tokens={budget}; shorten them or raise lm.max_context_tokens"
            )
        context_ids = self._ids(context)
        keep = budget - overhead
        while True:  # re-tokenising at the cut can merge differently: shrink until it fits
            tail = self._decode(context_ids[max(0, len(context_ids) - keep) :] if keep else []).lstrip("\ufffd")
            ids = self._ids(self.prompt_text(CUT_MARK + tail, question))
            if len(ids) <= budget or keep == 0:
                return ids, keep, True
            keep = max(0, keep - (len(ids) - budget))

    # -- the backend ----------------------------------------------------------------------------------

    def open_stream(self) -> None:
        """No per-stream state: this answerer prefills everything at question time."""
        return None

    def start(self, context: str, question: str, *, seed: int | None = None, stream: LMStream | None = None,
              suffix: Sequence[Piece] | None = None, max_tokens: int | None = None,
              schema: JsonSchema | None = None) -> GenerateAnswer:
        """Build and prefill the prompt; the first token is chosen by the first `step()`. `stream` is always
        None here (`open_stream` opens none); a text model reads no video memory, so `suffix` must be empty.
        With `schema` each token is chosen under the schema's grammar (`json_constraint`)."""
        if suffix:
            raise UserError(f"lm.backend = generate reads no video memory ({self.name} is a text model)")
        constraint = None
        if schema is not None:
            if self._grammars is None:
                vocab = self.model.get_output_embeddings().weight.shape[0]
                self._grammars = JsonGrammars(self.tokenizer, vocab, self.eos_ids)
            constraint = self._grammars.constraint(schema)
        ids, kept, cut = self.build_prompt(context, question)
        cache = DynamicCache(config=self.model.config)
        input_ids = torch.tensor([ids], device=self.model.device)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return GenerateAnswer(
            model=self.model,
            text=AnswerText(self.tokenizer, StopRule(frozenset(self.eos_ids), token_limit(self.cfg, max_tokens),
                                          self.cfg.stop_repeats), framing=schema is None),
            sampler=self.sampler,
            prompt_ids=ids,
            cache=cache,
            next_logits=out.logits[0, -1],
            generator=self.sampler.generator(self.seed if seed is None else seed),
            context_tokens=kept,
            context_cut=cut,
            constraint=constraint,
        )

    @torch.inference_mode()
    def embed_text(self, text: str) -> torch.Tensor | None:
        """Mean input embedding [hidden] (float32) of `text`'s tokens, or None for text without tokens."""
        ids = self._ids(text)
        if not ids:
            return None
        table = self.model.get_input_embeddings()
        return table(torch.tensor(ids, dtype=torch.long, device=self.model.device)).float().mean(0)
