"""Which cache slots each new token attends to, and attention computed token by token (verification, and the
context's prefill with int8/int4 weights): by one SDPA call a token here, or in one call a layer by the runtime's
kernel where the model's linears run on the runtime's kernels (`KernelKeys`, cpu_kernels/attention.cpp).

Why token by token: torch's CPU SDPA kernel rounds differently with a call's shape (the other queries in the
call, the masked keys), so one masked forward over k draft tokens gave logits up to 0.6 away from k one-token
decode steps in bf16 activations, enough to flip greedy near-ties. Each token attending in the very call a
one-token step makes at its place (its query rows over exactly the keys it sees) removes that difference; with
row-independent matmuls around it (the int8/int4 weight-only kernels) a verified draft gets bitwise the
logits of plain decoding, and greedy speculative decoding stays token-identical (tests/test_smollm2.py). bf16
and fp32 `F.linear` are not row-independent, so there the logits agree only to rounding. The engine prefills a
context the same way on the CPU with int8/int4 weights (`LMEngine.by_token`): the pieces a streamed context is
prefilled in depend on timing, and with one SDPA call per piece so did the answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class TokenKeys:
    """Per new token, the cache slots it sees: an int L when that is the prefix [0, L), else their indices;
    `size`: the window [0, size) they all lie in."""

    seen: list[int | Tensor]
    size: int


@dataclass(frozen=True)
class KernelKeys:
    """The mask [n, S] of a cached forward whose attention runs on the runtime's kernel (`cpu_kernels.attend`),
    which computes each token alone from the slots its row lets it see: the exactness of `attention_by_token` in
    one call a layer (a model whose linears run on the runtime's kernels: `Transformer.kernel_attention`)."""

    mask: Tensor


# Which cache slots the new tokens see: a boolean mask [n, S]; S for all of [0, S); per token (`token_keys`); or
# the mask for the kernel (`KernelKeys`)
Mask = Tensor | int | TokenKeys | KernelKeys


def token_keys(mask: Tensor) -> TokenKeys:
    """`TokenKeys` of a mask [n, S]: one host synchronisation for the whole forward, used by every layer."""
    lengths = mask.sum(-1)
    slots = torch.arange(mask.shape[-1], device=mask.device)
    prefix = (mask == (slots[None, :] < lengths[:, None])).all(-1)
    seen = [int(length) if is_prefix else row.nonzero().squeeze(1)
            for length, is_prefix, row in zip(lengths.tolist(), prefix.tolist(), mask, strict=True)]
    return TokenKeys(seen, mask.shape[-1])


def attention_by_token(q: Tensor, k: Tensor, v: Tensor, keys: TokenKeys, scale: float) -> Tensor:
    """Each new token's attention as a one-token decode step computes it: its query rows over exactly the keys
    it sees, in slot order, in one SDPA call of the same shape (the module's docstring says why). q [kv, group
    * n, d] (token i's rows are i, i + n, ...), k/v [kv, S, d]."""
    n = len(keys.seen)
    out = torch.empty_like(q)
    for i, seen in enumerate(keys.seen):
        ks, vs = (k.narrow(1, 0, seen), v.narrow(1, 0, seen)) if isinstance(seen, int) else (
            k.index_select(1, seen), v.index_select(1, seen))
        out[:, i::n] = F.scaled_dot_product_attention(q[None, :, i::n], ks[None], vs[None], scale=scale)[0]
    return out


