"""The offline final pass's shorter encoder window (`asr.final_pass_window_s`, whisper_window.py) and the decoders'
int8 vocabulary projection (`asr.head_weights`, whisper_head.py), on the tiny random Whisper.

- At 30 s the windowed encoder is transformers' own `WhisperEncoder.forward`.
- A short turn is encoded on its own window only: those frames equal transformers' encoder run on a copy of the
  model cut to that many positions, over the 30 s log-mel cut to the window; the frames after it are the states
  transformers' encoder gives a silent 30 s clip; the decoder still reads 1500 frames.
- The final pass's transcript is the greedy decode of exactly those states, streamed or offline; the decoder's
  cross-attention keys and values of silence's frames are computed once, and a turn's cache holds what the decoder
  would compute from all 1500 frames.
- The int8 head's logits are a float product with its dequantised weights (bfloat16 activations), and a stream
  with it equals its offline computation.
- So are the int8 decoder linears' outputs (`asr.decoder_weights`), and a stream with them and the int8 head
  equals its offline computation; the offline pass's decoder takes them too.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_causal_whisper_decoder import chunk_sizes, make_audio, run_stream
from transformers import WhisperForConditionalGeneration

from runtime.chunks import SAMPLE_RATE
from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.reference import offline_transcript
from runtime.models.asr.registry import load_asr
from runtime.models.asr.whisper_buffered import WhisperBuffered
from runtime.models.asr.whisper_head import (
    DECODER_LINEARS,
    Int8DecoderLinear,
    Int8Head,
    quantize_decoder,
    quantize_head,
)
from runtime.models.asr.whisper_window import WindowedEncoder, encoder_frames


@pytest.fixture(scope="module")
def buffered() -> WhisperBuffered:
    asr = load_asr(ASRConfig(max_new_tokens=24), device="cpu", dtype="float32")
    assert isinstance(asr, WhisperBuffered)
    return asr


def full_features(asr: WhisperBuffered, audio: np.ndarray) -> torch.Tensor:
    """Whisper's own features: the audio padded to 30 s (3000 mel frames)."""
    return asr.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features


def cut_encoder(model: WhisperForConditionalGeneration, frames: int) -> torch.nn.Module:
    """transformers' encoder of a copy of `model` that has only `frames` positions (its forward checks the length)."""
    enc = copy.deepcopy(model.model.encoder)
    enc.config = copy.deepcopy(enc.config)
    enc.config.max_source_positions = frames
    table = enc.embed_positions.weight.data[:frames].clone()
    enc.embed_positions = torch.nn.Embedding(frames, table.shape[1])
    enc.embed_positions.weight.data.copy_(table)
    return enc


def test_window_frames_round_each_turn_up_to_its_window() -> None:
    assert encoder_frames(round(2.7 * SAMPLE_RATE), 5.0) == 250
    assert encoder_frames(5 * SAMPLE_RATE, 5.0) == 250
    assert encoder_frames(5 * SAMPLE_RATE + 1, 5.0) == 500
    assert encoder_frames(12 * SAMPLE_RATE, 10.0) == 1000
    assert encoder_frames(29 * SAMPLE_RATE, 10.0) == 1500  # never past 30 s
    assert encoder_frames(40 * SAMPLE_RATE, 5.0) == 1500
    assert encoder_frames(1, 30.0) == encoder_frames(40 * SAMPLE_RATE, 30.0) == 1500
    for bad in (0.0, -5.0, 31.0, 0.015):
        with pytest.raises(ConfigError, match="final_pass_window_s"):
            encoder_frames(16_000, bad)


def test_at_30_s_the_encoder_is_whispers_own(buffered: WhisperBuffered) -> None:
    audio = make_audio(3.0)
    with torch.inference_mode():
        theirs = buffered.model.model.encoder(full_features(buffered, audio)).last_hidden_state
    assert buffered.encoder.silence is None  # nothing extra encoded at load
    ours = buffered.encode(audio)
    assert ours.frames == 1500 and ours.states.shape == theirs.shape == (1, 1500, buffered.model.config.d_model)
    torch.testing.assert_close(ours.states, theirs, rtol=0, atol=1e-6)
    assert len(buffered.cache(ours).cross_attention_cache.layers) == 0  # no silence: the decoder projects all 1500


