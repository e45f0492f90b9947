"""The kernels' weight layouts, built from (and read back into) per-group tensors.

Why this layout (kernels.cpp says it byte by byte): output rows go in tiles of 16 and, within a tile, the 16 rows
of one group of 32 inputs sit side by side, 4 bytes of a row at a time, so that one vector of weights holds the
same 4 inputs (or 4 and 4 + 16 for nibbles) of 16 rows, and one broadcast word of activations multiplies them all.
A row's 4-bit bytes are GGUF's own (Q4_0/Q4_1: low nibble input i, high nibble input i + 16), moved 4 at a time.
The fp16 scales and offsets of a tile's group follow its weights, so a thread reads one stream.

Scales are fp16, as GGUF stores Q4_0, Q4_1 and Q8_0 ones. A Q4_K group's scale d * sc and offset -dmin * m are
products that fp16 rounds (relative error at most 2^-11 of the group's scale), well below the 4-bit step itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

GROUP = 32
TILE = 16
Q4_BLOCK = 320  # bytes per tile and group: 256 of nibbles, 16 fp16 scales, 16 fp16 offsets
Q8_BLOCK = 544  # 512 of int8 weights, 16 fp16 scales
ROWS_AT_ONCE = 4096  # rows packed together (a multiple of TILE): the copies of a 151,936-row vocabulary stay small


def pack_q4(q: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """Pack 4-bit weights w[n, k] = q[n, k] * scale[n, k // 32] + low[n, k // 32] (q in 0..15; q [N, K],
    scale and low [N, K / 32]) into the `q4_linear` layout: uint8 [ceil(N / 16), K / 32, 320]. Rows past N are
    zero. A GGUF Q4_0 block is scale = d, low = -8 d; Q4_1 is scale = d, low = m; a Q4_K group is
    scale = d * sc, low = -dmin * m."""
    n, k = _check(q, scale, GROUP)
    if low.shape != scale.shape:
        raise ValueError(f"low {tuple(low.shape)} must have scale's shape {tuple(scale.shape)}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("4-bit weights must lie in 0..15")
    if n > ROWS_AT_ONCE:
        return _by_rows(lambda r: pack_q4(q[r], scale[r], low[r]), n, k, Q4_BLOCK)
    tiles, groups = -(-n // TILE), k // GROUP
    qb = _pad(q.to(torch.uint8), tiles * TILE).reshape(tiles * TILE, groups, GROUP)
    nibbles = qb[..., :16] | (qb[..., 16:] << 4)  # [rows, G, 16]: GGUF's byte order within a row
    # [tiles, 16 rows, G, 4 words, 4 bytes] -> [tiles, G, 4 words, 16 rows, 4 bytes]
    body = nibbles.reshape(tiles, TILE, groups, 4, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 256)
    return torch.cat([body, _scales(scale, tiles), _scales(low, tiles)], dim=-1).contiguous()


def pack_q8(q: Tensor, scale: Tensor) -> Tensor:
    """Pack 8-bit weights w[n, k] = q[n, k] * scale[n, k // 32] (q int8 in -128..127, [N, K]; scale
    [N, K / 32]) into the `q8_linear` layout: uint8 [ceil(N / 16), K / 32, 544]. A GGUF Q8_0 block is its qs and
    d; a Q5_0 block is q - 16 (its 5-bit value) and d."""
    n, k = _check(q, scale, GROUP)
    if q.numel() and (int(q.min()) < -128 or int(q.max()) > 127):
        raise ValueError("8-bit weights must lie in -128..127")
    if n > ROWS_AT_ONCE:
        return _by_rows(lambda r: pack_q8(q[r], scale[r]), n, k, Q8_BLOCK)
    tiles, groups = -(-n // TILE), k // GROUP
    qb = _pad(q.to(torch.int8), tiles * TILE).view(torch.uint8)
    # [tiles, 16 rows, G, 8 words, 4 bytes] -> [tiles, G, 8 words, 16 rows, 4 bytes]
    body = qb.reshape(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 512)
    return torch.cat([body, _scales(scale, tiles)], dim=-1).contiguous()


def _by_rows(pack: Callable[[slice], Tensor], n: int, k: int, block: int) -> Tensor:
    """`pack` of ROWS_AT_ONCE rows at a time into one layout: tiles never straddle two calls (ROWS_AT_ONCE is a
    multiple of TILE), so the pieces are the whole's tiles in order."""
    out = torch.empty(-(-n // TILE), k // GROUP, block, dtype=torch.uint8)
    for start in range(0, n, ROWS_AT_ONCE):
        piece = pack(slice(start, start + ROWS_AT_ONCE))
        out[start // TILE : start // TILE + piece.shape[0]] = piece
    return out


def unpack_q4(packed: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """`pack_q4`'s inverse: (q int32 [n, K], scale float32 [n, K / 32], low float32 [n, K / 32])."""
    tiles, groups, size = packed.shape
    if size != Q4_BLOCK:
        raise ValueError(f"not a q4 layout: blocks of {size} bytes")
    body = packed[..., :256].reshape(tiles, groups, 4, TILE, 4).permute(0, 3, 1, 2, 4).reshape(-1, groups, 16)
    q = torch.cat([body & 0xF, body >> 4], dim=-1).reshape(tiles * TILE, groups * GROUP)[:n].to(torch.int32)
    return q, _unscales(packed[..., 256:288], n), _unscales(packed[..., 288:320], n)


def unpack_q8(packed: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """`pack_q8`'s inverse: (q int8 [n, K], scale float32 [n, K / 32])."""
    tiles, groups, size = packed.shape
    if size != Q8_BLOCK:
        raise ValueError(f"not a q8 layout: blocks of {size} bytes")
    body = packed[..., :512].contiguous().view(torch.int8).reshape(tiles, groups, 8, TILE, 4)
    q = body.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, groups * GROUP)[:n]
    return q.contiguous(), _unscales(packed[..., 512:544], n)


def dequantize(packed: Tensor, n: int) -> Tensor:
    """The float32 weight [n, K] a packed layout (q4 or q8, told by its block size) holds."""
    if packed.shape[-1] == Q4_BLOCK:
        q, scale, low = unpack_q4(packed, n)
        return (q.float().reshape(n, -1, GROUP) * scale[..., None] + low[..., None]).reshape(n, -1)
    q8, scale = unpack_q8(packed, n)
    return (q8.float().reshape(n, -1, GROUP) * scale[..., None]).reshape(n, -1)


def dequantize_rows(packed: Tensor, rows: Tensor) -> Tensor:
    """Rows `rows` (int64 [m]) of the float32 weight [N, K] a packed layout holds, reading only their tiles: an
    embedding lookup in the file's own groups. Each row is bitwise `dequantize`'s."""
    tiles = packed[rows // TILE]  # [m, G, block]: the tiles that hold the rows
    lane, m, groups = rows % TILE, tiles.shape[0], tiles.shape[1]
    pick = torch.arange(m, device=packed.device)
    if packed.shape[-1] == Q4_BLOCK:
        body = tiles[..., :256].reshape(m, groups, 4, TILE, 4)[pick, :, :, lane].reshape(m, groups, 16)
        q = torch.cat([body & 0xF, body >> 4], dim=-1).to(torch.int32)
        scale, low = (tiles[..., at : at + 32].contiguous().view(torch.float16)[pick, :, lane].float()
                      for at in (256, 288))
        return (q.float() * scale[..., None] + low[..., None]).reshape(m, -1)
    if packed.shape[-1] != Q8_BLOCK:
        raise ValueError(f"not a q4 or q8 layout: blocks of {packed.shape[-1]} bytes")
    q8 = tiles[..., :512].contiguous().view(torch.int8).reshape(m, groups, 8, TILE, 4)[pick, :, :, lane]
    scale = tiles[..., 512:544].contiguous().view(torch.float16)[pick, :, lane].float()
    return (q8.reshape(m, groups, GROUP).float() * scale[..., None]).reshape(m, -1)


def _check(q: Tensor, scale: Tensor, group: int) -> tuple[int, int]:
    if q.dim() != 2 or q.shape[1] % group or q.shape[0] == 0:
        raise ValueError(f"weights must be [N, K] with K a multiple of {group}, got {tuple(q.shape)}")
    n, k = q.shape
    if scale.shape != (n, k // group):
        raise ValueError(f"scale must be [{n}, {k // group}], got {tuple(scale.shape)}")
    return n, k


def _pad(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _scales(values: Tensor, tiles: int) -> Tensor:
    """fp16 values [N, G] as the 32 bytes per tile and group of the layout: [tiles, G, 32]."""
    h = _pad(values.to(torch.float16), tiles * TILE)
    return h.reshape(tiles, TILE, -1).transpose(1, 2).contiguous().view(torch.uint8)


def _unscales(raw: Tensor, n: int) -> Tensor:
    tiles, groups, _ = raw.shape
    return raw.contiguous().view(torch.float16).transpose(1, 2).reshape(tiles * TILE, groups)[:n].float()
