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
on the CPU and the token sees every live slot (the plain decode step). Everything else (prefill, verification
of drafted trees, source tokens arriving during an answer) stays eager. Keys that moved (eviction) are
re-rotated eagerly first (`Transformer.rerotate`).

Called without dynamo's guards: a guarded call of this step evaluated some 3,500 guards (every module and
parameter of the model, the marks on every input) before the compiled code ran: about 1.3 ms of a 9 ms step at
2 threads. So the step is compiled ahead (`aot_compile`) per key and its guard check is off. The key (`_key`)
is what the compiled code assumes of its inputs: each tensor's shape, strides, dtype and device, and the thread
count; `_step` checks it, and that `live` (the one dynamic size) lies in [2, capacity] (dynamo specialises 0
and 1). A new key compiles anew; one that fails to compile runs eagerly. The model's weights, which the guards
also checked, are fixed after load.

Cost: compiling takes about a minute cold on 2 cores (inductor's on-disk cache makes a recompile 14 s), so
`LMEngine.load` compiles at load (saying so), once per model, on a scratch cache of the sessions' geometry; a changed
thread count recompiles on the next step (torch bakes the OpenMP thread count into the kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.errors import ConfigError
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
    """Whether `lm.compile = mode` compiles this model's decode step: `on` on any CPU model; `auto` on a CPU
    model with int8 or int4 weights that decodes plainly (`lm.drafter = none`: with a drafter most steps verify
    a drafted tree, which stays eager, so the compile would cost its load time for a few steps); `off` never;
    never on other devices (CUDA has `lm.cuda_graphs`)."""
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
        q = qk[:h].reshape(kv, -1, d)  # [kv_heads, group, d], as Attention.forward folds the group
        out = F.scaled_dot_product_attention(q[None], kr[i, :, :, :live], v[i, :, :, :live], scale=attn.scale)[0]
        x = x + linear(out.reshape(h, 1, d).transpose(0, 1).reshape(1, attn.q_size), attn.o_proj)
        x = x + layer.mlp.forward(layer.post_attention_layernorm.forward(x))
    return linear(model.model.norm.forward(x), model.lm_head).float()


class CompiledStep:
    """One model's compiled decode step (`decode_step`), for every session of that model."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._traced = torch.compile(partial(decode_step, model), fullgraph=True, dynamic=True, options=OPTIONS)
        # key (`_key`) -> the step compiled for it, called without guards; None: it did not compile (eager)
        self._steps: dict[tuple[object, ...], Callable[..., Tensor] | None] = {}
        self.runs = 0

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
                self._steps[key] = self._compile(args)
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

    def _compile(self, args: tuple[Tensor | int, ...]) -> Callable[..., Tensor]:
        """The step compiled for these inputs' key, to be called without guards (module docstring); with a torch
        that has no `aot_compile`, the guarded step."""
        for t in args:
            if isinstance(t, Tensor):
                torch._dynamo.mark_static(t)  # fixed sizes: only `live` stays dynamic
        if not hasattr(self._traced, "aot_compile"):
            return self._traced
        with torch._dynamo.config.patch(specialize_float=True):  # the norms' eps and the scale: constants
            step = self._traced.aot_compile((args, {}))
        step.disable_guard_check()
        return step

    @torch.inference_mode()
    def warm_up(self, layers: int, kv_heads: int, capacity: int, head_dim: int) -> None:
        """Compile now, on a scratch cache of the sessions' geometry."""
        model = self.model
        shape = (layers, 1, kv_heads, capacity, head_dim)
        k, v, kr = (torch.zeros(shape, device=model.device, dtype=model.dtype) for _ in range(3))
        cos, sin = model.rope(torch.tensor([2], device=model.device))
        self._step(0, cos[:, None], sin[:, None], k, v, kr, 2, 3, strict=True)


def _key(*tensors: Tensor) -> tuple[object, ...]:
    """What a step compiled without guards assumes of its tensor inputs (shape, strides, dtype, device) and of the
    process (the OpenMP thread count, baked into the kernels)."""
    return (*((t.shape, t.stride(), t.dtype, t.device) for t in tensors), torch.get_num_threads())
