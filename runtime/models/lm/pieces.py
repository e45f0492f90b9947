"""TEMPORARY (replaced by the lm redesign branch)."""
from runtime.models.lm.engine import Piece, Visual  # noqa: F401
