"""What a voice is to the rest of the runtime: text in, mono PCM out at the voice's own sample rate.

A protocol rather than a base class so that a test can stand in a voice that is a few lines of numpy, and a
second engine (another ONNX voice, a remote one) needs no common ancestor. Samples stay at the voice's native
rate (Piper's medium voices: 22,050 Hz); what a client hears is resampled once, at the edge
(`output_audio.py`), so a wav written to disk keeps the voice's own quality.

`speed` is the API's `audio.output.speed`: 1.0 is the voice's trained pace, 0.25 to 1.5 the range OpenAI's
Realtime API accepts (a voice maps it onto its own duration control: VITS's length scale is divided by it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 1.5  # the Realtime API's range for audio.output.speed


def check_speed(speed: float) -> float:
    """`speed` as a float; ValueError (one line) outside the API's range."""
    speed = float(speed)
    if not MIN_SPEED <= speed <= MAX_SPEED:  # also refuses nan
        raise ValueError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
    return speed


def to_int16(samples: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> 16-bit PCM (what a wav file and `audio/pcm` carry), rounded, clipped rather than
    wrapped."""
    return np.clip(np.round(np.asarray(samples, dtype=np.float32) * 32767.0), -32768, 32767).astype(np.int16)


@dataclass(frozen=True)
class Speech:
    """Mono audio a voice made: float32 in [-1, 1] at `sample_rate` Hz."""

    samples: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate

    def int16(self) -> np.ndarray:
        return to_int16(self.samples)


@runtime_checkable
class Voice(Protocol):
    """A loaded voice. `synthesize` is model compute: run it on the device worker, never on the event loop."""

    name: str  # the reference it was loaded from, e.g. builtin:piper-en-us-joe-medium
    sample_rate: int  # of every Speech it returns

    def synthesize(self, text: str, speed: float = 1.0) -> Speech:
        """`text` spoken at `speed` (see `check_speed`); empty or unspeakable text gives zero samples."""
        ...
