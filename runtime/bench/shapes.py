"""Real architectures' configs for shape-true benchmarks (random weights, real compute).

Numbers are the published configs of the checkpoints named; `--quick` swaps in small shapes of the same
families so CI-sized machines finish in about a minute.
"""

from __future__ import annotations

from typing import Any

from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig, WhisperConfig

WHISPER_SHAPES: dict[str, dict[str, Any]] = {
    "whisper-base": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                         decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                         num_mel_bins=80, vocab_size=51865),
    "whisper-large-v3": dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                             decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
                             num_mel_bins=128, vocab_size=51866),
    # --quick: the whisper-base family shrunk (same layer types, 30 s positional table).
    "whisper-quick": dict(d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                          num_mel_bins=80, vocab_size=51865),
}


def whisper_config(name: str) -> WhisperConfig:
    shape = WHISPER_SHAPES[name]
    return WhisperConfig(max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50258,
                         pad_token_id=50257, bos_token_id=50257, eos_token_id=50257, **shape)


QWEN2_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    # --quick: the Qwen2 family shrunk (same layer types and GQA ratio class).
    "qwen2-quick": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=1024, vocab_size=32000, tie_word_embeddings=True),
}


def qwen2_config(name: str) -> Qwen2Config:
    return Qwen2Config(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
                       bos_token_id=1, eos_token_id=2, **QWEN2_SHAPES[name])


SIGLIP_SHAPES: dict[str, dict[str, Any]] = {
    # LLaVA-OneVision's tower (0.5B and 7B alike): SigLIP so400m-patch14-384 with its last layer dropped (26 of 27).
    "siglip-so400m": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
                          image_size=384, patch_size=14),
    # google/siglip-base-patch16-224: the small tower a CPU can run at the sampling rate.
    "siglip-base": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                        image_size=224, patch_size=16),
    # --quick: the SigLIP family shrunk (8x8 patches of a 64x64 input).
    "siglip-quick": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                         image_size=64, patch_size=8),
}


def siglip_config(name: str) -> SiglipVisionConfig:
    return SiglipVisionConfig(vision_use_head=False, **SIGLIP_SHAPES[name])  # LLaVA-OneVision keeps no head


def llava_onevision_config(vision: str, lm: str, *, image_token_index: int,
                           video_token_index: int) -> LlavaOnevisionConfig:
    """A LLaVA-OneVision checkpoint's config: SigLIP tower `vision`, Qwen2 `lm`, the family's 2-layer projector."""
    text = qwen2_config(lm)
    return LlavaOnevisionConfig(vision_config=siglip_config(vision).to_dict(), text_config=text.to_dict(),
                                image_token_index=image_token_index, video_token_index=video_token_index,
                                vision_feature_layer=-1, vision_feature_select_strategy="full",
                                tie_word_embeddings=text.tie_word_embeddings)
