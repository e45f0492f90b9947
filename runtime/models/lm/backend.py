"""TEMPORARY (replaced by the lm redesign branch)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from runtime.models.lm.pieces import Piece


class LMStream(Protocol):
    def set_context(self, text: str, suffix: Sequence[Piece] | None = None) -> None: ...

    def prefill_step(self) -> int: ...
