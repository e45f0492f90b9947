"""The one-token decode step compiled by torch.compile (inductor) for CPU, once per model, and shared by its sessions.

Why: on a CPU a decode step of a small model is not bound by its matmuls alone. SmolLM2-135M in int4 spends
about a third of an eager step in some 3,500 small torch ops (norms, RoPE, cache writes, residual adds, SiLU),
each paying the dispatcher and Python. Inductor fuses the elementwise work between the matmuls into a few C++
loops and keeps the int4/int8 kernels and SDPA as calls to the same aten kernels the eager step uses.

How the step stays in place: the session's K, V and rotated-K buffers ([layers, 1, kv_heads, capacity, d],
`kv_cache.SinkKVCache`) are passed whole, and each layer writes its new K/V with one `index_put_` on the whole
buffer (layer, head and slot indices). Inductor turns those into in-place stores. An earlier try that passed
per-layer views (`transformer.layer_views`) made AOTAutograd copy every buffer back on each call: 600 ms a step.

Exactness: the step computes what `Transformer.forward` computes for one token, op for op, and
`emulate_precision_casts` makes inductor round every bf16 intermediate where eager rounds it. Attention spans
exactly the live slots [0, live) without a mask, as the eager step does when it sees every slot (the attended
length is a dynamic size: one compile serves every length). The one reduction inductor writes itself, the
RMSNorm's sum of squares, is exact in float64 in both paths (`transformer.RMSNorm`). So with bf16 activations
(bf16, int8, int4 weights) its logits equal the eager step's bitwise, and greedy and speculative decoding stay
token-identical; in float32 they agree to rounding (the fused kernel's reduction order).

Where it is used: `EngineSession.score` for a one-token tree when `lm.compile` is on (`wanted`), the cache is
on the CPU and the token sees every live slot (the plain decode step); and, with a drafter, for the verification
of a drafted tree (`tree_step`) on a model whose attention runs on the runtime's kernel (int8/int4 weights on the
runtime's kernels, `Transformer.kernel_attention`): one compile for every tree size and attended length. On the
1.5B at 2 threads a 4-token verification eagerly cost 1.37 plain steps, compiled 1.15 (docs/llm.md). Everything
else (prefill, source tokens arriving during an answer) stays eager. Keys that moved (eviction) are re-rotated
eagerly first (`Transformer.rerotate`).

Called without dynamo's guards: a guarded call of this step evaluated some 3,500 guards (every module and
parameter of the model, the marks on every input) before the compiled code ran: about 1.3 ms of a 9 ms step at
2 threads. So the step is compiled ahead (`aot_compile`) per key and its guard check is off. The key (`_key`)
is what the compiled code assumes of its inputs: each tensor's shape, strides, dtype and device, and the thread
count; `_step` checks it, and that `live` (the one dynamic size) lies in [2, capacity] (dynamo specialises 0
and 1). A new key compiles anew; one that fails to compile runs eagerly. The model's weights, which the guards
also checked, are fixed after load.

Cost: compiling takes about a minute cold on 2 cores (inductor's on-disk cache makes a recompile 14-25 s), so
`LMEngine.load` compiles at load (saying so), once per model, on a scratch cache of the sessions' geometry; a changed
thread count recompiles on the next step (torch bakes the OpenMP thread count into the kernels). A step compiled
ahead is kept in the runtime's cache (`store`, compiled_store.py) and read back by the next process in about 2 s:
torch's own caches miss for steps compiled ahead.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.errors import ConfigError
from runtime.models.lm import cpu_kernels
from runtime.models.lm.compiled_store import StepStore, step_key
from runtime.models.lm.kv_cache import Attend, SinkKVCache
from runtime.models.lm.transformer import Transformer, apply_rope, linear
from runtime.models.lm.weight_formats import QUANTIZED

log = logging.getLogger(__name__)
COMPILE_MODES = ("auto", "on", "off")
AUTO_FORMATS = QUANTIZED  # where `auto` compiles: the formats whose eager step is most overhead-bound
# emulate_precision_casts: round bf16 intermediates where eager does (exactness, above); cpp_wrapper and no size
# asserts: the step's ~300 kernel calls made from C++, not Python (about 6 % of a SmolLM2 int4 step at 1 thread)
OPTIONS = {"emulate_precision_casts": True, "cpp_wrapper": True, "size_asserts": False}


def wanted(mode: str, model: Transformer, drafter: str = "none") -> bool:
    """Whether `lm.compile = mode` compiles this model's decode step: `on` on any CPU model (with a drafter, its
    verification too where `tree_step` serves the model); `auto` on a CPU model with int8 or int4 weights that
    decodes plainly (`lm.drafter = none`: with a drafter, compiling both steps costs about twice the load time, 1.7
    minutes cold on the 1.5B, which the default profile's start-up and tests would pay; `on` is the choice for
    drafted decoding at its fastest); `off` never; never on other devices (CUDA has `lm.cuda_graphs`)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"lm.compile {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if model.device.type != "cpu" or mode == "off":
        return False
    return mode == "on" or (model.weights in AUTO_FORMATS and drafter == "none")


