"""What a stream's next item starts from: the text of the turns before and the user's vocabulary (`Context`),
and across a reset (the encoder holds at most 30 s) where the new segment restarts and which stable tokens
it carries as previous text or as a forced prefix (`Carry`, `plan_reset`; stream.py says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.models.asr.causal_whisper.emission import Token

RESTART_MARGIN_S = 0.5  # re-feed from this long before the last stable token's emission
MAX_OVERLAP_S = 5.0  # ... but never more than this (nor half the segment) before the reset point
CARRY_TOKENS = 64  # stable tokens carried across a reset as prompt / forced prefix


@dataclass(frozen=True)
class Context:
    """A stream's previous text as tokens (`CausalWhisperASR.context`): the user's vocabulary, kept whole, and the
    text of the turns before, of which the most recent tokens are kept."""

    vocabulary: list[int]
    recent: list[int]


@dataclass(frozen=True)
class Carry:
    """What crosses a reset: where the new segment starts and the decoder context of its item."""

    restart_frame: int  # absolute encoder frame where the new encoder starts
    previous: list[int]  # prompt text (emitted before restart)
    forced: list[int]  # forced transcript prefix (emitted after restart: may describe re-fed audio)


def plan_reset(history: Sequence[Token], reset_frame: int, segment_start: int, *, margin: int,
               max_overlap: int) -> Carry:
    """Where to restart and what to carry; `history` = the carried stable tokens so far (oldest first),
    frames absolute. The restart lies in [reset - overlap, reset] with overlap <= half the segment, so
    every reset advances the audio by at least half a segment."""
    overlap = min(max_overlap, (reset_frame - segment_start) // 2)
    anchor = history[-1].frame if history else segment_start
    restart = min(reset_frame, max(reset_frame - overlap, anchor - margin))
    first = next((i for i, t in enumerate(history) if t.frame > restart), len(history))
    return Carry(restart, [t.id for t in history[:first]], [t.id for t in history[first:]])
