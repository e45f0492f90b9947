"""Stale-position training (`train/token_times.py`): the positions' frames, which clips a step draws, and the
training batch's per-position masks against the streaming decoder they must imitate."""

from __future__ import annotations

import numpy as np
import torch
from test_causal_whisper_lora import base_model

from runtime.models.asr.causal_whisper.decoder import IncrementalDecoder
from runtime.train.causal_whisper import decoder_logits, make_batch, stale_rows
from runtime.train.token_times import fed_frames


def test_fed_frames_follow_the_blocks_a_stream_feeds() -> None:
    # prompt of 3 (two positions before the one predicting the first token), 5-frame blocks (first block 10),
    # tokens ending at frames 3, 12, 30 of a 33-frame clip, a row 8 wide (the batch's longest)
    assert fed_frames([3, 12, 30], 3, 8, 33, 5) == [10, 10, 10, 15, 30, 33, 33, 33]
    # fed two frames after each token's end
    assert fed_frames([3, 12, 30], 3, 8, 33, 5, lag=2) == [10, 10, 10, 15, 33, 33, 33, 33]
    # a clip shorter than the first block sees only itself
    assert fed_frames([2], 2, 3, 4, 5) == [4, 4, 4]


def test_stale_rows_take_the_share_asked() -> None:
    assert stale_rows(3, 8, 0.0, 0) == [False] * 8 and stale_rows(3, 8, 1.0, 0) == [True] * 8
    draws = [stale_rows(step, 8, 0.5, 1) for step in range(40)]  # (the same again on resume: the resume test)
    assert 0.35 < np.mean(draws) < 0.65 and len({tuple(d) for d in draws}) > 20


def test_a_stale_row_sees_what_the_streaming_decoder_fed_each_position() -> None:
    """Training on stale positions must be the stream's computation: feed a row's tokens one at a time into
    `IncrementalDecoder`, each once the frames its position sees have arrived, and its next-token log-probs
    must equal the teacher-forced batch's, position for position (and differ from a fresh row's)."""
    model = base_model()
    prompt, ids, eos = [1, 2], [7, 8, 9, 10], 0
    audio = np.zeros(16 * 320, np.float32)  # 16 encoder frames
    batch = make_batch([(audio, ids), (audio, ids)], prompt, eos, 80, [([3, 5, 9, 16], 2, 0), None])
    seen = batch.frames[0].tolist()
    assert seen == [4, 4, 6, 10, 16, 16] and batch.frames[1].tolist() == [16] * 6
    states = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0)).expand(2, -1, -1)
    with torch.no_grad():
        logp = decoder_logits(model, batch.input_ids, states, batch.frames).log_softmax(-1)
    stream, heard, rows = IncrementalDecoder(model), 0, []
    for tok, n in zip(batch.input_ids[0].tolist(), seen, strict=True):
        stream.add_frames(states[0, heard:n])
        heard = n
        rows.append(stream.feed([tok])[0])
    torch.testing.assert_close(torch.stack(rows), logp[0], rtol=1e-4, atol=1e-4)
    # even the last positions, which see every frame, read the stale states of those before them
    assert all(not torch.allclose(logp[0, p], logp[1, p], atol=1e-3) for p in range(6))
