"""Our decoder-only Transformer for the Llama and Qwen2 families, in one plain file (gpt-fast style).

Why our own: the engine needs an attention call that transformers' models do not expose. Keys are cached
before RoPE and rotated by positions the caller chooses (StreamingLLM positions inside the cache), and
attention takes an arbitrary boolean mask over cache slots (tree attention for speculative decoding, separate
source/target position groups). So `forward` takes the new tokens, their query positions, the positions of
every key slot it attends to, and the mask; the KV cache is preallocated buffers the caller owns
(`kv_cache.SinkKVCache`): un-rotated K, V, and rotated K with the position each slot was rotated at, so a
forward rotates only its new keys and those whose position changed (a decode step: one key per layer).

Module names equal the checkpoints' (`model.layers.N.self_attn.o_proj`, ...) except two fusions made once at
load: q/k/v_proj -> `qkv_proj` and gate/up_proj -> `gate_up_proj` (one matmul each instead of three and two).

The numerics follow transformers' Llama/Qwen2 (RMSNorm in float32, RoPE cos/sin computed in float32 and cast,
SwiGLU MLP), so in float32 our logits equal the reference model's to ~1e-6.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.models.lm import cpu_kernels
from runtime.models.lm.attention import KernelKeys, Mask, TokenKeys, attention_by_token, token_keys
from runtime.models.lm.weights import ModelArgs

CacheBuffers = tuple[Tensor, Tensor, Tensor, Tensor]  # K, V, rotated K [layers, 1, kv_heads, slots, d]; positions
KV = tuple[Tensor, Tensor, Tensor]  # one layer's K, V, rotated K [kv_heads, slots, head_dim]
Rope = tuple[Tensor, Tensor]  # cos, sin [n, head_dim]
Rotate = tuple[slice | Tensor, Tensor, Tensor] | None  # slots to (re)rotate from K, their cos/sin [m, d]


class CachedPart(NamedTuple):
    """One session's part of `Transformer.forward_many`: what `forward` takes for a cached forward."""

    tokens: Tensor  # [n]
    q_pos: Tensor  # [n]
    k_pos: Tensor  # [slots attended]
    mask: Tensor  # [n, slots attended]
    cache: CacheBuffers
    slot: int


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies of RoPE with transformers' default, linear and llama3 scalings (float32, CPU)."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    s = args.rope_scaling
    kind = s.get("rope_type")
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "factors":  # Llama 3.1 as a GGUF file stores it: one divisor per frequency
        inv = inv / torch.tensor(s["factors"], dtype=torch.float32)
    elif kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def linear(x: Tensor, layer: nn.Module) -> Tensor:
    """`layer(x)` without nn.Module's call machinery (hooks are never used here; it costs ~5 us a call). A
    float `nn.Linear` goes straight to `F.linear`; an int8 or int4 one (`weight_formats`) to its kernel."""
    if type(layer) is nn.Linear:
        return F.linear(x, layer.weight, layer.bias)
    return layer.forward(x)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., n, d] with cos/sin [n, d], or x [n, heads, d] with cos/sin [n, 1, d]."""
    return x * cos + rotate_half(x) * sin


def rotate_keys(ck: Tensor, kr: Tensor, rotate: Rotate) -> None:
    """(Re)make one layer's rotated keys `kr` from its un-rotated keys `ck` at the slots `rotate` names."""
    if rotate is not None:
        where, cos, sin = rotate
        kr[:, where] = apply_rope(ck[:, where], cos, sin)


def layer_views(cache: CacheBuffers) -> list[KV]:
    """Each layer's K, V and rotated K as [kv_heads, slots, head_dim] views (six ops, not six per layer)."""
    return list(zip(cache[0][:, 0].unbind(0), cache[1][:, 0].unbind(0), cache[2][:, 0].unbind(0), strict=True))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """transformers' RMSNorm. Its weight stays float32 (`transformer_build.transformer_from_state`): a bf16
        input is normalised in float32 as transformers does, and rounded once, after the weight instead of before
        it (a last-bit difference).

        A float input of the weight's dtype goes to torch's fused kernel. A bf16 one has its sum of squares taken
        in float64, where any summation order gives the same float32 (each square of a bf16 value has at most 16
        significant bits: the sum is exact unless they span more than ~2^37), then rounded: the compiled step
        (`compiled_step`) reduces in another order than eager torch, and a float32 mean made its norms differ
        from these in the last bit, enough to flip a bf16 rounding now and then."""
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        var = x.double().square().sum(-1, keepdim=True).div_(x.shape[-1]).float()
        return x.float().mul_(var.add_(self.eps).rsqrt_()).mul_(self.weight).to(x.dtype)