def test_a_short_turn_is_encoded_on_its_window_with_silence_after_it(buffered: WhisperBuffered) -> None:
    audio = make_audio(2.7)
    enc = buffered.model.model.encoder
    seen: list[tuple[int, ...]] = []
    hook = enc.layers[0].register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        windowed = WindowedEncoder(enc, buffered.feature_extractor, 5.0)
        assert seen == [(1, 1500, enc.config.d_model)]  # the silence, once, at set-up
        encoded = windowed(audio)
    finally:
        hook.remove()
    assert seen[1:] == [(1, 250, enc.config.d_model)]  # the turn: 2.7 s in one 5 s window, not 30 s
    states = encoded.states
    assert encoded.frames == 250
    assert states.shape == (1, 1500, enc.config.d_model)
    with torch.inference_mode():
        head = cut_encoder(buffered.model, 250)(full_features(buffered, audio)[..., :500]).last_hidden_state
        silence = enc(full_features(buffered, np.zeros(SAMPLE_RATE, np.float32))).last_hidden_state
    torch.testing.assert_close(states[:, :250], head, rtol=0, atol=1e-5)
    torch.testing.assert_close(states[:, 250:], silence[:, 250:], rtol=0, atol=1e-5)
    with torch.inference_mode():
        whole = buffered.model.model.encoder(full_features(buffered, audio)).last_hidden_state
    assert (states - whole).abs().max() > 1e-3  # not the 30 s encoding: the window did change the computation


def test_a_turns_cache_holds_the_cross_attention_of_all_1500_frames_with_silences_computed_once() -> None:
    cfg = ASRConfig(max_new_tokens=24, final_pass_window_s=1.0)
    asr = load_asr(cfg, device="cpu", dtype="float32")
    assert isinstance(asr, WhisperBuffered)
    windowed = WhisperBuffered(asr.model, asr.tokenizer, asr.feature_extractor, cfg, window_s=1.0)
    calls: list[int] = []  # frames each cross-attention key projection is given
    layers = asr.model.model.decoder.layers
    hooks = [layer.encoder_attn.k_proj.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
             for layer in layers]
    try:
        for seconds, frames in ((0.7, 50), (2.3, 150)):
            calls.clear()
            encoded = windowed.encode(make_audio(seconds))
            assert encoded.frames == frames
            cache = windowed.cache(encoded)
            assert calls == [frames] * len(layers)  # only the turn's own frames
            with torch.inference_mode():
                for i, layer in enumerate(layers):
                    attn = layer.encoder_attn
                    for proj, cached in ((attn.k_proj, cache.cross_attention_cache.layers[i].keys),
                                         (attn.v_proj, cache.cross_attention_cache.layers[i].values)):
                        whole = proj(encoded.states).view(1, -1, attn.num_heads, attn.head_dim).transpose(1, 2)
                        torch.testing.assert_close(cached, whole, rtol=0, atol=1e-6)
                    assert cache.is_updated[i]
            calls.clear()
            ids = windowed.decode(encoded)
            assert calls == [frames] * len(layers)  # its cache's; the decoder read the rest from it
            with torch.inference_mode():
                assert ids == windowed._uncached(encoded, ()) != []
    finally:
        for hook in hooks:
            hook.remove()


def test_the_offline_pass_decodes_the_windowed_states_streamed_or_offline(buffered: WhisperBuffered) -> None:
    cfg = ASRConfig(chunk_ms=300, reset_s=30.0, max_new_tokens=24, loop_repeats=0, final_pass="offline",
                    final_pass_window_s=1.0)
    asr = CausalWhisperASR.load(cfg, device="cpu", dtype="float32")
    assert asr.final_pass is not None and asr.final_pass.offline.encoder.window_s == 1.0  # type: ignore[attr-defined]
    audio = make_audio(4.5)
    windowed = WindowedEncoder(buffered.model.model.encoder, buffered.feature_extractor, 1.0)

    def expected(turn: np.ndarray, previous: list[int]) -> str:
        """Greedy, cache-free, over the states of the turn's windows and silence after them, after `previous`."""
        states, prefix, out = windowed(turn).states, buffered.prefix(previous), []
        with torch.inference_mode():
            while len(out) < buffered.max_tokens:
                token = int(buffered._next_logits(torch.tensor([prefix + out]), states, None)[0].argmax())
                if token == buffered.eos_id:
                    break
                out.append(token)
        return buffered.text(out)

    passes: list[list[int]] = []  # each item's previous text as the pass received it (a spy: nothing changes)
    revise = asr.final_pass.revise

    def spy(item, audio, speech=None, before=None):  # noqa: ANN001, ANN202
        passes.append(list(item.previous))
        return revise(item, audio, speech, before)

    asr.final_pass.revise = spy  # type: ignore[method-assign]
    reference = offline_transcript(asr, audio)
    for chunking in ("whole", "ragged"):
        passes.clear()
        done = [u for u in run_stream(asr.open_stream(), audio, chunk_sizes(len(audio), chunking)) if u.completed]
        assert "".join(u.transcript for u in done) == reference, chunking
        start = round(done[-2].end * SAMPLE_RATE) if len(done) > 1 else 0  # the committed item's audio
        assert len(audio) - start > SAMPLE_RATE  # more than one window: two of them encoded
        # the pass decodes after the item's previous text, or without it where the stream disagreed (final_pass.py)
        assert done[-1].transcript in {expected(audio[start:], passes[-1]), expected(audio[start:], [])}, chunking
        assert done[-1].transcript != ""