def decode_step(model: Transformer, token: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, kr: Tensor,
                slot: Tensor, live: int) -> Tensor:
    """`Transformer.forward` for one token `token` [1] at RoPE cos/sin [1, 1, d], its K/V written at `slot` [1]
    of the whole buffers k, v, kr [layers, 1, kv_heads, capacity, d], attending over slots [0, live) unmasked.
    Logits [1, vocab] float32. The form torch.compile traces (`CompiledStep`)."""
    first = model.model.layers[0].self_attn
    h, kv, d = first.n_heads, first.n_kv, first.head_dim
    heads = torch.arange(kv, device=k.device)
    zero = torch.zeros(1, dtype=torch.long, device=k.device)
    x = model.model.embed_tokens(token)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        qkv = linear(layer.input_layernorm.forward(x), attn.qkv_proj).view(1, h + 2 * kv, d)
        qk = apply_rope(qkv[:, : h + kv], cos, sin).transpose(0, 1)  # [heads + kv_heads, 1, d]
        where = (torch.full((1,), i, dtype=torch.long, device=k.device), zero, heads, slot)
        k.index_put_(where, qkv[0, h : h + kv])
        v.index_put_(where, qkv[0, h + kv :])
        kr.index_put_(where, qk[h:, 0])
        if model.kernel_attention:  # the kernel Attention.forward calls (`KernelKeys`), over every live slot
            out = cpu_kernels.attend(qk[:h].transpose(0, 1), kr[i, 0, :, :live], v[i, 0, :, :live], None, attn.scale)
            x = x + linear(out.reshape(1, attn.q_size), attn.o_proj)
        else:
            q = qk[:h].reshape(kv, -1, d)  # [kv_heads, group, d], as Attention.forward folds the group
            out = F.scaled_dot_product_attention(q[None], kr[i, :, :, :live], v[i, :, :, :live], scale=attn.scale)[0]
            x = x + linear(out.reshape(h, 1, d).transpose(0, 1).reshape(1, attn.q_size), attn.o_proj)
        x = x + layer.mlp.forward(layer.post_attention_layernorm.forward(x))
    return linear(model.model.norm.forward(x), model.lm_head).float()


def tree_step(model: Transformer, tokens: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, kr: Tensor,
              slots: Tensor, mask: Tensor) -> Tensor:
    """`Transformer.forward` for the n >= 2 tokens of a drafted tree (a verification) on a model whose attention
    runs on the runtime's kernel (`Transformer.kernel_attention`): tokens [n] at RoPE cos/sin [n, 1, d], their K/V
    written at `slots` [n] of the whole buffers, token i attending over the slots of [0, S) that row i of `mask`
    [n, S] marks. Logits [n, vocab] float32. Each token's row is computed as the one-token step computes it (the
    kernels are row-independent), so a verified draft gets the plain step's logits bitwise."""
    first = model.model.layers[0].self_attn
    h, kv, d = first.n_heads, first.n_kv, first.head_dim
    n, live = tokens.shape[0], mask.shape[1]
    heads = torch.arange(kv, device=k.device)[None].expand(n, kv)
    zero = torch.zeros(n, kv, dtype=torch.long, device=k.device)
    at = slots[:, None].expand(n, kv)
    x = model.model.embed_tokens(tokens)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        qkv = linear(layer.input_layernorm.forward(x), attn.qkv_proj).view(n, h + 2 * kv, d)
        qk = apply_rope(qkv[:, : h + kv], cos, sin)  # [n, heads + kv_heads, d]
        where = (torch.full((n, kv), i, dtype=torch.long, device=k.device), zero, heads, at)
        k.index_put_(where, qkv[:, h : h + kv])
        v.index_put_(where, qkv[:, h + kv :])
        kr.index_put_(where, qk[:, h:])
        out = cpu_kernels.attend(qk[:, :h], kr[i, 0, :, :live], v[i, 0, :, :live], mask, attn.scale)
        x = x + linear(out.reshape(n, attn.q_size), attn.o_proj)
        x = x + layer.mlp.forward(layer.post_attention_layernorm.forward(x))
    return linear(model.model.norm.forward(x), model.lm_head).float()


