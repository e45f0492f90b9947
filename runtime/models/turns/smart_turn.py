"""Smart Turn v3.2 (builtin:smart-turn-v3.2, Daily, BSD-2-Clause): has the speaker finished their turn?

It listens to how the speech ends (intonation, a trailing "and...", a word cut off), not to the words, which
is what `semantic_vad` needs: a pause after a complete sentence ends the turn early, a pause mid-thought does
not. The model takes exactly the last 8 s of 16 kHz audio as a Whisper log-mel (80 bins, 800 frames), the
shorter inputs zero-padded at the start so the end of the speech always sits at the end of the window, where
the model was trained to look. The log-mel is transformers' `WhisperFeatureExtractor`, the extractor the model
was trained with, so our features are its features.

One call costs an encoder pass over the full 8 s whatever the audio's length: about 10 ms on a fast CPU by the
authors' figures, 29 ms on one thread of our 2-core CI machine (27 ms the model, 1.3 ms the log-mel), against
0.07 ms for a Silero window. So it is asked at pauses only, never per window.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from transformers import WhisperFeatureExtractor

from runtime.chunks import SAMPLE_RATE
from runtime.models.packaged import PACKAGED, packaged_checkpoint

WINDOW_SECONDS = 8
WINDOW_SAMPLES_8S = WINDOW_SECONDS * SAMPLE_RATE


def last_8s(audio: np.ndarray) -> np.ndarray:
    """The last 8 s, zero-padded at the start when shorter: the model expects the speech to end at the end."""
    audio = audio[-WINDOW_SAMPLES_8S:]
    return np.pad(audio, (WINDOW_SAMPLES_8S - len(audio), 0))


class SmartTurn:
    """The loaded model; stateless, so one instance serves every session."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session
        self._features = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE,
                                                 chunk_length=WINDOW_SECONDS)

    @classmethod
    def load(cls, threads: int = 1) -> SmartTurn:
        """From the pinned, hash-checked package; CheckpointNotFound (one line) names the install command.
        One thread by default: the call is short and the device worker's cores are shared."""
        folder = packaged_checkpoint("smart-turn-v3.2")
        assert folder is not None  # the entry exists
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session = ort.InferenceSession(str(folder / PACKAGED["smart-turn-v3.2"].weight_file),
                                       sess_options=options, providers=["CPUExecutionProvider"])
        return cls(session)

    def features(self, audio: np.ndarray) -> np.ndarray:
        """The model's input, [1, 80, 800] float32, for the last 8 s of `audio`."""
        audio = np.asarray(audio)
        if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
            raise ValueError(f"audio must be 1-D float mono at {SAMPLE_RATE} Hz, got {audio.dtype} {audio.shape}")
        window = last_8s(audio.astype(np.float32, copy=False))
        # Normalised over the whole padded window (zeros included), as in training.
        out = self._features(window, sampling_rate=SAMPLE_RATE, padding="max_length",
                             max_length=WINDOW_SAMPLES_8S, truncation=True, do_normalize=True,
                             return_attention_mask=False, return_tensors="np")
        return np.asarray(out["input_features"], dtype=np.float32)

    def end_of_turn_probability(self, audio: np.ndarray) -> float:
        """How likely the speaker has finished, given the audio so far (float32 16 kHz mono, any length)."""
        (logit,) = self._session.run(None, {"input_features": self.features(audio)})
        return float(logit.reshape(-1)[0])  # the graph ends in a sigmoid despite the output's name "logits"