def test_a_bad_window_or_head_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="final_pass_window_s"):
        CausalWhisperASR.load(ASRConfig(final_pass="offline", final_pass_window_s=45.0), device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="head_weights"):
        CausalWhisperASR.load(ASRConfig(head_weights="int4"), device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="decoder_weights"):
        CausalWhisperASR.load(ASRConfig(decoder_weights="int4"), device="cpu", dtype="float32")


def test_the_int8_head_is_a_product_with_its_dequantised_weights(buffered: WhisperBuffered) -> None:
    weight = buffered.model.proj_out.weight.detach()
    head = Int8Head(weight)
    deq = head.dequantized()
    row_max = weight.abs().amax(dim=1, keepdim=True)
    # half an int8 step of the row's scale, plus the scale's own bfloat16 rounding (8 bits)
    assert ((deq - weight).abs() <= row_max / 254 + row_max * 2**-8 + 1e-7).all()
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, weight.shape[0])
    reference = x.bfloat16().float() @ deq.T
    torch.testing.assert_close(logits, reference, rtol=2e-2, atol=2e-2)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    assert (logits - x @ weight.T).abs().max() > 0  # it is not the float head


def assert_streams_equal_offline(asr: CausalWhisperASR) -> None:
    """Whole, one sample at a time or ragged, across a reset: the stream's completed text is the offline one."""
    audio = make_audio(4.5)
    reference = offline_transcript(asr, audio)
    assert reference.strip()
    for chunking in ("whole", "one-sample", "ragged"):
        done = [u for u in run_stream(asr.open_stream(), audio, chunk_sizes(len(audio), chunking)) if u.completed]
        assert len(done) >= 2, "the stream must cross a reset"
        assert "".join(u.transcript for u in done) == reference, chunking


def test_a_stream_with_the_int8_head_equals_its_offline_computation() -> None:
    cfg = ASRConfig(chunk_ms=300, reset_s=3.0, max_new_tokens=60, loop_repeats=0, head_weights="int8")
    asr = CausalWhisperASR.load(cfg, device="cpu", dtype="float32")
    assert isinstance(asr.model.proj_out, Int8Head)
    assert quantize_head(asr.model, "int8").proj_out is asr.model.proj_out  # once
    plain = CausalWhisperASR.load(ASRConfig(chunk_ms=300, reset_s=3.0, max_new_tokens=60, loop_repeats=0),
                                  device="cpu", dtype="float32")
    assert isinstance(plain.model.proj_out, torch.nn.Linear)
    assert_streams_equal_offline(asr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_decoder_linear_is_a_product_with_its_dequantised_weights(buffered: WhisperBuffered,
                                                                           dtype: torch.dtype) -> None:
    fc1 = copy.deepcopy(buffered.model.model.decoder.layers[0].fc1).to(dtype)
    layer = Int8DecoderLinear(fc1)
    weight, deq = fc1.weight.detach().float(), layer.dequantized()
    row_max = weight.abs().amax(dim=1, keepdim=True)
    assert ((deq - weight).abs() <= row_max / 254 + row_max * 2**-8 + 1e-7).all()
    x = torch.randn(3, 5, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 5, weight.shape[0])
    reference = (x.bfloat16().float() @ deq.T).bfloat16().to(dtype) + fc1.bias.detach()
    torch.testing.assert_close(y.float(), reference.float(), rtol=2e-2, atol=2e-2)
    assert (y.float() - fc1(x).float()).abs().max() > 0  # it is not the float layer


def test_a_stream_with_the_int8_decoder_equals_its_offline_computation() -> None:
    cfg = ASRConfig(chunk_ms=300, reset_s=3.0, max_new_tokens=60, loop_repeats=0, head_weights="int8",
                    decoder_weights="int8", final_pass="offline", final_pass_dtype="bfloat16")
    asr = CausalWhisperASR.load(cfg, device="cpu", dtype="float32")
    offline = asr.final_pass.offline.model  # type: ignore[union-attr]
    for model in (asr.model, offline):
        for layer in model.model.decoder.layers:
            assert all(isinstance(layer.get_submodule(n), Int8DecoderLinear) for n in DECODER_LINEARS)
            assert isinstance(layer.encoder_attn.k_proj, torch.nn.Linear)  # the frames' K/V stay float
        assert not any(isinstance(m, Int8DecoderLinear) for m in model.model.encoder.modules())
    fc1 = asr.model.model.decoder.layers[0].fc1
    assert quantize_decoder(asr.model, "int8").model.decoder.layers[0].fc1 is fc1  # once
    assert_streams_equal_offline(asr)