class Attention(nn.Module):
    """q/k/v as one fused projection (`qkv_proj`, built from the checkpoint's q/k/v_proj at load)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x: Tensor, rope_q: Rope, mask: Mask, cache: KV | None, slot: int | Tensor,
                rotate: Rotate) -> Tensor:
        """`x` [n, hidden]: the new tokens' queries attend over the cache's slots [0, S) (under `mask` [n, S], or
        all of them when `mask` is the int S) after writing their own K/V at `slot`
        (an int: slots [slot, slot + n); a tensor of n slot indices: written with `index_copy_`, no host value
        needed, as a CUDA graph requires).

        A layer's cache is K, V and rotated K as [kv_heads, slots, head_dim] views of the session's buffers.
        New queries and keys are rotated together at the query positions (`rope_q`: cos/sin [n, 1, d]); K/V go
        to the cache un-rotated and the rotated keys to the rotated-key buffer. `rotate` (None: nothing else)
        names other slots to (re)rotate from K at their positions; every other slot's rotated key is reused.
        Without a cache the new tokens attend to themselves only (the reference forward). Query heads sharing a
        K/V head are folded into the query length (one SDPA over [kv_heads, group * n] queries), with `mask`
        already repeated per group."""
        return linear(self.attend(linear(x, self.qkv_proj), rope_q, mask, cache, slot, rotate), self.o_proj)

    def attend(self, qkv: Tensor, rope_q: Rope, mask: Mask, cache: KV | None, slot: int | Tensor,
               rotate: Rotate) -> Tensor:
        """`forward` between its two projections: the fused q/k/v rows [n, q + 2 kv] of the new tokens in, their
        attention output [n, q_size] out (`Transformer.forward_many` projects several sessions' rows at once and
        attends each over its own cache)."""
        n, h, kv = qkv.shape[0], self.n_heads, self.n_kv
        qkv = qkv.view(n, h + 2 * kv, self.head_dim)
        qk = apply_rope(qkv[:, : h + kv], *rope_q).transpose(0, 1)  # [heads + kv_heads, n, d]
        q, k, v = qk[:h], qk[h:], qkv[:, h + kv :].transpose(0, 1)
        if cache is not None:
            ck, cv, kr = cache
            if isinstance(slot, Tensor):
                ck.index_copy_(1, slot, qkv[:, h : h + kv].transpose(0, 1))
                cv.index_copy_(1, slot, v)
                kr.index_copy_(1, slot, k)
            else:
                ck.narrow(1, slot, n).copy_(qkv[:, h : h + kv].transpose(0, 1))
                cv.narrow(1, slot, n).copy_(v)
                kr.narrow(1, slot, n).copy_(k)
            rotate_keys(ck, kr, rotate)
            size = (mask if isinstance(mask, int) else mask.size if isinstance(mask, TokenKeys)
                    else mask.mask.shape[-1] if isinstance(mask, KernelKeys) else mask.shape[-1])
            k, v = kr.narrow(1, 0, size), cv.narrow(1, 0, size)
            if isinstance(mask, KernelKeys):  # every token alone, in one call: [n, heads, d]
                return cpu_kernels.attend(q.transpose(0, 1), k, v, mask.mask, self.scale).reshape(n, self.q_size)
        q = q.reshape(kv, -1, self.head_dim)  # [kv_heads, group * n, d]: a view when n == 1
        if isinstance(mask, TokenKeys):  # verification: each token as its own decode step would see it
            out = attention_by_token(q, k, v, mask, self.scale)
        else:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scale,
                                                 attn_mask=None if isinstance(mask, int) else mask)[0]
        return out.reshape(h, n, self.head_dim).transpose(0, 1).reshape(n, self.q_size)


class MLP(nn.Module):
    """SwiGLU with gate and up as one fused projection (`gate_up_proj`, built from gate_proj/up_proj at load)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, rope_q: Rope, mask: Mask, cache: KV | None, slot: int | Tensor,
                rotate: Rotate) -> Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), rope_q, mask, cache, slot, rotate)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class Backbone(nn.Module):
    """`model.*` in the checkpoints: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self._rope_table: Rope | None = None  # cos/sin for positions [0, len), grown on demand
        self.weights = "auto"  # the format its projections were built in (weight_formats.WEIGHT_FORMATS)
        # cached attention on the runtime's kernel (`KernelKeys`): set at load where its linears run on the runtime's
        # kernels (the library is built and loaded then), on the CPU
        self.kernel_attention = False

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the embeddings' (a packed table, `kernel_linears.PackedEmbedding`, says its own)."""
        table = self.model.embed_tokens
        return table.weight.dtype if isinstance(table, nn.Embedding) else table.dtype

    def rope(self, positions: Tensor) -> Rope:
        """cos/sin [n, head_dim] for integer positions, computed in float32 then cast (as transformers does).

        Rows come from a table over positions [0, P) (the same float32 computation per row, so the same values),
        grown to a power of two above the largest position asked for."""
        top = int(positions.max()) + 1 if positions.numel() else 0
        table = self._rope_table
        if table is None or table[0].shape[0] < top or (table[0].device, table[0].dtype) != (self.device, self.dtype):
            size = max(256, 1 << (top - 1).bit_length())
            freqs = torch.arange(size, device=self.device)[:, None].float() * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            table = self._rope_table = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))
        return table[0][positions], table[1][positions]

    def _rotation(self, rot_pos: Tensor, q_pos: Tensor, k_pos: Tensor, slot: int) -> Rotate:
        """Which slots of [0, len(k_pos)) need their rotated key made from K this forward: those whose position
        differs from the one their rotated key was made with (moved by eviction, say) and the new slots
        [slot, slot + n) if they do not sit at `q_pos`; None when there are none (the usual case: the new keys
        are rotated with the queries). `rot_pos` is updated to `k_pos`."""
        n, size = q_pos.shape[0], k_pos.shape[0]
        stale = rot_pos[:size] != k_pos
        stale[slot : slot + n] = k_pos[slot : slot + n] != q_pos
        rot_pos[:size] = k_pos
        if not bool(stale.any()):
            return None
        stale[slot : slot + n] = True
        idx = stale.nonzero().squeeze(1)
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        where: slice | Tensor = slice(lo, hi) if hi - lo == idx.shape[0] else idx
        return (where, *self.rope(k_pos[where]))

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        q_pos: Tensor,
        k_pos: Tensor | None = None,
        mask: Tensor | None = None,
        cache: CacheBuffers | None = None,
        slot: int = 0,
        last_only: bool = False,
        embeds: Tensor | None = None,
        by_token: bool = False,
        head: bool = True,
    ) -> Tensor:
        """Logits (float32) [n, vocab] for `tokens` [n] (or [1, n]), or [1, vocab] with `last_only`; without
        `head`, the last layer's hidden states [n, hidden] (or [1, hidden]) instead: a prefill that only fills the
        cache skips the vocabulary projection, a fifth of a small forward's cost at 1.5B (151,936 x 1,536).

        `q_pos` [n]: the new tokens' RoPE positions. With a cache (`kv_cache.SinkKVCache.buffers`: K, V and
        rotated-K buffers [layers, 1, kv_heads, slots, d] and the positions [slots] the rotated keys were made
        with), the new tokens' K/V go to slots [slot, slot+n) and they attend over slots [0, len(k_pos)) whose
        keys sit at positions `k_pos` under `mask` [n, len(k_pos)] (True = attend). Without a cache this is the
        plain forward over `tokens` at positions `q_pos` (keys at `q_pos` too), causal unless `mask` is given:
        the reference the engine is tested against. `embeds` [n, hidden], when given, are the input embeddings
        instead of the token ids' (a VLM's visual tokens); `tokens` then only sets n and the device. `by_token`
        (cached forwards): each token attends as its own one-token step would (`attention_by_token`), so a
        verified draft gets exactly the logits plain decoding would, and a context prefilled in any pieces the
        KV of one prefill."""
        tokens = tokens.reshape(-1)
        n = tokens.shape[0]
        if cache is None:
            cos, sin = self.rope(q_pos)
            rope_q, rotate = (cos[:, None], sin[:, None]), None
            attend: Mask = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril() if mask is None else mask
            if self.args.num_heads > self.args.num_kv_heads and n > 1:
                attend = attend.repeat(self.args.num_heads // self.args.num_kv_heads, 1)
        elif k_pos is None or mask is None:
            raise ValueError("a cached forward needs k_pos and mask")
        else:
            rope_q, attend, rotate = self._cached_inputs(n, q_pos, k_pos, mask, cache, slot, by_token)
        x = self.model.embed_tokens(tokens) if embeds is None else embeds.to(self.dtype).reshape(n, -1)
        per_layer = [None] * len(self.model.layers) if cache is None else layer_views(cache)
        for layer, layer_cache in zip(self.model.layers, per_layer, strict=True):
            x = layer.forward(x, rope_q, attend, layer_cache, slot, rotate)
        if last_only:
            x = x[-1:]
        if not head:
            return x
        return linear(self.model.norm.forward(x), self.lm_head).float()

    def _cached_inputs(self, n: int, q_pos: Tensor, k_pos: Tensor, mask: Tensor, cache: CacheBuffers, slot: int,
                       by_token: bool) -> tuple[Rope, Mask, Rotate]:
        """What a cached forward's layers take for its n new tokens: their RoPE (cos/sin [n, 1, d]: queries and keys
        are rotated as [n, heads, d]), the mask in the form the attention call wants, and the slots to re-rotate."""
        cos, sin = self.rope(q_pos)
        rotate = self._rotation(cache[3], q_pos, k_pos, slot)
        attend: Mask = mask
        if self.kernel_attention:  # each token alone in one call: no host sync for a mask
            attend = KernelKeys(mask)
        elif n == 1 and bool(mask.all()):  # a decode step that sees every slot: no mask
            attend = mask.shape[-1]
        elif by_token:
            attend = token_keys(mask)
        group = self.args.num_heads // self.args.num_kv_heads
        if isinstance(attend, Tensor) and group > 1 and n > 1:
            attend = attend.repeat(group, 1)  # query rows are [group, n] per K/V head (see Attention.forward)
        return (cos[:, None], sin[:, None]), attend, rotate

    @torch.inference_mode()
    def forward_many(self, parts: Sequence[CachedPart]) -> list[Tensor]:
        """Several cached forwards in one: each part is another session's new tokens over its own cache (as
        `forward` takes them, `by_token`). The projections and the MLP run once over every part's rows, so the
        weights are read once for all of them (a decode step is bound by that read: two sessions' steps cost little
        more than one); each part attends over its own cache. Returns each part's float32 logits [n_i, vocab]. With
        row-independent matmuls (the runtime's int8/int4 kernels) every row is bitwise what `forward` gives it."""
        inputs = [self._cached_inputs(p.tokens.shape[0], p.q_pos, p.k_pos, p.mask, p.cache, p.slot, True)
                  for p in parts]
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.tokens.shape[0])
        x = self.model.embed_tokens(torch.cat([p.tokens.reshape(-1) for p in parts]))
        views = [layer_views(p.cache) for p in parts]
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            qkv = linear(layer.input_layernorm.forward(x), attn.qkv_proj)
            out = torch.cat([attn.attend(qkv[bounds[j] : bounds[j + 1]], rope_q, attend, views[j][i], p.slot, rotate)
                             for j, (p, (rope_q, attend, rotate)) in enumerate(zip(parts, inputs, strict=True))])
            x = x + linear(out, attn.o_proj)
            x = x + layer.mlp.forward(layer.post_attention_layernorm.forward(x))
        logits = linear(self.model.norm.forward(x), self.lm_head).float()
        return [logits[bounds[j] : bounds[j + 1]] for j in range(len(parts))]

    @torch.inference_mode()
    def forward_fixed(self, tokens: Tensor, rope_q: Rope, mask: Tensor, cache: CacheBuffers, slot: Tensor) -> Tensor:
        """One token's cached forward with every shape and address fixed and no host synchronisation, the form
        a CUDA graph can record (cuda_graph.py): `tokens` [1], `rope_q` its cos/sin [1, 1, d], `mask` [1, S]
        over all S cache slots, `slot` [1] where its K/V go. Keys the caller has not rotated at their
        positions must not be under the mask (`rerotate` first). Logits [1, vocab] float32."""
        x = self.model.embed_tokens(tokens)
        for layer, layer_cache in zip(self.model.layers, layer_views(cache), strict=True):
            x = layer.forward(x, rope_q, mask, layer_cache, slot, None)
        return linear(self.model.norm.forward(x), self.lm_head).float()

    @torch.inference_mode()
    def rerotate(self, cache: CacheBuffers, q_pos: Tensor, k_pos: Tensor, slot: int) -> None:
        """What `forward` does first outside the layers: re-rotate the keys whose position changed, in every
        layer (`_rotation` decides which, and records the new positions in the cache's `rot_pos`)."""
        rotate = self._rotation(cache[3], q_pos, k_pos, slot)
        for ck, _, kr in layer_views(cache):
            rotate_keys(ck, kr, rotate)