class CompiledStep:
    """One model's compiled decode step (`decode_step`), for every session of that model."""

    def __init__(self, model: Transformer, store: StepStore | None = None) -> None:
        """`store`: where compiled steps are kept for other processes (None: compiled in this one only)."""
        self.model, self.store = model, store
        # embeddings kept in the file's blocks (`kernel_linears.PackedEmbedding`) turn fp16 scales into bf16 rows in one
        # fused kernel, which inductor notes with a warning on every compile; the conversion goes through float32 and
        # is exact as written, so the note is only noise on a user's terminal
        warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning)
        self._traced = torch.compile(partial(decode_step, model), fullgraph=True, dynamic=True, options=OPTIONS)
        # key (`_key`) -> the step compiled for it, called without guards; None: it did not compile (eager)
        self._steps: dict[tuple[object, ...], Callable[..., Tensor] | None] = {}
        # the verification of drafted trees, where the attention runs on the runtime's kernel (`tree_step`)
        self._tree_traced = (torch.compile(partial(tree_step, model), fullgraph=True, dynamic=True, options=OPTIONS)
                             if model.kernel_attention else None)
        self._trees: dict[tuple[object, ...], Callable[..., Tensor] | None] = {}
        self.runs = 0
        self.tree_runs = 0

    @staticmethod
    def fits(attend: Attend) -> bool:
        """Whether a one-token `attend` is the plain decode step: the token sees every slot before it (at least
        two slots: the compiled step's attended length is a dynamic size, which dynamo never makes 0 or 1)."""
        return attend.q_pos.shape[0] == 1 and attend.mask.shape[-1] >= 2 and bool(attend.mask.all())

    @torch.inference_mode()
    def run(self, token: int, attend: Attend, cache: SinkKVCache) -> Tensor | None:
        """Logits [1, vocab] of `token` placed as `attend` says (one slot that sees all before it: `fits`); None
        when no compiled step can run these inputs (a new key that did not compile): the caller runs it eagerly."""
        model = self.model
        model.rerotate(cache.buffers, attend.q_pos, attend.k_pos, attend.slot)
        cos, sin = model.rope(attend.q_pos)
        logits = self._step(token, cos[:, None], sin[:, None], cache.k, cache.v, cache.kr, attend.slot,
                            attend.mask.shape[-1])
        self.runs += logits is not None
        return logits

    def fits_tree(self, attend: Attend) -> bool:
        """Whether `tree_step` verifies these tokens: two or more, on a model with kernel attention, once an engine
        with a drafter has compiled it (`warm_up(trees=True)`). Never compiled on first use: a draft engine's
        own multi-token catch-ups would pay a minute's compile inside an answer."""
        return bool(self._trees) and attend.q_pos.shape[0] >= 2 and attend.mask.shape[-1] >= 2

    @torch.inference_mode()
    def run_tree(self, tokens: list[int], attend: Attend, cache: SinkKVCache) -> Tensor | None:
        """Logits [n, vocab] of a drafted tree's `tokens` placed as `attend` says (`fits_tree`); None when no
        compiled step can run these inputs: the caller runs them eagerly."""
        model, n, live = self.model, len(tokens), attend.mask.shape[-1]
        if not 2 <= n < live <= cache.k.shape[3]:  # the compiled form, called without guards: never outside it
            raise ValueError(f"the compiled verification takes 2 or more tokens attending over more slots, at most "
                             f"{cache.k.shape[3]}; asked for {n} over {live}")
        model.rerotate(cache.buffers, attend.q_pos, attend.k_pos, attend.slot)
        cos, sin = model.rope(attend.q_pos)
        slots = torch.arange(attend.slot, attend.slot + n, device=cache.k.device)
        logits = self._tree(torch.tensor(tokens, dtype=torch.long, device=cache.k.device), cos[:, None],
                            sin[:, None], cache.k, cache.v, cache.kr, slots, attend.mask)
        self.tree_runs += logits is not None
        return logits

    def _tree(self, tokens: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, kr: Tensor, slots: Tensor,
              mask: Tensor, *, strict: bool = False) -> Tensor | None:
        key = _key(k, v, kr) + (cos.dtype,)
        if key not in self._trees:
            try:
                self._trees[key] = self._compile_tree(key, (tokens, cos, sin, k, v, kr, slots, mask))
            except Exception as err:  # a later compile (a changed thread count): that key verifies eagerly
                if strict:
                    raise
                log.warning("lm.compile: the verification step did not compile for %s (%s); verifying eagerly",
                            key, err)
                self._trees[key] = None
        step = self._trees[key]
        return None if step is None else step(tokens, cos, sin, k, v, kr, slots, mask)

    def _compile_tree(self, key: tuple[object, ...], args: tuple[Tensor, ...]) -> Callable[..., Tensor]:
        """`tree_step` compiled once for every tree size and attended length (dynamic), the cache static."""
        assert self._tree_traced is not None
        for t in args[3:6]:
            torch._dynamo.mark_static(t)
        for t in (*args[:3], args[6], args[7]):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(args[7], 1)
        return self._ahead("tree_step", key, self._tree_traced, args)

    def _step(self, token: int, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, kr: Tensor, slot: int,
              live: int, *, strict: bool = False) -> Tensor | None:
        if not 2 <= live <= k.shape[3] or not 0 <= slot < live:
            raise ValueError(f"the compiled step attends 2 to {k.shape[3]} slots and writes one of them; "
                             f"asked for {live}, writing {slot}")
        key = _key(cos, sin, k, v, kr)
        if key not in self._steps:
            args = (torch.zeros(1, dtype=torch.long, device=k.device), cos, sin, k, v, kr,
                    torch.zeros(1, dtype=torch.long, device=k.device), live)
            try:
                self._steps[key] = self._compile(key, args)
            except Exception as err:  # a compile on a later step (a changed thread count): that key runs eagerly
                if strict:
                    raise
                log.warning("lm.compile: the decode step did not compile for %s (%s); decoding eagerly", key, err)
                self._steps[key] = None
        step = self._steps[key]
        if step is None:
            return None
        ids = torch.tensor([token], dtype=torch.long, device=k.device)
        where = torch.tensor([slot], dtype=torch.long, device=k.device)
        return step(ids, cos, sin, k, v, kr, where, live)

    def _compile(self, key: tuple[object, ...], args: tuple[Tensor | int, ...]) -> Callable[..., Tensor]:
        """The step compiled for these inputs' key, to be called without guards (module docstring); with a torch
        that has no `aot_compile`, the guarded step."""
        for t in args:
            if isinstance(t, Tensor):
                torch._dynamo.mark_static(t)  # fixed sizes: only `live` stays dynamic
        return self._ahead("decode_step", key, self._traced, args)

    def _ahead(self, kind: str, key: tuple[object, ...], traced: Callable[..., Tensor],
               args: tuple[Tensor | int, ...]) -> Callable[..., Tensor]:
        """`traced` compiled ahead for `args`, read from the store when another process compiled it (and kept there
        when this one compiles it): compiled_store.py."""
        if self.store is None:
            return _unguarded(traced, args)
        name = step_key(self.model, kind, key, OPTIONS)
        step = self.store.load(name, self.model)
        if step is not None:
            try:  # once on copies of the inputs (the step writes the cache): a file that reads back but cannot run
                step(*(a.clone() if isinstance(a, Tensor) else a for a in args))
                return step
            except Exception as err:
                log.warning("lm.compile: the stored step %s does not run here (%s); compiling it again", name,
                            str(err).splitlines()[0] if str(err) else type(err).__name__)
        step = _unguarded(traced, args)
        self.store.save(name, step, self.model)
        return step

    @torch.inference_mode()
    def warm_up(self, layers: int, kv_heads: int, capacity: int, head_dim: int, *, trees: bool = False) -> None:
        """Compile now, on a scratch cache of the sessions' geometry: the one-token step, and with `trees` (a
        drafter's engine) the verification step where the model has one (`tree_step`)."""
        model = self.model
        shape = (layers, 1, kv_heads, capacity, head_dim)
        k, v, kr = (torch.zeros(shape, device=model.device, dtype=model.dtype) for _ in range(3))
        cos, sin = model.rope(torch.tensor([2], device=model.device))
        self._step(0, cos[:, None], sin[:, None], k, v, kr, 2, 3, strict=True)
        if trees and self._tree_traced is not None:
            n, live = 5, 37  # sizes unlike any other (a size seen twice is traced as one symbol)
            cos, sin = model.rope(torch.arange(live - n, live, device=model.device))
            mask = torch.ones(n, live, dtype=torch.bool, device=model.device).tril(live - n)
            self._tree(torch.zeros(n, dtype=torch.long, device=model.device), cos[:, None], sin[:, None], k, v, kr,
                       torch.arange(live - n, live, device=model.device), mask, strict=True)


def _unguarded(traced: Callable[..., Tensor], args: tuple[Tensor | int, ...]) -> Callable[..., Tensor]:
    """`traced` compiled ahead for `args` (marked static or dynamic by the caller) with its guard check off; with a
    torch that has no `aot_compile`, the guarded `traced` itself."""
    if not hasattr(traced, "aot_compile"):
        return traced
    with torch._dynamo.config.patch(specialize_float=True):  # the norms' eps and the scale: constants
        step = traced.aot_compile((args, {}))
    step.disable_guard_check()
    return step


def _key(*tensors: Tensor) -> tuple[object, ...]:
    """What a step compiled without guards assumes of its tensor inputs (shape, strides, dtype, device) and of the
    process (the OpenMP thread count, baked into the kernels)."""
    return (*((t.shape, t.stride(), t.dtype, t.device) for t in tensors), torch.get_num_threads())
