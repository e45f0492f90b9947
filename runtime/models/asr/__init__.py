"""Streaming ASR: the `StreamingASR`/`ASRStream` seam (`base.py`) and its backends, chosen by `asr.backend`
through `registry.load_asr` (not imported here: the backends import this package's `base`).
"""

from runtime.models.asr.base import ASRStream, StreamingASR, TranscriptUpdate

__all__ = ["ASRStream", "StreamingASR", "TranscriptUpdate"]
