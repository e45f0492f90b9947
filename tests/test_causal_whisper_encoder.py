"""The causal log-mel and the block-causal streaming Whisper encoder: streaming equals offline for any chunking."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

from runtime.errors import ConfigError
from runtime.io.sample import demo_speech
from runtime.models.asr.causal_whisper.encoder import (
    CausalWhisperEncoder,
    EncoderWindowFull,
    block_causal_mask,
    block_frames_for,
    stream_conv,
)
from runtime.models.asr.causal_whisper.features import StreamingLogMel, log_mel
from runtime.models.loading import resolve_checkpoint

TOL = 1e-4  # fp32 streaming vs forward_full (measured ~1.5e-5 on states of magnitude ~4)


@pytest.fixture(scope="module")
def tiny() -> WhisperForConditionalGeneration:
    path = resolve_checkpoint("tiny:whisper", role="asr")
    return WhisperForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def wider() -> WhisperForConditionalGeneration:
    """128 mel bins (large-v3's front end), wider and deeper than tiny, random weights."""
    config = WhisperConfig(
        num_mel_bins=128, d_model=96, encoder_layers=3, decoder_layers=1, encoder_attention_heads=6,
        decoder_attention_heads=2, encoder_ffn_dim=192, decoder_ffn_dim=32, max_source_positions=1500,
        init_std=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return demo_speech()[: 7 * 16000 + 123]  # ~7 s, not a whole number of hops


def ragged(total: int, high: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(int(rng.integers(1, high + 1)), total - sum(sizes)))
    return sizes


def run_mel(stream: StreamingLogMel, audio: np.ndarray, sizes: list[int]) -> torch.Tensor:
    outs, i = [], 0
    for n in sizes:
        outs.append(stream.accept(audio[i : i + n]))
        i += n
    return torch.cat([*outs, stream.flush()], dim=1)


def run_stream(encoder: CausalWhisperEncoder, mel: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    stream, outs, i = encoder.open(), [], 0
    for n in sizes:
        outs.append(stream.accept(mel[:, i : i + n]))
        i += n
    out = torch.cat([*outs, stream.flush()])
    assert stream.frames_done == out.shape[0]
    return out


def full(encoder: CausalWhisperEncoder, mel: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return encoder.forward_full(mel[None])[0]


# --- features ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["one", "ragged", "whole"])
def test_streaming_log_mel_equals_offline(speech: np.ndarray, kind: str) -> None:
    audio = speech[:16123] if kind == "one" else speech
    sizes = {"one": [1] * len(audio), "ragged": ragged(len(audio), 5000), "whole": [len(audio)]}[kind]
    offline = log_mel(audio)
    streamed = run_mel(StreamingLogMel(80), audio, sizes)
    assert offline.shape == (80, -(-len(audio) // 160)) and offline.dtype == torch.float32
    assert (streamed - offline).abs().max().item() <= 1e-6


def test_log_mel_is_causal(speech: np.ndarray) -> None:
    """A frame depends only on audio up to its own hop: cutting the audio never changes earlier frames."""
    whole = log_mel(speech)
    for n in (160, 1600, 40_000, 40_001):
        assert torch.equal(log_mel(speech[:n])[:, : n // 160], whole[:, : n // 160])
    louder = speech.copy()
    louder[60_000:] *= 50  # a loud tail raises the running max: later floors move, earlier ones do not
    changed = log_mel(louder)
    assert torch.equal(changed[:, :375], whole[:, :375])
    assert (changed[:, 500:] - whole[:, 500:]).abs().max() > 0.5


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_is_whispers_away_from_the_edges(n_mels: int) -> None:
    """Same window, filters, log and scaling as Whisper; only framing (40 samples earlier) and floor differ.
    White noise never reaches either floor, so frames k >= 2 of x[40:] equal Whisper's frames of x."""
    noise = np.random.default_rng(0).standard_normal(32_000).astype(np.float32) * 0.1
    whisper = WhisperFeatureExtractor(feature_size=n_mels)(noise, sampling_rate=16000, return_tensors="np")
    ours = log_mel(noise[40:], n_mels).numpy()
    assert np.abs(ours[:, 2:190] - whisper.input_features[0][:, 2:190]).max() < 1e-5


def test_log_mel_stream_edges() -> None:
    stream = StreamingLogMel(80)
    assert stream.accept(np.zeros(159, np.float32)).shape == (80, 0)
    assert stream.accept(np.zeros(1, np.float32)).shape == (80, 1)  # a frame is out when its hop is in
    assert stream.flush().shape == (80, 0)  # nothing pending
    with pytest.raises(RuntimeError, match="after flush"):
        stream.accept(np.zeros(1, np.float32))
    assert StreamingLogMel(80).flush().shape == (80, 0)
    assert log_mel(np.zeros(0, np.float32)).shape == (80, 0)
    with pytest.raises(ValueError, match="1-D float"):
        log_mel(np.zeros((2, 2), np.float32))


# --- encoder: offline ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the CPU path runs on oneDNN")
@pytest.mark.parametrize("stride", [1, 2])
def test_the_fronts_convolution_in_pieces_is_the_whole_clips(stride: int) -> None:
    """A stream convolves a few frames at a time; the offline encoder convolves the whole clip, which torch runs on
    oneDNN. `stream_conv` runs the pieces on oneDNN too, and each output comes out bit for bit as in the whole
    (torch's own path for small inputs differs in the last bits)."""
    torch.manual_seed(stride)
    conv = torch.nn.Conv1d(96, 128, 3, stride=stride)
    x = torch.randn(1, 96, 1201)
    with torch.inference_mode():
        whole = torch.nn.functional.conv1d(x, conv.weight, conv.bias, stride=stride)
        pieces, done = [], 0
        for k in [5, 11, 6, 1, 21, 33, 60, 7] * 20:  # k outputs at a time, from the input frames they read
            start = done * stride
            if start + stride * (k - 1) + 3 > x.shape[2]:
                break
            pieces.append(stream_conv(x[:, :, start : start + stride * (k - 1) + 3], conv, stride))
            done += k
        got = torch.cat(pieces, dim=2)
    assert torch.equal(got, whole[:, :, : got.shape[2]])


def test_block_sizes_and_mask() -> None:
    assert [block_frames_for(ms) for ms in (40, 100, 200, 300, 1000)] == [2, 5, 10, 15, 50]
    with pytest.raises(ConfigError):
        block_frames_for(30)
    mask = block_causal_mask(0, 8, 8, 2).int()
    # first block widened to 4 frames, then blocks of 2; bidirectional inside a block, causal across
    assert mask.tolist() == [[1] * 4 + [0] * 4] * 4 + [[1] * 6 + [0] * 2] * 2 + [[1] * 8] * 2


def test_one_block_is_whispers_encoder(tiny: WhisperForConditionalGeneration) -> None:
    """With a single block over all 1500 frames the mask is full: forward_full must be HF's own encoder."""
    mel = torch.randn(1, 80, 3000)
    with torch.no_grad():
        ours = CausalWhisperEncoder(tiny, block_frames=750).forward_full(mel)
        theirs = tiny.model.encoder(mel).last_hidden_state
    assert (ours - theirs).abs().max().item() < 1e-5


def test_forward_full_is_block_causal(tiny: WhisperForConditionalGeneration, speech: np.ndarray) -> None:
    encoder = CausalWhisperEncoder(tiny, block_frames=5)
    mel = log_mel(speech[:32000])
    out = full(encoder, mel)
    end = 10  # first block: 2 * 5 encoder frames, reading mel frames up to 2 * end (conv look-ahead)
    later = mel.clone()
    later[:, 2 * end + 1 :] += 1.0
    changed = full(encoder, later)
    assert torch.allclose(changed[:end], out[:end], atol=1e-6, rtol=0)
    assert (changed[end:] - out[end:]).abs().amax(dim=1).min() > 1e-3
    inside = mel.clone()
    inside[:, 2 * end] += 1.0  # the one mel frame of look-ahead reaches the block's last frame, hence all of it
    assert (full(encoder, inside)[:end] - out[:end]).abs().amax(dim=1).min() > 1e-4


def test_forward_full_batched_and_limits(tiny: WhisperForConditionalGeneration) -> None:
    encoder = CausalWhisperEncoder(tiny, block_frames=5)
    mel = torch.randn(2, 80, 101, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batch = encoder.forward_full(mel)
        assert batch.shape == (2, 51, 64)
        for b in range(2):
            # float32 sums in another order as a batch of 2: up to 1.3e-5 apart over 40 random mels (outputs to 3.9)
            assert torch.allclose(batch[b], encoder.forward_full(mel[b : b + 1])[0], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="exceed"):
        encoder.forward_full(torch.zeros(1, 80, 3001))
    with pytest.raises(ValueError, match="mel must be"):
        encoder.forward_full(torch.zeros(1, 128, 10))


# --- encoder: streaming -------------------------------------------------------------------------------------


@pytest.mark.parametrize("gran", [2, 5, 15])
def test_stream_equals_forward_full(tiny: WhisperForConditionalGeneration, speech: np.ndarray, gran: int) -> None:
    encoder = CausalWhisperEncoder(tiny, block_frames=gran)
    mel = log_mel(speech)  # 701 mel frames
    first = 4 * gran  # mel frames of the widened first block
    # shorter than a block, exactly a block (with and without the look-ahead frame), odd/even tails, ~7 s
    for t in (1, 2, 3, first - 1, first, first + 1, first + 2 * gran, 701):
        ref = full(encoder, mel[:, :t])
        for sizes in ([1] * t, ragged(t, 3 * gran, seed=t), [t], [first + 2 * gran + 3] * (t // 7 + 1)):
            out = run_stream(encoder, mel[:, :t], sizes)
            assert out.shape == ref.shape == (-(-t // 2), 64)
            assert (out - ref).abs().max().item() <= TOL, (t, sizes[:3])


def test_stream_equals_forward_full_wider_model(wider: WhisperForConditionalGeneration, speech: np.ndarray) -> None:
    encoder = CausalWhisperEncoder(wider, block_frames=5)
    mel = log_mel(speech[:48_000], 128)
    ref = full(encoder, mel)
    for sizes in ([1] * mel.shape[1], ragged(mel.shape[1], 40, seed=3)):
        assert (run_stream(encoder, mel, sizes) - ref).abs().max().item() <= TOL


def test_audio_stream_equals_offline(tiny: WhisperForConditionalGeneration, speech: np.ndarray) -> None:
    encoder = CausalWhisperEncoder(tiny, block_frames=15)
    for audio, sizes in ((speech[:8_000], [1] * 8_000), (speech, ragged(len(speech), 6000, seed=5))):
        stream, outs, i = encoder.open_audio(), [], 0
        for n in sizes:
            outs.append(stream.accept(audio[i : i + n]))
            i += n
        out = torch.cat([*outs, stream.flush()])
        assert (out - encoder.encode_audio(audio)).abs().max().item() <= TOL


@pytest.mark.parametrize("gran", [2, 15])
def test_blocks_are_emitted_when_their_audio_is_in(tiny: WhisperForConditionalGeneration, gran: int) -> None:
    """Block ending at encoder frame e comes out with sample 160 * (2e + 1): its audio plus 10 ms look-ahead."""
    stream = CausalWhisperEncoder(tiny, block_frames=gran).open_audio()
    audio = np.random.default_rng(0).standard_normal(32_000).astype(np.float32) * 0.1
    fed = 0
    for end in (2 * gran, 3 * gran, 4 * gran):
        due, done = 160 * (2 * end + 1), stream.frames_done
        assert stream.accept(audio[fed : due - 1]).shape[0] == 0
        assert stream.accept(audio[due - 1 : due]).shape[0] == end - done
        assert stream.frames_done == end
        fed = due
    rest = stream.flush()  # the held-back frames: up to the next block's end, right edge zero-padded
    assert stream.frames_done == -(-fed // 320) and rest.shape[0] == stream.frames_done - 4 * gran


def test_work_per_chunk_is_flat(tiny: WhisperForConditionalGeneration, speech: np.ndarray) -> None:
    """Each mel frame goes through the convs and each encoder frame through the layers exactly once, so a
    chunk late in the stream costs what one early does (CarelessWhisper's reference re-runs the convs)."""
    encoder = CausalWhisperEncoder(tiny, block_frames=5)
    mel = log_mel(speech)
    stream = encoder.open()
    work = []
    for i in range(0, 700, 10):  # 100 ms chunks over 7 s
        before = (stream.conv1_frames, stream.conv2_frames, stream.layer_frames)
        stream.accept(mel[:, i : i + 10])
        after = (stream.conv1_frames, stream.conv2_frames, stream.layer_frames)
        work.append(tuple(a - b for a, b in zip(after, before, strict=True)))
    # (conv1, conv2, layer) frames per 100 ms chunk: the convs wait one frame for right context, the layers
    # for the widened first block (10 frames); from then on every chunk does the same work.
    assert work[:3] == [(9, 4, 0), (10, 5, 0), (10, 5, 10)]
    assert set(work[3:]) == {(10, 5, 5)}
    stream.accept(mel[:, 700:])
    stream.flush()
    assert (stream.conv1_frames, stream.conv2_frames, stream.layer_frames) == (701, 351, 351)
    assert all(cache.n == 351 for cache in stream._caches)  # K/V cached once per frame


def test_stream_follows_model_dtype(wider: WhisperForConditionalGeneration, speech: np.ndarray) -> None:
    """A bf16 model streams bf16 states; chunked vs full differs by bf16 rounding (~0.05 measured), no more."""
    encoder = CausalWhisperEncoder(copy.deepcopy(wider).to(torch.bfloat16), block_frames=5)
    mel = log_mel(speech[:16_000], 128)
    out = run_stream(encoder, mel, ragged(mel.shape[1], 9, seed=2))
    ref = full(encoder, mel)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max().item() <= 0.15


def test_thirty_seconds_then_full(tiny: WhisperForConditionalGeneration) -> None:
    encoder = CausalWhisperEncoder(tiny, block_frames=50)
    mel = torch.randn(80, 3000) * 0.5
    stream = encoder.open()
    head = stream.accept(mel)
    with pytest.raises(EncoderWindowFull, match="open a new stream"):
        stream.accept(mel[:, :1])
    out = torch.cat([head, stream.flush()])  # the refused chunk left the stream intact
    assert out.shape == (1500, 64) and (out - full(encoder, mel)).abs().max().item() <= TOL
    with pytest.raises(RuntimeError, match="after flush"):
        stream.accept(mel[:, :1])
    audio = encoder.open_audio()
    audio.accept(np.zeros(480_000, np.float32))
    with pytest.raises(EncoderWindowFull):
        audio.accept(np.zeros(1, np.float32))
    assert audio.frames_done + audio.flush().shape[0] == 1500


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # inside peft
def test_lora_trains_through_forward_full_and_streams(speech: np.ndarray) -> None:
    """peft LoRA on the encoder's q/k/v/out: gradients reach it via forward_full, and streaming uses it too."""
    path = resolve_checkpoint("tiny:whisper", role="asr")
    model = WhisperForConditionalGeneration.from_pretrained(path)
    targets = r".*encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)"
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    encoder = CausalWhisperEncoder(model, block_frames=5)
    mel = log_mel(speech[:16000])
    before = full(encoder, mel)
    encoder.forward_full(mel[None]).square().mean().backward()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 8 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    with torch.no_grad():
        for p in lora_b:
            p.normal_(std=0.5)
    model.eval()
    after = full(encoder, mel)
    assert (after - before).abs().max() > 1e-2  # the adapters are in the computation
    assert encoder.open()._packed is None  # unmerged LoRA: the stream calls the peft modules
    assert (run_stream(encoder, mel, ragged(mel.shape[1], 17)) - after).abs().max().item() <= TOL
    merged = CausalWhisperEncoder(model.merge_and_unload(), block_frames=5)
    assert merged.open()._packed is not None  # merged into plain nn.Linear: the packed fast path
    assert (run_stream(merged, mel, ragged(mel.shape[1], 17)) - after).abs().max().item() <= TOL


def test_packed_weights_follow_the_model(wider: WhisperForConditionalGeneration, speech: np.ndarray) -> None:
    """The stream's packed weights equal the modules' path, are shared, and are rebuilt when weights change."""
    model = copy.deepcopy(wider)
    encoder, other = CausalWhisperEncoder(model, block_frames=5), CausalWhisperEncoder(model, block_frames=15)
    mel = log_mel(speech[:16_000], 128)
    packed = encoder.open()._packed
    assert packed is not None and other.open()._packed is packed and encoder.open()._packed is packed
    fast, modules = encoder.open(), encoder.open()
    modules._packed = None  # force the modules' path
    outs = [torch.cat([s.accept(mel[:, i : i + 13]) for i in range(0, mel.shape[1], 13)] + [s.flush()])
            for s in (fast, modules)]  # fmt: skip
    assert outs[0].shape == outs[1].shape == (50, 96) and (outs[0] - outs[1]).abs().max().item() <= TOL
    assert fast._caches[0].k.shape[1] == 1500  # preallocated for a full stream
    model.train()  # dropout: the modules' path
    assert encoder.open()._packed is None
    model.eval()
    with torch.no_grad():
        model.model.encoder.layers[1].fc1.weight.mul_(1.5)
        model.model.encoder.layers[2].self_attn.k_proj.weight.add_(0.01)
    assert encoder.open()._packed is not packed
    ref = full(encoder, mel)
    assert (ref - full(CausalWhisperEncoder(wider, block_frames=5), mel)).abs().max() > 1e-2
    assert (run_stream(encoder, mel, ragged(mel.shape[1], 23, seed=4)) - ref).abs().max().item() <= TOL
