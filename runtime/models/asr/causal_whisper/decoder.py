"""The decoder side of causal streaming Whisper: prompts and next-token distributions over a growing encoder.

Whisper's decoder reads the encoder through cross-attention. In streaming the encoder grows block by block,
so each decoder layer keeps its cross-attention K/V and projects only the NEW encoder frames when they
arrive: the frames are final (block-causal encoder), so their K/V never change and are never recomputed (a
preview's partial block is the exception: appended, then dropped again with `drop_frames`).
Decoded tokens keep a self-attention KV cache the usual way; `truncate` rolls it back when the stream
policy cuts tokens. The semantics this fixes, and that the reference below recomputes from scratch:

    a decoder position is computed with the encoder frames that existed when it was (last) fed.

So a token fed at block 3 keeps the key/values it got from blocks 1..3 even after block 9 arrives, exactly
like a KV cache in any streaming decoder; the policy re-feeds the positions it wants re-judged.

`IncrementalDecoder` is the streaming implementation (caches only); `RecomputeDecoder` is the reference:
no cache at all, every call re-runs the whole decoder over all positions with a per-position
cross-attention mask (position p sees the first n_p frames). Both share `_forward`, which re-implements
Whisper's decoder layer (pre-norm self-attention, cross-attention, MLP; queries pre-scaled by
head_dim^-0.5 as Whisper does) on the model's own modules, so LoRA-wrapped projections work unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase, WhisperForConditionalGeneration

from runtime.models.asr.whisper_checkpoint import prompt_prefix


def context_ids(tokenizer: PreTrainedTokenizerBase, sot: Sequence[int], previous: Sequence[int]) -> list[int]:
    """The decoder prefix of an item that continues earlier text (the turns before it, a user's vocabulary, the
    stable text carried across a cache reset): `whisper_checkpoint.prompt_prefix`, Whisper's own prompt format."""
    return prompt_prefix(tokenizer, list(sot), list(previous))


class Scorer(Protocol):
    """What the stream policy needs: encoder frames in, next-token log-probabilities out."""

    n_frames: int

    def add_frames(self, frames: torch.Tensor) -> None: ...

    def feed(self, ids: Sequence[int], last: int | None = None) -> torch.Tensor: ...

    def truncate(self, length: int) -> None: ...

    def drop_frames(self, n_frames: int) -> None:
        """Forget the encoder frames from `n_frames` on (a preview's partial block)."""
        ...

    @property
    def length(self) -> int: ...


