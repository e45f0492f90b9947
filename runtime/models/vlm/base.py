"""The seam between the video path and a vision model: frames in, memory features out, on the device worker.

`llava_onevision.VisionEncoder` is the implementation; tests and benchmarks may bring their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class FrameEncoder(Protocol):
    """Encodes RGB uint8 frames [H, W, 3] into memory features [n, grid * grid, dim] of `dtype`."""

    dim: int
    dtype: torch.dtype

    def encode(self, images: Sequence[np.ndarray]) -> torch.Tensor: ...
