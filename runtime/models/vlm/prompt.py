"""Video memory as engine input: blocks become a suffix of text labels (media times) and visual pieces.

The order is the memory's own (most stable first), so a new frame changes the end of the suffix and the engine
keeps the KV of everything before it. Each block carries its content key, so an unchanged block is never
prefilled twice. The label texts live with the other prompt texts (`runtime.models.lm.prompt`). A question and
a segment note become vectors in the visual tokens' embedding space through the answerer's `embed_text`.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.memory.video import MemoryBlock
from runtime.models.lm.pieces import Piece, Visual
from runtime.models.lm.prompt import HEADINGS, MEMORY_INTRO


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
    pieces: list[Piece] = [MEMORY_INTRO]
    kind = None
    for block in blocks:
        if block.kind != kind:
            kind = block.kind
            pieces.append(HEADINGS.get(kind, f"\n{kind}:"))
        if label := span(block):
            pieces.append(label)
        pieces.append(Visual(block.key, block.embeds))
    return pieces

