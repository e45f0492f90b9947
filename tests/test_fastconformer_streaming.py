"""Cache-aware FastConformer: streaming equals the offline forward exactly, for every look-ahead and any cut.

The tiny model is built as a `.nemo` archive and read back through the real loader. Its CTC head is
calibrated (tiny.calibrate_head) so its random labels have runs, repeats and blanks for the decoder to handle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.chunks import AudioChunk
from runtime.config import ASRConfig
from runtime.models.asr.fastconformer import (
    CacheAwareEncoderStream,
    FastConformerASR,
    build_tiny_fastconformer,
    load_nemo,
)
from runtime.models.asr.fastconformer.model import chunked_limited_mask
from runtime.models.asr.fastconformer.tiny import synthetic_audio

CONTEXTS = [(70, 13), (70, 6), (70, 1), (70, 0)]
LOOKAHEAD_MS = {(70, 13): 1040, (70, 6): 480, (70, 1): 80, (70, 0): 0}
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_nemo(build_tiny_fastconformer(tmp_path_factory.mktemp("fc"), seed=0))


@pytest.fixture(scope="module")
def audio():
    return synthetic_audio(8.0, seed=5)  # 101 encoder frames: the 70-frame attention cache fills and rolls


def cuts(kind: str, total: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    if kind == "whole":
        return [total]
    if kind == "large":  # larger than the biggest chunk (14 frames = 17920 samples)
        sizes = [40_000] * (total // 40_000 + 1)
    elif kind == "ragged":
        sizes = list(rng.integers(1, 3000, size=total))
    else:  # "boundaries": hop and frame multiples and their neighbours
        sizes = list(rng.choice([1, 7, 159, 160, 161, 1279, 1280, 1281, 5000], size=total))
    out, pos = [], 0
    for size in sizes:
        if pos >= total:
            break
        out.append(int(min(size, total - pos)))
        pos += out[-1]
    return out


def stream_encode(model, audio: np.ndarray, context, sizes: list[int]) -> torch.Tensor:
    stream, outs, pos = CacheAwareEncoderStream(model, context), [], 0
    for size in sizes:
        outs.append(stream.accept(audio[pos : pos + size]))
        pos += size
    outs.append(stream.finish())
    return torch.cat(outs)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kind", ["whole", "large", "ragged", "boundaries"])
def test_streaming_equals_full_forward(tiny, audio, context, kind):
    model, _ = tiny
    reference = model.encode_offline(audio, context)
    out = stream_encode(model, audio, context, cuts(kind, len(audio), seed=context[1] + len(kind)))
    assert out.shape == reference.shape == (101, model.cfg.d_model)
    assert (out - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("context", CONTEXTS)
def test_one_sample_chunks(tiny, context):
    model, _ = tiny
    audio = synthetic_audio(2.5, seed=9)
    reference = model.encode_offline(audio, context)
    out = stream_encode(model, audio, context, [1] * len(audio))
    assert out.shape == reference.shape
    assert (out - reference).abs().max().item() <= TOL


def test_contexts_change_the_output(tiny, audio):
    """The equality above is not vacuous: look-ahead and the chunked mask change the encoder's output."""
    model, _ = tiny
    outs = [model.encode_offline(audio, c) for c in CONTEXTS]
    for a, b in zip(outs, outs[1:], strict=False):
        assert (a - b).abs().max().item() > 1e-2
    mask = chunked_limited_mask(6, (2, 1))
    assert mask.tolist()[4] == [False, False, True, True, True, True]  # chunk 2 sees chunks 1-2 (left 2 // 2)
    assert mask.tolist()[1] == [True, True, False, False, False, False]


