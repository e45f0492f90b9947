"""Video memory as engine input: blocks become a suffix of text labels (media times) and visual pieces.

The order is the memory's own (most stable first), so a new frame changes the end of the suffix and the engine
keeps the KV of everything before it. Each block carries its content key, so an unchanged block is never
prefilled twice. A question and a segment note become a vector in the same embedding space as the visual
tokens (the mean of their input embeddings), which is what question-aware selection scores segments with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from runtime.memory.video import MemoryBlock
from runtime.models.lm.engine import LMEngine, Piece, Visual

HEADINGS = {
    "temporal": "\nEarlier (consolidated):",
    "abstract": "\nOverview:",
    "retrieved": "\nMoments:",
    "spatial": "\nNow:",
}


def stamp(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def span(block: MemoryBlock) -> str:
    if block.kind == "abstract":
        return ""
    if block.end - block.start < 0.5:
        return f" [{stamp(block.start)}]"
    return f" [{stamp(block.start)}-{stamp(block.end)}]"


def memory_pieces(blocks: Sequence[MemoryBlock]) -> list[Piece]:
    """The engine suffix for `blocks` (empty when the memory has seen no frame yet)."""
    if not blocks:
        return []
    pieces: list[Piece] = ["\n\nVideo memory (times are m:ss of the stream):"]
    kind = None
    for block in blocks:
        if block.kind != kind:
            kind = block.kind
            pieces.append(HEADINGS.get(kind, f"\n{kind}:"))
        if label := span(block):
            pieces.append(label)
        pieces.append(Visual(block.key, block.embeds))
    return pieces


@torch.inference_mode()
def text_embedding(engine: LMEngine, text: str) -> Tensor | None:
    """Mean input embedding [hidden] of `text`'s tokens (float32), or None for text without tokens."""
    ids = engine.encode(text)
    if not ids:
        return None
    table = engine.model.model.embed_tokens
    return table(torch.tensor(ids, dtype=torch.long, device=engine.model.device)).float().mean(0)
