"""Cache-aware streaming FastConformer-CTC (NeMo's "Stateful Conformer with Cache-based Inference"), no NeMo.

features.py (NeMo's log-mel, exactly incremental), model.py (the network under NeMo's parameter names and its
offline forward), cache_aware_encoder.py (caches; chunk-by-chunk encoder equal to the offline forward), tokenizer.py
(SentencePiece pieces via `tokenizers`), nemo.py (`.nemo` archives in and out), asr.py (`FastConformerASR`,
the `StreamingASR` backend), tiny.py (random tiny and 114M-shape models).
"""

from runtime.models.asr.fastconformer.asr import FastConformerASR, FastConformerStream
from runtime.models.asr.fastconformer.cache_aware_encoder import CacheAwareEncoderStream
from runtime.models.asr.fastconformer.model import FastConformerConfig, FastConformerCTC
from runtime.models.asr.fastconformer.nemo import load_nemo, save_nemo
from runtime.models.asr.fastconformer.tiny import (
    build_fastconformer,
    build_tiny_fastconformer,
    fastconformer_114m_config,
)

__all__ = [
    "CacheAwareEncoderStream",
    "FastConformerASR",
    "FastConformerCTC",
    "FastConformerConfig",
    "FastConformerStream",
    "build_fastconformer",
    "build_tiny_fastconformer",
    "fastconformer_114m_config",
    "load_nemo",
    "save_nemo",
]
