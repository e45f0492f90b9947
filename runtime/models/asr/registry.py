"""`asr.backend` -> a loaded `StreamingASR`. The registry sits above the backends it registers (they import only
`base.py`), and each backend is imported when chosen: it pulls its own model code.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.base import StreamingASR

BACKENDS = ("whisper-buffered", "causal-whisper", "fastconformer")


def load_asr(cfg: ASRConfig, *, device: str, dtype: str, progress: Callable[[str], None] | None = None) -> StreamingASR:
    """Load the backend named by `cfg.backend`."""
    if cfg.backend == "whisper-buffered":
        from runtime.models.asr.whisper_buffered import WhisperBuffered

        return WhisperBuffered.load(cfg, device=device, dtype=dtype, progress=progress)
    if cfg.backend == "causal-whisper":
        from runtime.models.asr.causal_whisper.asr import CausalWhisperASR

        return CausalWhisperASR.load(cfg, device=device, dtype=dtype, progress=progress)
    if cfg.backend == "fastconformer":
        from runtime.models.asr.fastconformer.asr import FastConformerASR

        return FastConformerASR.load(cfg, device=device, dtype=dtype, progress=progress)
    raise ConfigError(f"unknown asr.backend {cfg.backend!r} (known: {', '.join(BACKENDS)})")
