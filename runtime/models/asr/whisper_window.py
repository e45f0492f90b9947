"""Whisper's encoder over less than its 30 s window (`asr.final_pass_window_s`), for the `offline` final pass.

Why: the final pass decodes each turn once more with full context. Whisper's encoder reads 30 s (1500 frames)
however short the turn: most of a turn's pass is encoding padding (0.13 s of encoder on 2 cores in bfloat16, a
3 s turn or a 30 s one). Encoding only the turn's audio, padded to the next multiple of `window_s`, costs in
proportion (whisper.cpp's `audio_ctx`).

But Whisper was trained on 30 s windows, and its decoder learned where speech ends from the padding it sees
after it: given only the window, tiny.en loops ("1, 2, 3, 1, 2, 3, ..." for "One, two, three." in a 5 s window;
measured on the quick sets, docs/model_card_causal_whisper.md). So the frames past the window are the encoder's
states of silence at those positions, encoded once when the encoder is set up (a log-mel of digital silence:
Whisper's floor, `SILENCE_MEL`): the decoder reads 1500 frames as always, and only the window is encoded per turn.
The states come with the number of frames encoded from the audio (`Encoded`), so the decoder can project the
silence's cross-attention keys and values once as well (`WhisperBuffered.cache`).
Those tail states are not what the padded turn itself would give (there each padding frame also attends to the
speech), so the transcript may differ from the 30 s one; `runtime bench asr-quality` measures by how much.

`encoder_states` is `WhisperEncoder.forward` on any number of frames (transformers refuses anything but 3000 mel
frames): the same modules in the same order, with the first `frames` positional embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import WhisperFeatureExtractor
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError

WINDOW_S = 30.0  # Whisper's own window
FRAMES_PER_S = 50  # one encoder frame per 20 ms (two 10 ms mel hops)
# Whisper's normalised log-mel of digital silence: log10 of its 1e-10 floor, (-10 + 4) / 4 (a silent clip's
# every frame, and the value the dynamic-range clamp never lifts, as nothing louder is in the window)
SILENCE_MEL = -1.5


def window_frames(window_s: float) -> int:
    """Encoder frames in one window of `window_s` seconds (a multiple of 20 ms, at most 30 s)."""
    frames = round(window_s * FRAMES_PER_S)
    if not 0 < window_s <= WINDOW_S or abs(frames - window_s * FRAMES_PER_S) > 1e-6:
        raise ConfigError(f"asr.final_pass_window_s must be a multiple of 0.02 s in (0, {WINDOW_S:g}], got "
                          f"{window_s:g}")
    return frames


def encoder_frames(samples: int, window_s: float) -> int:
    """Encoder frames encoded for `samples` of audio: the audio padded to the next multiple of `window_s`
    seconds, at most 30 s (1500 frames; longer audio is cut there, as Whisper cuts it)."""
    step = window_frames(window_s)
    limit = round(WINDOW_S * FRAMES_PER_S)
    needed = -(-samples * FRAMES_PER_S // SAMPLE_RATE)  # ceil: every sample inside the window
    return min(limit, max(1, -(-needed // step)) * step)


def encoder_states(encoder: WhisperEncoder, features: torch.Tensor) -> torch.Tensor:
    """`WhisperEncoder.forward` (eval mode) over mel features [1, n_mels, 2 * frames], frames <= 1500."""
    x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(features)))).permute(0, 2, 1)
    if x.shape[1] > encoder.embed_positions.num_embeddings:
        raise ValueError(f"{x.shape[1]} encoder frames exceed the {encoder.embed_positions.num_embeddings} positions")
    h = x + encoder.embed_positions.weight[: x.shape[1]]
    for layer in encoder.layers:
        h = layer(h, None)
    return encoder.layer_norm(h)


@dataclass(frozen=True, eq=False)
class Encoded:
    """Encoder states [1, 1500, d] of some audio: the first `frames` encoded from it, silence's states after them (all
    1500 from the audio when `frames` is 1500). The decoder reads all 1500 as always, but the cross-attention keys and
    values of silence's frames need computing only once (`WhisperBuffered`)."""

    states: torch.Tensor
    frames: int


class WindowedEncoder:
    """Audio -> encoder states [1, 1500, d]: the audio's windows encoded, silence's states after them."""

    def __init__(self, encoder: WhisperEncoder, feature_extractor: WhisperFeatureExtractor,
                 window_s: float = WINDOW_S) -> None:
        """At `window_s` < 30 the silence's states are encoded here, once (one 30 s encoder pass)."""
        self.encoder, self.feature_extractor, self.window_s = encoder, feature_extractor, window_s
        self.frames = round(WINDOW_S * FRAMES_PER_S)
        self.silence: torch.Tensor | None = None
        if window_frames(window_s) < self.frames:
            with torch.inference_mode():
                mel = torch.full((1, encoder.config.num_mel_bins, 2 * self.frames), SILENCE_MEL)
                self.silence = encoder_states(encoder, self._on_device(mel))

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.encoder.conv1.weight.device, self.encoder.conv1.weight.dtype)

    def features(self, audio: np.ndarray, frames: int) -> torch.Tensor:
        """Whisper's log-mel [1, n_mels, 2 * frames] of `audio` padded to `frames`: the first 2 * frames of the
        30 s one (the padding is zeros either way, and the floor follows the loudest frame, in the audio)."""
        samples = frames * SAMPLE_RATE // FRAMES_PER_S
        return self.feature_extractor(audio[:samples], sampling_rate=SAMPLE_RATE, return_tensors="pt",
                                      max_length=samples).input_features

    @torch.inference_mode()
    def __call__(self, audio: np.ndarray) -> Encoded:
        frames = encoder_frames(len(audio), self.window_s)
        states = encoder_states(self.encoder, self._on_device(self.features(audio, frames)))
        if self.silence is None or frames == self.frames:
            return Encoded(states, frames)
        return Encoded(torch.cat([states, self.silence[:, frames:]], dim=1), frames)
