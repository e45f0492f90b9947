"""The language engine: our Transformer over an attention-sink KV cache, prefilled while the context streams in.

`LMEngine` is shared (model, tokenizer, config; loaded once); an `EngineSession` (engine_session.py) is one
stream's cache and token bookkeeping. Every method but `set_context` runs on the device worker.

Prompt layout (`prompt.prompt_parts`: the same text as `prompt.prompt_text`, cut in two where the transcript goes):

    source group:  <system prompt + user-turn framing "Transcript so far:\\n"> <transcript, growing and revised>
    target group:  <"\\n\\nQuestion: ..." + end of user turn + assistant header> <answer tokens>

A vision-language model's memory joins the source as a suffix after the transcript (`set_context(text,
suffix)`): text pieces and `Visual` pieces, input embeddings that stand in for tokens. Each visual row gets a
negative id derived from its piece's content key, so the longest-common-prefix rule below treats a changed
memory block exactly like changed text: the KV is kept up to the first difference. The transcript comes before
the memory so a new frame re-prefills only the memory, and the window evicts old transcript, never the memory.

The source head is pinned (it becomes the attention sinks when it is longer than `lm.sink_tokens`), so the
instructions survive the window sliding; the transcript after it is the StreamingLLM window. The target group
is separate (group position encoding): its positions continue from the source length at question time, it
sees the source as it was then, and the source keeps growing beside it without either seeing the other.

Streaming prefill (Stream2LLM): `set_context(text)` only records the newest transcript; `prefill_step()`
re-tokenises the changed tail, keeps the KV up to the longest common prefix of the old and new token ids
(update mode; append mode is the case where nothing is cut) and prefills at most `prefill_chunk_tokens` of
the rest. An edit before the window (of tokens already evicted) starts the source again from the sinks, and
a context that grew by more than the window at once runs only what the window keeps: either costs at most a
window (`_sync`, `_skip_evicted`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

import torch
from transformers import PreTrainedTokenizerBase

from runtime.config import LMConfig
from runtime.errors import ConfigError
from runtime.models.lm.compiled_step import CompiledStep, wanted
from runtime.models.lm.compiled_store import StepStore
from runtime.models.lm.engine_session import EngineSession
from runtime.models.lm.kernel_linears import use_runtime_kernels
from runtime.models.lm.packed_weights import load_model
from runtime.models.lm.prompt import Messages, Tools, prompt_parts
from runtime.models.lm.sampling import eos_ids as eos_set
from runtime.models.lm.tokenizer import load_tokenizer
from runtime.models.lm.transformer import Transformer
from runtime.models.lm.weight_formats import QUANTIZED
from runtime.models.loading import cache_dir, load_progress, resolve_checkpoint, torch_dtype

log = logging.getLogger(__name__)


class LMEngine:
    """The shared half: model, tokenizer, prompt framing and the cache geometry every session gets."""

    def __init__(self, model: Transformer, tokenizer: PreTrainedTokenizerBase, cfg: LMConfig, *, name: str,
                 seed: int = 0, eos_ids: int | Iterable[int] | None = None, max_question_tokens: int = 256,
                 tree_tokens: int = 128, reserve_tokens: int | None = None, pin_head: bool = True,
                 exact_prefill: bool = True, compiled: CompiledStep | None = None) -> None:
        """`exact_prefill`: the context's KV the same however it was cut into prefill jobs (`by_token`); a draft
        engine, whose guesses the target verifies, does without it. `compiled`: another engine's step of this same
        model (`model`), reused if this engine compiles one: the keys it has compiled (cache geometry, threads)
        are not compiled again."""
        if cfg.sink_tokens < 0 or cfg.window_tokens <= 0 or cfg.prefill_chunk_tokens <= 0:
            raise ConfigError("lm.sink_tokens must be >= 0, lm.window_tokens and lm.prefill_chunk_tokens > 0")
        self.model, self.tokenizer, self.cfg, self.name, self.seed = model, tokenizer, cfg, name, seed
        self.eos_ids = eos_set(eos_ids, tokenizer.eos_token_id)  # the checkpoint's generation config's, the tokenizer's
        self.head = self.prompt_parts("")[0]
        self.sink = max(cfg.sink_tokens, len(self.encode(self.head)) if pin_head else 0)
        self.window = cfg.window_tokens
        self.chunk = min(cfg.prefill_chunk_tokens, cfg.window_tokens)  # a chunk never evicts its own tokens
        self.reserve = reserve_tokens or 2 * self.chunk
        self.max_question_tokens = max_question_tokens
        self.target = max_question_tokens + cfg.max_new_tokens + tree_tokens
        # With int8/int4 weights on the CPU the context is prefilled with each token attending as a one-token step
        # would (`attention_by_token`): a chunk's SDPA call rounds with its shape, so the pieces the text happened
        # to land in (how busy the machine was) changed the answers. Their matmuls are row-independent, so the KV
        # is then bitwise the same however it was cut, until the window first slides (docs/llm.md says why and
        # what it costs). fp32 agrees to rounding anyway, and bf16's `F.linear` is not row-independent.
        self.by_token = exact_prefill and model.device.type == "cpu" and cfg.weights in QUANTIZED
        self._encoded: dict[str, list[int]] = {}
        self._heads: dict[str, str] = {}  # tool set (canonical JSON) -> its head (`head_for`)
        self.compiled: CompiledStep | None = None  # the CPU decode step compiled at load (`lm.compile`)
        if wanted(cfg.compile, model, cfg.drafter):
            a = model.args
            try:
                self.compiled = (compiled if compiled is not None and compiled.model is model
                                 else CompiledStep(model, StepStore(cache_dir() / "compiled_steps")))
                self.compiled.warm_up(a.num_layers, a.num_kv_heads, self.capacity(), a.head_dim,
                                      trees=cfg.drafter != "none")
            except Exception as err:  # no C++ compiler, an unwritable cache, ...: `auto` decodes eagerly instead
                if cfg.compile == "on":
                    raise ConfigError(f"lm.compile = on, but the decode step did not compile: "
                                      f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
                log.warning("lm.compile = auto: the decode step did not compile (%s); decoding eagerly", err)
                self.compiled = None

    @classmethod
    def load(cls, cfg: LMConfig, *, device: str, dtype: str, seed: int = 0,
             progress: Callable[[str], None] | None = None, **options: int | bool | None) -> LMEngine:
        # the weights' format is said beside the activations' dtype ("cpu/float32, int4 weights")
        shown = dtype if cfg.weights == "auto" else f"{dtype}, {cfg.weights} weights"
        with load_progress(progress, "lm", cfg.model, device, shown):
            path = resolve_checkpoint(cfg.model, role="lm", progress=progress)
            tokenizer, eos = load_tokenizer(path)
            kernels = cfg.weights in QUANTIZED and use_runtime_kernels(cfg.kernels, device)
            model = load_model(path, device=device, dtype=torch_dtype(dtype), weights=cfg.weights, kernels=kernels,
                               progress=progress)
            if progress is not None and wanted(cfg.compile, model, cfg.drafter):
                progress("compiling the decode step (lm.compile: about a minute the first time on this machine, "
                         "a few seconds from the runtime's cache after) ...")
            return cls(model, tokenizer, cfg, name=cfg.model, seed=seed, eos_ids=eos, **options)

    def open_session(self) -> EngineSession:
        return EngineSession(self)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_cached(self, text: str) -> list[int]:
        """`encode` for the short, repeating texts of a memory suffix (timestamps, labels)."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) > 4096:
                self._encoded.clear()
            ids = self._encoded[text] = self.encode(text)
        return ids

    def prompt_parts(self, question: str, tools: Tools = None, after: Messages = ()) -> tuple[str, str]:
        """(head, tail): head + transcript + tail is exactly the plain answerer's prompt text."""
        return prompt_parts(self.tokenizer, self.cfg.system_prompt, question, tools, after)

    def head_for(self, tools: Tools) -> str:
        """The source head with `tools` written where the template writes them (its system turn), kept per tool set:
        a session's answers all render the same tools."""
        if not tools:
            return self.head
        key = json.dumps(tools, sort_keys=True)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) > 64:
                self._heads.clear()
            head = self._heads[key] = self.prompt_parts("", tools)[0]
        return head

    @torch.inference_mode()
    def embed_text(self, text: str) -> torch.Tensor | None:
        """Mean input embedding [hidden] of `text`'s tokens (float32), or None for text without tokens: a
        question or a segment note in the visual tokens' embedding space (video-memory selection)."""
        ids = self.encode(text)
        if not ids:
            return None
        table = self.model.model.embed_tokens
        return table(torch.tensor(ids, dtype=torch.long, device=self.model.device)).float().mean(0)

    def capacity(self) -> int:
        """Cache slots every session gets (`kv_cache.SinkKVCache.capacity`)."""
        return self.sink + self.window + self.reserve + self.target

    def cache_bytes(self) -> int:
        """KV bytes one session holds, constant for its lifetime: K, V and rotated K, two int64 position vectors."""
        a = self.model.args
        slots = self.capacity()
        return 3 * a.num_layers * a.num_kv_heads * slots * a.head_dim * self.model.dtype.itemsize + 16 * slots

