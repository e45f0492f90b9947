"""The tensor math of Flash-VStream's STAR memory, kept apart from the bookkeeping in `video.py`.

These functions are pure (no state, no in-place writes to their inputs), so the video memory can build new
tensors for every write and publish them to readers without copying: nothing here ever touches a tensor a
published snapshot might hold. They compute in float32 whatever the storage dtype, because k-means distances
and the attention softmax lose too much in bfloat16 to stay deterministic and stable over 10^4 updates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


def pool_grid(tokens: Tensor, grid: int, out_grid: int) -> Tensor:
    """Average-pool `[..., grid*grid, dim]` frame tokens to `[..., out_grid*out_grid, dim]`.

    Pooling on the 2-D grid (not the flat token list) keeps each pooled token a spatial neighbourhood, which is
    what lets a 4x4 temporal slot still say *where* something was.
    """
    if out_grid < 1 or grid % out_grid:
        raise ValueError(f"grid {grid} is not a multiple of out_grid {out_grid}")
    *lead, count, dim = tokens.shape
    if count != grid * grid:
        raise ValueError(f"expected {grid * grid} tokens per frame, got {count}")
    if out_grid == grid:
        return tokens
    x = tokens.reshape(-1, grid, grid, dim).permute(0, 3, 1, 2)
    y = F.avg_pool2d(x, grid // out_grid)
    return y.permute(0, 2, 3, 1).reshape(*lead, out_grid * out_grid, dim)


def sq_distances(points: Tensor, centroids: Tensor) -> Tensor:
    """Squared L2 distances `[n, k]` in float32.

    The expanded form costs one matmul and no `[n, k, d]` temporary: with d = 16 tokens x 3584 channels a
    broadcast difference would need gigabytes.
    """
    p, c = points.float(), centroids.float()
    d = (p * p).sum(1, keepdim=True) - 2.0 * (p @ c.T) + (c * c).sum(1)[None, :]
    return d.clamp_min(0.0)


def kmeans_pp(points: Tensor, weights: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """Indices of `k` distinct initial centres, weighted k-means++ (probability ~ weight x D^2).

    Sampling runs on the CPU with a CPU generator, so a seed picks the same centres on every device.
    """
    n = points.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k-means++ needs 1 <= k <= n, got k={k}, n={n}")
    w = weights.detach().to("cpu", torch.float64).clamp_min(0.0)
    taken = torch.zeros(n, dtype=torch.bool)
    d2 = torch.full((n,), float("inf"), dtype=torch.float64)
    chosen: list[int] = []
    for _ in range(k):
        p = w * d2 if chosen else w.clone()
        p[taken] = 0.0
        if not float(p.sum()) > 0.0:  # no mass left (duplicates, zero weights): a point unlike every chosen one,
            p = (~taken & (d2 > 0.0)).double()  # even of zero weight (a duplicate seeds a cluster sure to stay empty)
            if not float(p.sum()) > 0.0:  # only duplicates of chosen points are left: any unused one
                p = (~taken).double()
        i = int(torch.multinomial(p, 1, generator=generator))
        chosen.append(i)
        taken[i] = True
        d2 = torch.minimum(d2, sq_distances(points, points[i : i + 1]).squeeze(1).to("cpu", torch.float64))
    return torch.tensor(chosen, dtype=torch.long, device=points.device)


def _weighted_means(x: Tensor, w: Tensor, assign: Tensor, fallback: Tensor) -> Tensor:
    # One-hot matmul rather than index_add_: index_add_ uses atomics on CUDA, which would make the result
    # depend on thread timing and break "same seed, same memory".
    m = F.one_hot(assign, fallback.shape[0]).T.to(x.dtype) * w[None, :]
    total = m.sum(1)
    means = (m @ x) / total.clamp_min(torch.finfo(x.dtype).tiny)[:, None]
    return torch.where((total > 0)[:, None], means, fallback)


class KMeansResult(NamedTuple):
    centroids: Tensor  # [k, d] float32
    assign: Tensor  # [n] cluster of each point
    init: Tensor  # [k] index of the point each cluster was seeded from (an empty cluster sits there)


def weighted_kmeans(
    points: Tensor, weights: Tensor, k: int, *, iters: int = 10, generator: torch.Generator | None = None
) -> KMeansResult:
    """Cluster `points [n, d]` with per-point `weights [n]` into `k` clusters.

    Weights are what make repeated consolidation sound: a slot that already stands for 40 frames must pull
    its centroid 40 times as hard as one new frame, or old memories would drift toward every newcomer.
    Centroids returned are the weighted means of the final assignment, so they agree with `assign`; a cluster
    left empty keeps its initial centre, as Flash-VStream does.
    """
    if points.ndim != 2 or weights.shape != points.shape[:1]:
        raise ValueError(f"points must be [n, d] and weights [n], got {tuple(points.shape)}, {tuple(weights.shape)}")
    x = points.float()
    w = weights.to(device=x.device, dtype=torch.float32)
    init = kmeans_pp(x, w, k, generator)
    start = x[init]
    centroids = start
    assign: Tensor | None = None
    for _ in range(iters):
        new = sq_distances(x, centroids).argmin(1)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        centroids = _weighted_means(x, w, assign, start)
    assign = sq_distances(x, centroids).argmin(1)
    return KMeansResult(_weighted_means(x, w, assign, start), assign, init)


def abstract_init(tokens: Tensor, count: int) -> Tensor:
    """`count` abstract tokens from one frame's `[tokens, dim]`: adaptive average pooling over the tokens.

    Starting from the first frame (not zeros or noise) puts the memory in the feature distribution at once,
    so the attention update below has meaningful similarities from its first step.
    """
    return F.adaptive_avg_pool1d(tokens.float().T.unsqueeze(0), count).squeeze(0).T.contiguous()


def abstract_update(memory: Tensor, frames: Tensor, ratio: float) -> Tensor:
    """Fold `frames [m, tokens, dim]` into `memory [count, dim]`, one frame at a time, in order.

    A <- (1 - r) A + r softmax(A F^T / sqrt(dim)) F. Each abstract token reads what in the new frame resembles
    it, so the memory keeps a slowly moving summary of recurring content instead of a running average of all
    pixels. The loop over frames is the recurrence itself; each step is batched over tokens and channels.
    """
    a = memory.float()
    scale = a.shape[-1] ** -0.5
    for f in frames.float():
        attn = torch.softmax((a @ f.T) * scale, dim=-1)
        a = (1.0 - ratio) * a + ratio * (attn @ f)
    return a
