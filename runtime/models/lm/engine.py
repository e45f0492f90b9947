"""The language engine: our Transformer over an attention-sink KV cache, prefilled while the context streams in.

`LMEngine` is shared (model, tokenizer, config; loaded once); an `EngineSession` is one stream's cache and
token bookkeeping. Every method but `set_context` runs on the device worker.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from runtime.config import LMConfig
from runtime.errors import ConfigError, PromptTooLong
from runtime.models.lm.compiled_step import CompiledStep, wanted
from runtime.models.lm.kernel_linears import use_runtime_kernels
from runtime.models.lm.kv_cache import Attend, SinkKVCache
from runtime.models.lm.packed_weights import load_model
from runtime.models.lm.pieces import Piece, visual_id
from runtime.models.lm.prompt import EMPTY_CONTEXT, Messages, Tools, prompt_parts
from runtime.models.lm.sampling import eos_ids as eos_set
from runtime.models.lm.source_tokens import SourceTokens
from runtime.models.lm.tokenizer import load_tokenizer
from runtime.models.lm.transformer import Transformer
from runtime.models.lm.weight_formats import QUANTIZED
from runtime.models.loading import load_progress, resolve_checkpoint, torch_dtype

if TYPE_CHECKING:  # imported at run time only on CUDA, by `EngineSession._decode_graph`
    from runtime.models.lm.cuda_graph import DecodeGraph

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
                self.compiled = compiled if compiled is not None and compiled.model is model else CompiledStep(model)
                self.compiled.warm_up(a.num_layers, a.num_kv_heads, self.capacity(), a.head_dim)
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
                         "about 30 s from torch's cache after) ...")
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


@dataclass
class SessionStats:
    prefilled: int = 0  # source tokens run through the model
    skipped: int = 0  # source tokens the window would have evicted before the context's end landed: never run
    restarts: int = 0  # edits before the window: the source started again from the sinks
    truncated: int = 0  # source tokens dropped by update mode or a restart (evicted ones too), re-run if wanted
    answers: int = 0


class EngineSession:
    """One stream: an attention-sink cache, the source token history, and the open answer (a `Target`)."""

    def __init__(self, engine: LMEngine) -> None:
        a = engine.model.args
        self.engine = engine
        self.vocab_size = a.vocab_size
        self.cache = SinkKVCache(layers=a.num_layers, kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                                 sink=engine.sink, window=engine.window, reserve=engine.reserve,
                                 target=engine.target, device=engine.model.device, dtype=engine.model.dtype)
        self.stats = SessionStats()
        self.source_logits: torch.Tensor | None = None  # after the last prefilled source token
        self._wanted = ""  # the newest transcript, set from any thread
        self._wanted_suffix: tuple[Piece, ...] = ()  # the newest memory suffix, set from any thread
        self._tokens = SourceTokens(engine.tokenizer)  # the current source text's ids, kept incrementally
        self._suffix: tuple[Piece, ...] = ()  # the suffix `_ids` was built from
        self._suffix_ids: list[int] = []
        self._visual: dict[int, torch.Tensor] = {}  # stand-in id -> its embedding row, for the current suffix
        self._ids: list[int] = []  # the wanted source: transcript ids, then suffix ids
        self._synced: tuple[str, tuple[Piece, ...]] = ("", ())  # (transcript, suffix) of the last sync
        self.answered_from: tuple[str, tuple[Piece, ...]] = ("", ())  # what the open/last answer saw
        self._hist: list[int] = []  # source ids whose KV was computed, from the start (evicted ones included)
        self._answer_prefix: list[int] = []  # the live source ids the open answer sees
        self._target: list[int] = []  # the open answer's committed target ids: prompt tail, then answer
        self._next: torch.Tensor | None = None
        self._tree: tuple[list[int], torch.Tensor] | None = None
        self._graph: DecodeGraph | None = None  # the CUDA-graph decode step, recorded on first use
        self._restart = False  # an edit before the window came during an answer: restart after it
        self.tools: Tools = None  # the function tools the head renders (a tool-taking template's system turn)
        self.head = engine.head

    # -- source group ---------------------------------------------------------------------------------------

    def set_context(self, text: str, suffix: Sequence[Piece] | None = None) -> None:
        """Record the transcript so far (its unstable tail included) and, when given, the memory suffix that
        follows it (None keeps the current one); cheap and safe from the event loop."""
        self._wanted = text
        if suffix is not None:
            self._wanted_suffix = tuple(suffix)

    def set_tools(self, tools: Tools) -> None:
        """Write `tools` into the head (None: the plain head). A new head changes the source from its system turn
        on, so the context after it is prefilled again; a head longer than the sinks becomes the sinks (the window
        gives up the slots, so the cache and the compiled step keep their shapes) and is never evicted. Not during
        an answer."""
        head = self.engine.head_for(tools)
        if head == self.head:
            self.tools = tools
            return
        if self.cache.answering:
            raise RuntimeError("the tools do not change during an answer")
        need = len(self.engine.encode(head))
        if need > self.engine.window // 2:  # refused before anything changes
            raise PromptTooLong(f"the tools' descriptions take {need} prompt tokens with the system prompt, more "
                                f"than half the engine's window of {self.engine.window}; declare fewer or shorter")
        self.head, self.tools = head, tools
        if need > self.cache.sink:
            self._restart_source(0)
            self.cache.resplit(need)
            self._graph = None

    def _build_suffix(self, suffix: tuple[Piece, ...]) -> None:
        ids: list[int] = []
        visual: dict[int, torch.Tensor] = {}
        for piece in suffix:
            if isinstance(piece, str):
                ids.extend(self.engine.encode_cached(piece))
                continue
            rows = piece.embeds.reshape(-1, piece.embeds.shape[-1])
            for r in range(rows.shape[0]):
                vid = visual_id(piece.key, r)
                visual[vid] = rows[r]
                ids.append(vid)
        self._suffix, self._suffix_ids, self._visual = suffix, ids, visual

    def _sync(self) -> None:
        """Re-tokenise a changed transcript or suffix and cut the KV back to the longest common prefix of ids."""
        wanted, suffix = self._wanted, self._wanted_suffix  # read once: the event loop may set them meanwhile
        self._synced = (wanted, suffix)
        same = self._tokens.update(self.head + (wanted or EMPTY_CONTEXT))
        if same is None and suffix == self._suffix and not (self._restart and not self.cache.answering):
            return
        if same is None:
            same = len(self._tokens.ids)
        if suffix != self._suffix:
            self._build_suffix(suffix)
        # without a suffix, share the transcript's list (SourceTokens replaces it, never mutates it): no copy of
        # an hour's ids per transcript update
        self._ids = new = self._tokens.ids + self._suffix_ids if self._suffix_ids else self._tokens.ids
        hist = self._hist
        keep = min(same, len(hist))
        while keep < len(hist) and keep < len(new) and hist[keep] == new[keep]:
            keep += 1
        committed = self.cache.sink + self.cache.evicted  # what lies before the window
        if self.cache.evicted and keep < committed:
            # An edit before the window (a deleted item, older screens consolidated): the window must become the
            # new text's end, which the old history cannot give (it held nothing of a short context after a long
            # pasted item was deleted). The source starts again from the sinks (those still the same) and
            # `prefill_step` runs, or skips to, the new end: at most a window. During an answer, which must keep
            # its view, that waits for the next sync after it.
            self._restart = True
        if self._restart:
            if not self.cache.answering:  # the sinks kept are those still the same (a deferred edit may be older)
                limit = min(self.cache.sink, len(hist), len(new))
                self._restart_source(next((i for i in range(limit) if hist[i] != new[i]), limit))
                return
            keep = max(keep, committed)
        if keep < len(hist):
            drop = len(hist) - keep
            self.cache.truncate_source(self.cache.source_len - drop)
            del hist[keep:]
            self.stats.truncated += drop

    def _restart_source(self, keep: int) -> None:
        keep = min(keep, len(self._hist))
        self._restart = False
        self.stats.truncated += len(self._hist) - keep
        self.stats.restarts += 1
        self.cache.restart_source(keep)
        del self._hist[keep:]

    def pending_tokens(self) -> int:
        """Source tokens still to prefill (re-tokenises first if the context changed)."""
        self._sync()
        return max(0, len(self._ids) - len(self._hist))

    @torch.inference_mode()
    def prefill_step(self) -> int:
        """Prefill at most `prefill_chunk_tokens` pending source tokens; returns how many (0: nothing to do, or
        the reserve is full during an answer and the rest waits for `end_answer`)."""
        pending = self.pending_tokens()
        if self._restart:  # (during an answer) the restart after it drops whatever the reserve took meanwhile
            return 0
        self._skip_evicted(pending)
        n = min(pending, self.engine.chunk, self.cache.source_room())
        if n <= 0:
            return 0
        start = len(self._hist)
        ids = self._ids[start : start + n]
        attend = self.cache.append_source(n)
        self.source_logits = self._forward(ids, attend, last_only=True, embeds=self._embeds(ids),
                                           by_token=self.engine.by_token)[0]
        self._hist.extend(ids)
        self.stats.prefilled += n
        return n

    def _skip_evicted(self, pending: int) -> None:
        """A context that grew by more than the window at once (a pasted document, a restored conversation): the
        tokens the window would evict before the last one lands are recorded as evicted without being run, so
        the prefill costs at most a window however long the text (a 3 MB message took half an hour). What is
        lost is their attention on the tokens after them, and once the window slides the keys a token sees
        depend on how the context was cut anyway (docs/llm.md). The sinks are always run first."""
        skip = pending - self.cache.window
        if skip <= 0 or self.cache.answering or len(self._hist) < self.cache.sink:
            return
        start = len(self._hist)
        self._hist.extend(self._ids[start : start + skip])
        self.cache.skip_source(skip)
        self.stats.skipped += skip

    def source_ids(self) -> list[int]:
        """The source ids whose KV is live: the sinks, then the window, in order."""
        s = min(self.cache.sink, len(self._hist))
        return self._hist[:s] + self._hist[s + self.cache.evicted :]

    def _embeds(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Input embeddings for `ids` when some stand for visual rows; None when all are plain tokens."""
        rows = [i for i, t in enumerate(ids) if t < 0]
        if not rows:
            return None
        model = self.engine.model
        plain = torch.tensor([max(t, 0) for t in ids], dtype=torch.long, device=model.device)
        x = model.model.embed_tokens(plain)
        x[rows] = torch.stack([self._visual[ids[i]] for i in rows]).to(device=x.device, dtype=x.dtype)
        return x

    def _forward(self, ids: Sequence[int], attend: Attend, *, last_only: bool,
                 embeds: torch.Tensor | None = None, by_token: bool = False) -> torch.Tensor:
        tokens = torch.tensor([max(t, 0) for t in ids], dtype=torch.long, device=self.cache.k.device)
        return self.engine.model(tokens, attend.q_pos, attend.k_pos, attend.mask, cache=self.cache.buffers,
                                 slot=attend.slot, last_only=last_only, embeds=embeds, by_token=by_token)

    # -- target group (the open answer) -------------------------------------------------------------------

    @torch.inference_mode()
    def begin_answer(self, question: str, after: Messages = ()) -> list[int]:
        """Prefill what is pending of the source, then the prompt tail (the question, and `after`: the exchange of
        calls being continued) into a new target group; returns the tail's ids. `next_logits()` then gives the
        first token's distribution."""
        if self.cache.answering:
            raise RuntimeError("an answer is already open; end_answer() first")
        ids = self.engine.encode(self.engine.prompt_parts(question, self.tools, after)[1])
        if len(ids) > self.engine.max_question_tokens:  # refused before the pending context costs its prefill
            what = "the question, the response's instructions and the calls' outputs" if after else (
                "the question and the response's instructions")
            raise PromptTooLong(f"{what} need {len(ids)} prompt tokens, more than the engine's "
                                f"{self.engine.max_question_tokens}; shorten them")
        while self.prefill_step():
            pass
        self.answered_from = self._synced  # the transcript and suffix this answer sees
        self.cache.begin_target()
        self._answer_prefix = self.source_ids()
        attend = self.cache.append_target(len(ids))
        # not by token: the tail is one call whatever the timing, so its rounding does not depend on it
        self._next = self._forward(ids, attend, last_only=True)[0]
        self._target, self._tree = list(ids), None
        self.stats.answers += 1
        return list(ids)

    def answer_ids(self) -> list[int]:
        """The sequence the open answer conditions on: the live source at question time, tail, answer so far."""
        return self._answer_prefix + self._target

    def next_logits(self) -> torch.Tensor:
        """Logits [vocab] for the token after the committed sequence (after the prompt, then after commits)."""
        if self._next is None:
            raise RuntimeError("no open answer: begin_answer() first")
        return self._next

    @torch.inference_mode()
    def score(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Target protocol: logits [n, vocab] for a tree of tokens after the committed answer (tree attention)."""
        if not self.cache.answering:
            raise RuntimeError("no open answer: begin_answer() first")
        if len(tokens) != len(parents):
            raise ValueError("tokens and parents differ in length")
        attend = self.cache.score_tree(parents)
        one = len(tokens) == 1 and tokens[0] >= 0
        graph = self._decode_graph() if one else None
        compiled = self.engine.compiled if one and graph is None else None
        # by token on CPU: each node's logits are exactly what a plain decode step there computes (lossless
        # greedy with row-independent matmuls: int8/int4; the compiled step computes them bitwise too). On CUDA
        # the decode step is the fixed-form graph, a different call anyway, and a call per node would make wide
        # trees dear: one masked call there.
        by_token = self.cache.k.device.type == "cpu"
        logits = None
        if graph:
            logits = graph.run(tokens[0], attend)
        elif compiled and compiled.fits(attend):
            logits = compiled.run(tokens[0], attend, self.cache)  # None: no compiled step for these inputs
        if logits is None:
            logits = self._forward(tokens, attend, last_only=False, by_token=by_token)
        self._tree = (list(tokens), logits)
        return logits

    def _decode_graph(self) -> DecodeGraph | None:
        """This session's recorded one-token step, on CUDA with `lm.cuda_graphs` (made on first use)."""
        if self._graph is None and self.engine.cfg.cuda_graphs and self.cache.k.device.type == "cuda":
            from runtime.models.lm.cuda_graph import DecodeGraph  # the CUDA-only boundary: imported only here

            self._graph = DecodeGraph(self.engine.model, self.cache, graph=True)
        return self._graph

    @torch.inference_mode()
    def commit(self, nodes: Sequence[int]) -> None:
        """Target protocol: keep one root-to-node path of the last scored tree, drop the other nodes."""
        if self._tree is None:
            if nodes:
                raise RuntimeError("commit() without a scored tree")
            return
        tokens, logits = self._tree
        self.cache.commit(nodes)
        self._target.extend(tokens[i] for i in nodes)
        if nodes:
            self._next = logits[nodes[-1]]
        self._tree = None

    def committed_tokens(self) -> int:
        """Target protocol: length of the committed sequence the answer conditions on (`answer_ids()`)."""
        return len(self._answer_prefix) + len(self._target)

    @torch.inference_mode()
    def end_answer(self) -> None:
        """Drop the target group; source tokens that arrived meanwhile become visible to the next answer."""
        self.cache.end_target()
        self._answer_prefix, self._target, self._next, self._tree = [], [], None, None
