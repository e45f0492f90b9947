"""Our decoder-only Transformer for the Llama and Qwen2 families, in one plain file (gpt-fast style).

Why our own: the engine needs an attention call that transformers' models do not expose. Keys are cached
before RoPE and rotated at attention time by positions the caller chooses (StreamingLLM positions inside the
cache), and attention takes an arbitrary boolean mask over cache slots (tree attention for speculative
decoding, separate source/target position groups). So `forward` takes the new tokens, their query positions,
the positions of every key slot it attends to, and the mask; the KV cache is two preallocated buffers the
caller owns (`kv_cache.SinkKVCache`). Module names equal the checkpoints' (`model.layers.N.self_attn.q_proj`,
...), so loading is a `load_state_dict` of the safetensors as they are.

The numerics follow transformers' Llama/Qwen2 (RMSNorm in float32, RoPE cos/sin computed in float32 and cast,
SwiGLU MLP), so in float32 our logits equal the reference model's to ~1e-6.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.errors import CheckpointNotFound
from runtime.models.lm.weights import ModelArgs, load_state, read_config

KV = tuple[Tensor, Tensor]  # per-layer cache buffers, each [layers, 1, kv_heads, slots, head_dim]


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies of RoPE with transformers' default, linear and llama3 scalings (float32, CPU)."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    s = args.rope_scaling
    kind = s.get("rope_type")
    if kind == "linear":
        inv = inv / s["factor"]
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


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [1, heads, n, d]; cos/sin [n, d]."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.o_bias)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_k: tuple[Tensor, Tensor],
        mask: Tensor,
        cache: KV | None,
        slot: int,
    ) -> Tensor:
        """New tokens' queries attend over the cache's slots [0, S) after writing their own K/V at `slot`.

        K/V are written un-rotated; all S keys are rotated here by `rope_k` (their positions now), so a slot's
        position can change (eviction, position groups) without touching the stored key. Without a cache the
        new tokens attend to themselves only (the reference forward)."""
        n = x.shape[1]
        q = self.q_proj(x).view(1, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, n, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, n, self.n_kv, self.head_dim).transpose(1, 2)
        if cache is not None:
            ck, cv = cache
            ck[:, :, slot : slot + n] = k
            cv[:, :, slot : slot + n] = v
            size = rope_k[0].shape[0]
            k, v = ck[:, :, :size], cv[:, :, :size]
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(1, n, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, rope_q: tuple[Tensor, Tensor], rope_k: tuple[Tensor, Tensor], mask: Tensor,
                cache: KV | None, slot: int) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope_q, rope_k, mask, cache, slot)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin [n, head_dim] for integer positions, computed in float32 then cast (as transformers does)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        q_pos: Tensor,
        k_pos: Tensor | None = None,
        mask: Tensor | None = None,
        cache: KV | None = None,
        slot: int = 0,
        last_only: bool = False,
    ) -> Tensor:
        """Logits (float32) [n, vocab] for `tokens` [n] (or [1, n]), or [1, vocab] with `last_only`.

        `q_pos` [n]: the new tokens' RoPE positions. With a cache (K, V buffers [layers, 1, kv_heads, slots, d]),
        the new tokens' K/V go to slots [slot, slot+n) and they attend over slots [0, len(k_pos)) whose keys sit
        at positions `k_pos` under `mask` [n, len(k_pos)] (True = attend). Without a cache this is the plain
        causal forward over `tokens` at positions `q_pos` (the reference the engine is tested against)."""
        tokens = tokens.reshape(-1)
        if cache is None:
            k_pos = q_pos if k_pos is None else k_pos
            if mask is None:
                n = tokens.shape[0]
                mask = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        elif k_pos is None or mask is None:
            raise ValueError("a cached forward needs k_pos and mask")
        x = self.model.embed_tokens(tokens)[None]
        rope_q = self.rope(q_pos)
        rope_k = rope_q if k_pos is q_pos else self.rope(k_pos)
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else (cache[0][i], cache[1][i])
            x = layer(x, rope_q, rope_k, mask, layer_cache, slot)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))[0].float()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> Transformer:
        """Build from `config.json` and the safetensors weights, without random init (meta device)."""
        path = Path(path)
        args = read_config(path)
        with torch.device("meta"):
            model = cls(args)
        state = load_state(path, device=device, dtype=dtype)
        if args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            if "model.embed_tokens.weight" in state:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            what = f"lacks {missing[:3]}" if missing else f"has unexpected {unexpected[:3]}"
            raise CheckpointNotFound(f"lm checkpoint {path} {what} (a {args.model_type} checkpoint was expected)")
        model.load_state_dict(state, strict=True, assign=True)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(args).to(device)
        return model.eval().requires_grad_(False)
