"""When each token of a transcript is said: Whisper's cross-attention alignment, its word-timestamp method.

A few cross-attention heads of a Whisper checkpoint (`generation_config.alignment_heads`) follow the audio.
Teacher-forcing a transcript through the offline model, their weights (the softmax over the clip's own
frames, normalised over the positions, median-filtered over 7 frames, averaged over the heads) give a
token-by-frame similarity, and the cheapest monotonic path through it (dynamic time warping) says at which
encoder frame each token starts: openai-whisper's `find_alignment`, which CTranslate2's `Whisper.align`
implements too (the tests hold the two equal frame for frame on tiny.en). `runtime bench asr-quality` times
words with it (`bench/word_latency.py`), and `runtime train causal-whisper --stale-share` the positions a stream
feeds (`train/token_times.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

SAMPLES_PER_FRAME = SAMPLE_RATE // 50  # one 20 ms encoder frame
MEDIAN_WIDTH = 7  # frames: openai-whisper's filter width over the alignment heads' weights


def clip_frames(audio: np.ndarray) -> int:
    """Encoder frames of a clip's own audio: half its 10 ms mel frames (the last, partial one counted), rounded
    down, at least one. CTranslate2's `align` halves the mel frame count it is given the same way."""
    return max(1, -(-len(audio) // (SAMPLES_PER_FRAME // 2)) // 2)


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path from (0, 0) to the last cell of `cost` [tokens, frames], stepping right,
    down or diagonally: (token index, frame index) per step."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    move = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0 diagonal, 1 down (next token), 2 right (next frame)
    for i in range(1, n + 1):
        above, row, c, moves = total[i - 1].tolist(), [np.inf] * (m + 1), cost[i - 1].tolist(), [0] * (m + 1)
        for j in range(1, m + 1):
            best, k = above[j - 1], 0
            if above[j] < best:
                best, k = above[j], 1
            if row[j - 1] < best:
                best, k = row[j - 1], 2
            row[j] = c[j - 1] + best
            moves[j] = k
        total[i], move[i] = row, moves
    i, j, tokens, frames = n, m, [], []
    if not np.isfinite(total[n, m]):
        raise ValueError("dtw_path: the cost matrix holds no finite path (NaN in it?)")
    while i > 0 and j > 0:
        tokens.append(i - 1)
        frames.append(j - 1)
        k = move[i, j]
        i, j = (i - 1, j - 1) if k == 0 else (i - 1, j) if k == 1 else (i, j - 1)
    return np.array(tokens[::-1]), np.array(frames[::-1])


def _median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window along the last axis (reflect-padded, as openai-whisper filters)."""
    if x.shape[-1] <= width // 2:
        return x
    pad = width // 2
    padded = F.pad(x, (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).median(-1).values


class TokenAligner:
    """When each token of a transcript is said in its audio, from the offline model's alignment heads."""

    def __init__(self, model: WhisperForConditionalGeneration, features: WhisperFeatureExtractor,
                 prompt: Sequence[int], eos: int) -> None:
        heads = getattr(model.generation_config, "alignment_heads", None)
        if not heads:
            raise ConfigError(f"{model.name_or_path}: its generation_config has no alignment_heads; timing tokens "
                              "in the audio needs them")
        self.model, self.features, self.prompt, self.eos = model, features, list(prompt), eos
        self.heads = [(int(layer), int(head)) for layer, head in heads]

    @classmethod
    def load(cls, path: str | Path, prompt: Sequence[int], eos: int) -> TokenAligner:
        """A float32 copy of the checkpoint at `path` with eager attention (sdpa returns no attention weights)."""
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

        model = WhisperForConditionalGeneration.from_pretrained(path, attn_implementation="eager",
                                                                dtype=torch.float32).eval()
        return cls(model, WhisperFeatureExtractor.from_pretrained(path), prompt, eos)

    @torch.inference_mode()
    def starts(self, audio: np.ndarray, ids: Sequence[int], states: torch.Tensor | None = None) -> list[int]:
        """The encoder frame (20 ms each) at which each of `ids`, and then end-of-text, starts being said.
        `states`: the clip's encoder states [1, 1500, d] if the caller has them (30 s padded, as Whisper reads)."""
        frames = clip_frames(audio)
        if frames < 2:  # one frame: every token is said there (and the normalisation below would divide by 0)
            return [0] * (len(ids) + 1)
        model = self.model.model
        if states is None:
            mel = self.features(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
            states = model.encoder(mel.to(self.model.device, self.model.dtype)).last_hidden_state
        seq = torch.tensor([[*self.prompt, *ids, self.eos]], device=states.device)
        out = model.decoder(input_ids=seq, encoder_hidden_states=states.to(self.model.dtype),
                            output_attentions=True)
        weights = torch.stack([out.cross_attentions[layer][0, head] for layer, head in self.heads]).float()
        weights = weights[:, :, :frames]
        weights = weights / weights.sum(-1, keepdim=True)  # the softmax over the clip's frames only
        std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
        weights = _median_filter((weights - mean) / std.clamp_min(1e-12), MEDIAN_WIDTH)
        # position p predicts token p + 1: the rows whose outputs are the transcript's tokens and end-of-text
        similarity = weights.mean(0)[len(self.prompt) - 1 : len(self.prompt) + len(ids)]
        tokens, steps = dtw_path(-similarity.double().numpy())
        return [int(steps[tokens == t].min()) for t in range(len(ids) + 1)]

    def end_frames(self, audio: np.ndarray, ids: Sequence[int]) -> list[int]:
        """The encoder frame (exclusive) at which each of `ids` ends: where the next token (or end-of-text)
        starts, at least one frame after its own start; [] for no ids."""
        if not ids:
            return []
        starts = self.starts(audio, ids)
        frames = clip_frames(audio)
        return [min(frames, max(s + 1, nxt)) for s, nxt in zip(starts, starts[1:], strict=False)]