class _Buffer:
    """A [heads, T, head_dim] tensor grown along T with amortised doubling (appends copy only the new rows)."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None
        self.size = 0

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[1]
        if self._data is None or self.size + n > self._data.shape[1]:
            cap = max(16, 2 * (self.size + n))
            grown = x.new_empty(x.shape[0], cap, x.shape[2])
            if self._data is not None:
                grown[:, : self.size] = self._data[:, : self.size]
            self._data = grown
        self._data[:, self.size : self.size + n] = x
        self.size += n

    def view(self) -> torch.Tensor:
        assert self._data is not None
        return self._data[:, : self.size]


class _Layers:
    """Whisper's decoder modules, reached through the base model (works for a peft-wrapped model too)."""

    def __init__(self, model: WhisperForConditionalGeneration) -> None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = base.model.decoder
        self.proj_out = base.proj_out
        self.heads = base.config.decoder_attention_heads
        self.max_positions = base.config.max_target_positions
        self.device = base.device

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [heads, T, head_dim]."""
        return x.view(x.shape[0], self.heads, -1).transpose(0, 1)

    def cross_kv(self, frames: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Cross-attention K/V of encoder frames [n, d] for every layer."""
        return [
            (self.split(layer.encoder_attn.k_proj(frames)), self.split(layer.encoder_attn.v_proj(frames)))
            for layer in self.decoder.layers
        ]

    def forward(
        self,
        ids: Sequence[int],
        start: int,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
        cross: Sequence[tuple[torch.Tensor, torch.Tensor]],
        cross_mask: torch.Tensor | None,
        last: int | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Log-probs [n, vocab] (float32) for `ids` at positions start.. (only the `last` rows if given: the
        vocabulary projection dominates a long prefix), and their self-attention K/V."""
        n = len(ids)
        if start + n > self.max_positions:
            raise ValueError(f"decoder position {start + n} exceeds max_target_positions {self.max_positions}")
        dec = self.decoder
        ids_t = torch.tensor(list(ids), device=self.device)
        h = dec.embed_tokens(ids_t) + dec.embed_positions.weight[start : start + n]
        self_mask = None
        if n > 1:
            self_mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)
        new_kv = []
        for i, layer in enumerate(dec.layers):
            sa = layer.self_attn
            x = layer.self_attn_layer_norm(h)
            q = self.split(sa.q_proj(x) * sa.scaling)
            k, v = self.split(sa.k_proj(x)), self.split(sa.v_proj(x))
            new_kv.append((k, v))
            if past is not None:
                k, v = torch.cat([past[i][0], k], 1), torch.cat([past[i][1], v], 1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask, scale=1.0)
            h = h + sa.out_proj(a.transpose(0, 1).reshape(n, -1))
            ca = layer.encoder_attn
            x = layer.encoder_attn_layer_norm(h)
            q = self.split(ca.q_proj(x) * ca.scaling)
            a = F.scaled_dot_product_attention(q, cross[i][0], cross[i][1], attn_mask=cross_mask, scale=1.0)
            h = h + ca.out_proj(a.transpose(0, 1).reshape(n, -1))
            x = layer.final_layer_norm(h)
            h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
        logits = self.proj_out(dec.layer_norm(h if last is None else h[n - last :]))
        return logits.float().log_softmax(-1), new_kv


class IncrementalDecoder:
    """One stream's decoder state: cross-attention K/V appended per new encoder block, self-attention KV
    per fed position. `feed` costs only the fed tokens; `add_frames` costs only the new frames."""

    def __init__(self, model: WhisperForConditionalGeneration) -> None:
        self._layers = _Layers(model)
        n = len(self._layers.decoder.layers)
        self._cross = [(_Buffer(), _Buffer()) for _ in range(n)]
        self._self = [(_Buffer(), _Buffer()) for _ in range(n)]
        self.n_frames = 0

    @property
    def length(self) -> int:
        """Decoder positions held in the self-attention cache."""
        return self._self[0][0].size

    @torch.inference_mode()
    def add_frames(self, frames: torch.Tensor) -> None:
        """Append encoder frames [n, d] (final: never revised; a preview's are dropped again, `drop_frames`)."""
        if frames.shape[0] == 0:
            return
        for (kb, vb), (k, v) in zip(self._cross, self._layers.cross_kv(frames), strict=True):
            kb.append(k)
            vb.append(v)
        self.n_frames += frames.shape[0]

    @torch.inference_mode()
    def feed(self, ids: Sequence[int], last: int | None = None) -> torch.Tensor:
        """Log-probs [len(ids), vocab] of the token after each of `ids` (only the `last` rows if given);
        the ids are appended to the cache."""
        if self.n_frames == 0:
            raise RuntimeError("feed before any encoder frame")
        past = [(k.view(), v.view()) for k, v in self._self] if self.length else None
        cross = [(k.view(), v.view()) for k, v in self._cross]
        logp, new_kv = self._layers.forward(ids, self.length, past, cross, None, last)
        for (kb, vb), (k, v) in zip(self._self, new_kv, strict=True):
            kb.append(k)
            vb.append(v)
        return logp

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of the self-attention cache (roll back the rest)."""
        for kb, vb in self._self:
            kb.size = vb.size = min(kb.size, length)

    def drop_frames(self, n_frames: int) -> None:
        """Keep the first `n_frames` encoder frames' cross-attention K/V (a preview's partial block is taken
        back; positions fed with it must be truncated too)."""
        for kb, vb in self._cross:
            kb.size = vb.size = min(kb.size, n_frames)
        self.n_frames = min(self.n_frames, n_frames)


class RecomputeDecoder:
    """The reference for `IncrementalDecoder`: no cache. It keeps only the token ids and, per position, the
    frame count it was fed with; every `feed` re-runs the decoder over all positions with a cross-attention
    mask that limits position p to its own frames. Quadratic: for tests and offline checks only."""

    def __init__(self, model: WhisperForConditionalGeneration) -> None:
        self._layers = _Layers(model)
        self._frames: list[torch.Tensor] = []
        self._ids: list[int] = []
        self._seen: list[int] = []
        self.n_frames = 0

    @property
    def length(self) -> int:
        return len(self._ids)

    def add_frames(self, frames: torch.Tensor) -> None:
        self._frames.append(frames)
        self.n_frames += frames.shape[0]

    @torch.inference_mode()
    def feed(self, ids: Sequence[int], last: int | None = None) -> torch.Tensor:
        if self.n_frames == 0:
            raise RuntimeError("feed before any encoder frame")
        self._ids += list(ids)
        self._seen += [self.n_frames] * len(ids)
        frames = torch.cat(self._frames)
        seen = torch.tensor(self._seen, device=frames.device)
        mask = torch.arange(self.n_frames, device=frames.device)[None, :] < seen[:, None]
        logp, _ = self._layers.forward(self._ids, 0, None, self._layers.cross_kv(frames), mask, last or len(ids))
        return logp

    def truncate(self, length: int) -> None:
        del self._ids[length:], self._seen[length:]

    def drop_frames(self, n_frames: int) -> None:
        """Keep the first `n_frames` encoder frames (positions fed with later ones must be truncated too)."""
        if n_frames < self.n_frames:
            self._frames = [torch.cat(self._frames)[:n_frames]]
            self.n_frames = n_frames
