"""Silero VAD (builtin:silero-vad, MIT): the speech probability of each 32 ms of 16 kHz audio.

The model is recurrent and scores fixed 512-sample windows, each seen with the 64 samples before it, so a stream
keeps three things between calls: the recurrent state, that context and the samples of a window not yet
complete. Keeping the leftovers (rather than padding each call's tail) is what makes the probabilities depend
on the audio only, never on how the transport happened to cut it.

One loaded `SileroVAD` (one ONNX session, safe to run from several threads) serves any number of streams;
all per-stream state lives in `VADStream`. One window costs about 0.07 ms on one thread of our 2-core CI
machine (about 0.2% of real time), so one intra-op thread is plenty and nothing needs batching.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.chunks import SAMPLE_RATE
from runtime.models.packaged import PACKAGED, packaged_checkpoint

WINDOW_SAMPLES = 512  # what the model scores at 16 kHz (32 ms)
CONTEXT_SAMPLES = 64  # the previous window's tail, prepended to each window as the model was trained
_STATE_SHAPE = (2, 1, 128)


class VADStream:
    """One audio stream's recurrent state; window i covers samples [i*512, (i+1)*512) of what was accepted."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session
        self._state = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self._context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self.windows_done = 0

    def accept(self, samples: np.ndarray) -> np.ndarray:
        """The speech probability of each window this call completes (float32, possibly empty); the index of
        the first one is `windows_done` as it was before the call."""
        samples = np.asarray(samples)
        if samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
            raise ValueError(f"audio must be 1-D float mono at {SAMPLE_RATE} Hz, got {samples.dtype} "
                             f"{samples.shape}")
        audio = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        count = len(audio) // WINDOW_SAMPLES
        probs = np.empty(count, dtype=np.float32)
        for k in range(count):
            window = audio[k * WINDOW_SAMPLES:(k + 1) * WINDOW_SAMPLES]
            model_input = np.concatenate([self._context, window])[None, :]
            prob, self._state = self._session.run(None, {"input": model_input, "state": self._state,
                                                         "sr": self._sr})
            probs[k] = prob[0, 0]
            self._context = window[-CONTEXT_SAMPLES:]
        self._pending = audio[count * WINDOW_SAMPLES:].copy()  # the copy lets the caller's buffer go
        self.windows_done += count
        return probs

    @property
    def pending_samples(self) -> int:
        """Samples held for the next window (fewer than WINDOW_SAMPLES)."""
        return len(self._pending)


class SileroVAD:
    """The loaded model, shared by streams."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session

    @classmethod
    def load(cls) -> SileroVAD:
        """From the pinned, hash-checked package; CheckpointNotFound (one line) names the install command."""
        folder = packaged_checkpoint("silero-vad")
        assert folder is not None  # the entry exists
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # a window is tiny: more threads only add synchronisation
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(folder / PACKAGED["silero-vad"].weight_file), sess_options=options,
                                       providers=["CPUExecutionProvider"])
        return cls(session)

    def open_stream(self) -> VADStream:
        return VADStream(self._session)
