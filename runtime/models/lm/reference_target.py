"""Targets over a plain transformers causal LM: a slow ground truth and a cached tree-attention version.

`RecomputeTarget` runs a full forward of committed + path for every tree node (nodes of one depth share a
batch: their sequences have the same length, so no mask is involved). Nothing can go stale, which makes it the
reference that the decoder, the drafters and the engine's sessions are tested against.

`CachedHFTarget` keeps a `DynamicCache` of the committed tokens and scores a tree in one forward with a 4-D
additive attention mask (each node sees the committed tokens, its ancestors and itself) and position ids
committed + depth; `commit(path)` keeps the path's K/V rows (contiguous positions, so the cache then equals a
sequential decode's) and drops the rest. transformers 5 passes a ready 4-D mask through unchanged for the
eager and sdpa attention implementations; models with sliding-window layers are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (0 = follows the committed sequence); validates `-1 <= parents[i] < i`."""
    depth: list[int] = []
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"node {i} has parent {par}: parents must precede children (-1 = root)")
        depth.append(0 if par < 0 else depth[par] + 1)
    return depth


def check_path(parents: Sequence[int], nodes: Sequence[int]) -> None:
    """`nodes` must be a root-to-node path of the tree: first node's parent -1, each next node a child."""
    prev = -1
    for node in nodes:
        if not 0 <= node < len(parents) or parents[node] != prev:
            raise ValueError(f"commit({list(nodes)}) is not a root-to-node path of the scored tree")
        prev = node


def _vocab(model: PreTrainedModel) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


class RecomputeTarget:
    """The obviously-correct Target: committed ids in a list, a full forward per tree depth.

    `memo` (a dict shared between instances over the same model) caches logits by token sequence: the model is
    a pure function of the sequence, so this changes nothing but speed (statistical tests score the same short
    prefixes thousands of times)."""

    def __init__(
        self,
        model: PreTrainedModel,
        prompt_ids: Sequence[int],
        *,
        memo: dict[tuple[int, ...], torch.Tensor] | None = None,
    ) -> None:
        self.model = model.eval() if model.training else model
        self.ids = [int(t) for t in prompt_ids]
        self.vocab_size = _vocab(model)
        self.memo = memo
        self.forwards = 0  # model calls, for tests
        self._tree: tuple[list[int], list[int]] | None = None

    @torch.inference_mode()
    def _logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """Last-position logits of each sequence (all the same length)."""
        todo = [s for s in seqs if self.memo is None or tuple(s) not in self.memo]
        if todo:
            self.forwards += 1
            out = self.model(input_ids=torch.tensor(todo, device=self.model.device)).logits[:, -1].float().cpu()
            if self.memo is None:
                return out
            for s, row in zip(todo, out, strict=True):
                self.memo[tuple(s)] = row
        assert self.memo is not None
        return torch.stack([self.memo[tuple(s)] for s in seqs])

    def next_logits(self) -> torch.Tensor:
        """[vocab] logits after the committed sequence (what `SpeculativeDecoder.start` takes)."""
        if not self.ids:
            raise ValueError("no committed tokens: nothing to predict from")
        return self._logits([self.ids])[0]

    def score(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        depth = tree_depths(parents)
        if len(tokens) != len(parents):
            raise ValueError("tokens and parents differ in length")
        paths: list[list[int]] = []
        for tok, par in zip(tokens, parents, strict=True):
            paths.append([*(paths[par] if par >= 0 else []), int(tok)])
        out = torch.empty(len(tokens), self.vocab_size)
        for d in sorted(set(depth)):
            idx = [i for i, di in enumerate(depth) if di == d]
            out[idx] = self._logits([self.ids + paths[i] for i in idx])
        self._tree = (list(map(int, tokens)), list(parents))
        return out

    def commit(self, nodes: Sequence[int]) -> None:
        if self._tree is None:
            if nodes:
                raise ValueError("commit() without a scored tree")
            return
        tokens, parents = self._tree
        check_path(parents, nodes)
        self.ids.extend(tokens[n] for n in nodes)
        self._tree = None

    def committed_tokens(self) -> int:
        return len(self.ids)


class CachedHFTarget:
    """A Target with a KV cache and tree attention over a transformers causal LM (batch 1; eager or sdpa)."""

    def __init__(self, model: PreTrainedModel, prompt_ids: Sequence[int]) -> None:
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("eager", "sdpa"):
            raise ValueError(f"tree attention needs a 4-D mask: attention implementation {impl!r} is unsupported")
        self.model = model.eval() if model.training else model
        self.vocab_size = _vocab(model)
        self.cache = DynamicCache(config=model.config)
        if any(layer.is_sliding for layer in self.cache.layers):
            raise ValueError("sliding-window layers are unsupported (their cache cannot take a tree)")
        self.ids: list[int] = []
        self._tree: tuple[list[int], list[int]] | None = None
        self._next: torch.Tensor | None = None
        if prompt_ids:
            logits = self.score(list(prompt_ids), list(range(-1, len(prompt_ids) - 1)))
            self.commit(list(range(len(prompt_ids))))
            self._next = logits[-1]

    def next_logits(self) -> torch.Tensor:
        """[vocab] logits after the prompt (valid until the first score)."""
        if self._next is None:
            raise ValueError("no prompt logits")
        return self._next

    def _drop_tentative(self) -> None:
        extra = self.cache.get_seq_length() - len(self.ids)
        if extra:
            self.cache.crop(-extra)

    @torch.inference_mode()
    def score(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        if len(tokens) != len(parents):
            raise ValueError("tokens and parents differ in length")
        self._drop_tentative()
        self._next = None
        depth = tree_depths(parents)
        n, past = len(tokens), len(self.ids)
        device = self.model.device
        seen = torch.eye(n, dtype=torch.bool)
        for i, par in enumerate(parents):
            if par >= 0:
                seen[i] |= seen[par]
        allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), seen], dim=1).to(device)
        mask = torch.zeros(1, 1, n, past + n, dtype=self.model.dtype, device=device)
        mask = mask.masked_fill(~allowed, torch.finfo(self.model.dtype).min)
        out = self.model(
            input_ids=torch.tensor([list(tokens)], device=device),
            attention_mask=mask,
            position_ids=torch.tensor([[past + d for d in depth]], device=device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self._tree = (list(map(int, tokens)), list(parents))
        return out.logits[0].float()

    def commit(self, nodes: Sequence[int]) -> None:
        if self._tree is None:
            if nodes:
                raise ValueError("commit() without a scored tree")
            return
        tokens, parents = self._tree
        check_path(parents, nodes)
        past = len(self.ids)
        keep = torch.tensor([past + n for n in nodes], dtype=torch.long, device=self.model.device)
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[..., :past, :], layer.keys.index_select(-2, keep)], dim=-2)
            layer.values = torch.cat([layer.values[..., :past, :], layer.values.index_select(-2, keep)], dim=-2)
        self.ids.extend(tokens[n] for n in nodes)
        self._tree = None

    def committed_tokens(self) -> int:
        return len(self.ids)