@pytest.mark.parametrize("context", CONTEXTS)
def test_frames_released_as_soon_as_right_context_arrives(tiny, context):
    """Encoder frame j needs samples up to 1280 j + 200 (its last feature window); a chunk of right + 1
    frames is released the moment its last frame can be computed, and not before."""
    model, _ = tiny
    audio = synthetic_audio(4.0, seed=3)
    chunk = context[1] + 1
    for frame in (0, 3, 13, 14, 27, 30):
        need = 1280 * frame + 200
        for samples, ready in ((need - 1, frame), (need, frame + 1)):
            stream = CacheAwareEncoderStream(model, context)
            got = stream.accept(audio[:samples]).shape[0]
            assert got == (ready // chunk) * chunk, (frame, samples)


@pytest.mark.parametrize("context", CONTEXTS)
def test_streaming_transcript_equals_offline_greedy_ctc(tiny, audio, context):
    model, tokenizer = tiny
    labels = model.decoder(model.encode_offline(audio, context).unsqueeze(0))[0].argmax(-1).tolist()
    repeats = sum(1 for a, b in zip(labels, labels[1:], strict=False) if a == b != model.blank)
    assert repeats > 0 and model.blank in labels  # collapse and blank handling are exercised
    offline = model.transcribe_offline(audio, context)
    asr = FastConformerASR(model, tokenizer, ASRConfig(lookahead_ms=LOOKAHEAD_MS[context]), pause_s=1e9)
    stream = asr.open_stream()
    updates, pos = [], 0
    for size in cuts("ragged", len(audio), seed=1):
        updates += stream.accept(AudioChunk(audio[pos : pos + size], pos))
        pos += size
    updates += stream.finish()
    assert stream.token_ids == offline
    (done,) = [u for u in updates if u.completed]
    assert done.transcript == tokenizer.decode(offline) != ""
    assert "".join(u.delta for u in updates) == done.transcript
    assert all(u.unstable == "" for u in updates)


def test_state_is_constant_as_the_stream_grows(tiny):
    """Per-chunk work is flat: everything carried between calls has a fixed bound, reached early."""
    model, _ = tiny
    cfg = model.cfg
    audio = synthetic_audio(30.0, seed=11)
    stream = CacheAwareEncoderStream(model, (70, 13))
    sizes, step = [], 8000
    for pos in range(0, len(audio), step):
        stream.accept(audio[pos : pos + step])
        sizes.append(stream.state_sizes())
    late = sizes[len(sizes) // 3 :]
    for key in ("cache_last_channel", "cache_last_time"):
        assert all(s[key] == late[0][key] for s in late)
    assert late[0]["cache_last_channel"] == (cfg.n_layers, 1, 70, cfg.d_model)
    assert late[0]["cache_last_time"] == (cfg.n_layers, 1, cfg.d_model, cfg.conv_kernel_size - 1)
    assert max(s["pending"][1] for s in sizes) < 14
    assert max(s["feature_samples"][0] for s in sizes) < 400  # less than one STFT window
    assert all(s[f"subsampling_{i}"][2] <= 2 for s in sizes for i in range(3))
    assert stream.cache_valid == 70 and stream.frames_out > 300


def test_batch_norm_variant_streams_exactly_and_round_trips(tmp_path, tiny):
    """NeMo's other conv norm (`batch_norm`, eval statistics): per channel, so as causal as layer norm."""
    from dataclasses import replace

    from runtime.models.asr.fastconformer import save_nemo
    from runtime.models.asr.fastconformer.tiny import random_model

    model, tokenizer = tiny
    bn = random_model(replace(model.cfg, conv_norm_type="batch_norm"), seed=3)
    audio = synthetic_audio(7.0, seed=8)
    reference = bn.encode_offline(audio, (70, 6))
    out = stream_encode(bn, audio, (70, 6), cuts("ragged", len(audio), seed=4))
    assert (out - reference).abs().max().item() <= TOL
    again, _ = load_nemo(save_nemo(bn, tokenizer, tmp_path / "bn.nemo"))
    assert again.cfg.conv_norm_type == "batch_norm"
    assert torch.equal(again.encode_offline(audio, (70, 6)), reference)
