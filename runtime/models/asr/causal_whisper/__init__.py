"""Causal streaming Whisper after CarelessWhisper (design.md §3): a block-causal encoder with cached K/V fed
chunk by chunk, a streaming decoder policy that re-checks its last tokens each chunk, and LoRA adapters that
teach an offline Whisper to read block-causal encoder states.

- `features`: a causal log-mel front end (`StreamingLogMel`, `log_mel`) whose chunked output equals its
  offline output exactly, so a model trained offline sees in streaming exactly what it was trained on.
- `encoder`: `CausalWhisperEncoder` (offline `forward_full` with the block-causal mask, for training and
  reference) and its exact incremental `MelEncoderStream` / `AudioEncoderStream`.
- `decoder`, `asr`, `stream`, `carry`, `lora`: the decoder side, the `StreamingASR` backend (the model and its
  emission rule), a session's stream (resets, previews, the turns before, the final pass), what crosses a reset,
  and the adapters.
"""
