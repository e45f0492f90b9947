"""Streaming ASR: the `StreamingASR`/`ASRStream` interface and its backends, chosen by `asr.backend`."""

from runtime.models.asr.base import ASRStream, StreamingASR, TranscriptUpdate, load_asr

__all__ = ["ASRStream", "StreamingASR", "TranscriptUpdate", "load_asr"]
