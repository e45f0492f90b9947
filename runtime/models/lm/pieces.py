"""What a source suffix is made of: text, and `Visual` pieces (input embeddings that stand in for tokens).

Kept apart from the engine so that the backend seam (`backend.py`) and the video-memory prompt can name a
suffix without importing the engine that prefills it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Visual:
    """Input embeddings [n, hidden] standing in for n tokens (a VLM's visual tokens). `key` names this exact
    content: equal keys promise equal embeddings, so the engine keeps their KV instead of recomputing it."""

    key: int
    embeds: torch.Tensor = field(compare=False)


Piece = str | Visual  # what a source suffix is made of


def visual_id(key: int, row: int) -> int:
    """The negative stand-in id of row `row` of the visual piece `key` (token ids are never negative)."""
    return -((key << 16) + row) - 1
