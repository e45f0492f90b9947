"""The `offline` final pass's greedy search on an ONNX Runtime graph of the checkpoint's decoder step
(`asr.graph_runtime`; onnx_export.py says why graphs).

The pass decodes each turn once more over Whisper's 1500 encoder frames. In torch a step of that decoder (bfloat16,
int8 linears) costs about 9 ms on one core, most of it fixed cost per operation, as the stream's steps did; the
graph is the stream's own `onnx_decoder._Step`, exported from the checkpoint as it was before the streaming adapter
was merged (the pass reads full context and needs none), 8-bit where `asr.decoder_weights = "int8"`. Only the
search moves: the encoder, the cross-attention K/V (each turn's frames per turn, silence's after them once:
whisper_window.py), the loop check and the beam retry stay torch's (`WhisperBuffered`, final_pass.py).

The search feeds one token at a time and does not check the stream's words as a draft (transcript_draft.py), as
torch's does: over 1500 frames the graph's step costs about 2.7 ms for one token and 0.7 ms more for each token
fed with it, so checking a guess costs about what decoding it would: on the quick sets the search took 0.013 s per
audio second feeding one token at a time, 0.014-0.019 s checking guesses of 2 to 16 tokens (model card).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runtime.models.asr.causal_whisper.onnx_decoder import OnnxDecoder, OnnxStep
from runtime.models.asr.transcript_draft import greedy
from runtime.models.asr.whisper_buffered import WhisperBuffered
from runtime.models.asr.whisper_window import Encoded


class GraphSearch:
    """`WhisperBuffered.decode`'s greedy search for `offline`, its steps run by `step` (a graph of the same
    checkpoint's decoder)."""

    def __init__(self, step: OnnxStep, offline: WhisperBuffered) -> None:
        self.step, self.offline = step, offline
        self._silence = None if offline.silence_kv is None else _stacked(offline.silence_kv)

    def __call__(self, encoded: Encoded, previous: Sequence[int] = (), sot: Sequence[int] | None = None) -> list[int]:
        """The greedy transcript ids (no prompt, no eos) of the encoded turn after the `previous` text and the
        start-of-transcript sequence `sot` (default: the pass model's, `WhisperBuffered.sot_for`)."""
        offline, states, frames = self.offline, encoded.states, encoded.frames
        decoder = OnnxDecoder(self.step, frames=states.shape[1])
        if self._silence is not None and frames < states.shape[1]:
            decoder.add_kv(*_stacked(offline.cross_kv(states[:, :frames])))
            decoder.add_kv(*(kv[:, :, frames:] for kv in self._silence))
        else:
            decoder.add_kv(*_stacked(offline.cross_kv(states)))
        suppress = offline.suppress

        def score(ids: list[int], rows: int) -> torch.Tensor:
            logp = decoder.feed(ids, rows)
            if suppress:
                logp[:, suppress] = float("-inf")
            return logp

        prefix = offline.prefix(previous, offline.sot_for(encoded)[0] if sot is None else sot)
        return greedy(score, lambda n: decoder.truncate(decoder.length - n), prefix, (),
                      eos=offline.eos_id, max_tokens=offline.budget(prefix))


def _stacked(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer K and V [1, heads, n, head_dim] (the pass model's dtype) -> K and V [layers, heads, n, head_dim],
    float32 as the graph reads them."""
    return tuple(torch.stack([pair[i][0] for pair in kv]).float().numpy() for i in (0, 1))  # type: ignore[return-value]
