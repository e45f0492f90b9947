"""Turn-detection models: Silero VAD (`silero_vad.py`) for `server_vad`, Smart Turn (`smart_turn.py`) for the
end-of-turn check of `semantic_vad`. The rule that turns their outputs into speech started/stopped events is
model-free and lives in `runtime/pipeline/turn_detector.py`.
"""
