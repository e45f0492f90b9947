"""Random FastConformer-CTC models: the tiny test model (as a real `.nemo` archive) and the 114M shape.

Weights are random: what these models say is noise, and no accuracy number may be reported from them. The
tiny build writes a `.nemo` so `tiny:fastconformer` goes through exactly the loader real checkpoints use.
Builds are seeded and deterministic (the archive writer fixes member order and mtimes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.chunks import SAMPLE_RATE
from runtime.models.asr.fastconformer.model import DEFAULT_CONTEXTS, FastConformerConfig, FastConformerCTC
from runtime.models.asr.fastconformer.nemo import config_from_nemo, save_nemo
from runtime.models.asr.fastconformer.tokenizer import (
    NORMAL,
    UNKNOWN,
    CTCTokenizer,
    train_unigram,
    write_sentencepiece,
)

TINY_NEMO_NAME = "tiny_fastconformer.nemo"
TINY_VOCAB = 128

# Lower case without punctuation, like the transcripts NeMo's English CTC models are trained on.
CORPUS = """\
the quick brown fox jumps over the lazy dog while the cat watches from the window
good morning everyone today we are going to talk about how speech becomes text in real time
a streaming model listens to short chunks of audio and writes down what it hears as soon as it can
when the speaker pauses the transcript settles and the next sentence begins on a new line
she said that the meeting would start at nine o'clock but nobody arrived before half past nine
can you tell me what the weather will be like tomorrow afternoon in the north of the country
it will be cloudy in the morning with some rain later in the day and a cold wind from the sea
the camera shows a kitchen table with two cups of coffee an open laptop and a pile of letters
he picked up the red book turned a few pages and started reading the first chapter aloud
what did the speaker say about the budget for next year and who is responsible for it
numbers such as one two three four five six seven eight nine and ten are easy to say
the train to the city leaves every twenty minutes from the station near the old market square
they walked along the river talked about their plans for the summer and watched the boats go by
thank you very much for listening and i hope to see all of you again at the next meeting
"""


def tiny_config(vocab_size: int) -> FastConformerConfig:
    """d_model 64, 2 layers, 4 heads, conv kernel 9, the four streaming look-aheads."""
    return FastConformerConfig(
        vocab_size=vocab_size,
        n_layers=2,
        d_model=64,
        n_heads=4,
        ff_expansion_factor=4,
        subsampling_conv_channels=32,
        conv_kernel_size=9,
        conv_norm_type="layer_norm",
        att_context_sizes=DEFAULT_CONTEXTS,
    )


def random_model(cfg: FastConformerConfig, seed: int = 0) -> FastConformerCTC:
    """A seeded random model; the parameters PyTorch initialises to constants (relative-position biases,
    norm statistics) are randomised too, so every code path has an effect the tests can see."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FastConformerCTC(cfg)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if name.endswith(("pos_bias_u", "pos_bias_v")):
                    tensor.normal_(0.0, 0.5)
                elif name.endswith("running_mean"):
                    tensor.normal_(0.0, 0.1)
                elif name.endswith("running_var"):
                    tensor.uniform_(0.5, 1.5)
    return model.eval()


def synthetic_audio(seconds: float, seed: int) -> np.ndarray:
    """Deterministic test audio: segments (0.1-0.5 s) of silence, tones and noise, float32 at 16 kHz."""
    rng = np.random.default_rng(seed)
    total, parts = round(seconds * SAMPLE_RATE), []
    while sum(map(len, parts)) < total:
        n = int(rng.integers(SAMPLE_RATE // 10, SAMPLE_RATE // 2))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            parts.append(np.zeros(n))
        elif kind == 1:
            parts.append(0.3 * np.sin(2 * np.pi * rng.uniform(100, 4000) * np.arange(n) / SAMPLE_RATE))
        else:
            parts.append(0.1 * rng.standard_normal(n))
    return np.concatenate(parts)[:total].astype(np.float32)


def calibrate_head(model: FastConformerCTC, seed: int, *, blank_bias: float = 6.0) -> None:
    """Point the random CTC head at how encoder frames *differ*. A random encoder's frames share a large
    common component, so a plain random head predicts one token everywhere; centring the head on the mean
    frame of some synthetic audio gives frame-dependent labels with runs, repeats and blanks (what CTC
    decoding must handle), still from random weights."""
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed + 1)
        enc = model.encode_offline(synthetic_audio(4.0, seed), model.cfg.att_context_sizes[0])
        mean, spread = enc.mean(0), enc.std(0).mean()
        conv = model.decoder.decoder_layers[0]
        weight = torch.randn(conv.out_channels, enc.shape[1]) * (3.0 / (spread * enc.shape[1] ** 0.5))
        bias = -(weight @ mean)
        bias[model.blank] += blank_bias
    with torch.no_grad():
        conv.weight.copy_(weight.unsqueeze(-1))
        conv.bias.copy_(bias)


def synthetic_tokenizer(vocab_size: int) -> CTCTokenizer:
    """Placeholder SentencePiece pieces (`<unk>`, `▁w1`, ...) for shape-true benchmarks of real-size heads."""
    pieces = [("<unk>", 0.0, UNKNOWN)] + [(f"▁w{i}", -float(i), NORMAL) for i in range(1, vocab_size)]
    return CTCTokenizer.from_sentencepiece(write_sentencepiece(pieces))


def build_tiny_fastconformer(out_dir: Path, seed: int) -> Path:
    """Write the tiny random model as `out_dir / TINY_NEMO_NAME` (a `.nemo` archive) and return its path."""
    tokenizer = train_unigram(CORPUS.splitlines(), TINY_VOCAB)
    model = random_model(tiny_config(tokenizer.vocab_size), seed)
    calibrate_head(model, seed)
    return save_nemo(model, tokenizer, Path(out_dir) / TINY_NEMO_NAME)


def fastconformer_114m_config() -> dict[str, Any]:
    """NeMo config (model_config.yaml keys) of the 114M cache-aware streaming FastConformer (CTC branch of
    `stt_en_fastconformer_hybrid_large_streaming_multi`): 17 x 512, 8 heads, FF x4, conv 9, dw_striding 8x
    with 256 channels, contexts [[70,13],[70,6],[70,1],[70,0]], 1024 SentencePiece tokens."""
    return {
        "sample_rate": 16000,
        "tokenizer": {"dir": None, "type": "bpe"},
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": 16000, "normalize": "NA", "window_size": 0.025, "window_stride": 0.01,
            "window": "hann", "features": 80, "n_fft": 512, "frame_splicing": 1, "dither": 1e-05, "pad_to": 0,
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": 80, "feat_out": -1, "n_layers": 17, "d_model": 512, "subsampling": "dw_striding",
            "subsampling_factor": 8, "subsampling_conv_channels": 256, "causal_downsampling": True,
            "ff_expansion_factor": 4, "self_attention_model": "rel_pos", "n_heads": 8,
            "att_context_size": [list(c) for c in DEFAULT_CONTEXTS], "att_context_style": "chunked_limited",
            "xscaling": True, "untie_biases": True, "pos_emb_max_len": 5000, "conv_kernel_size": 9,
            "conv_norm_type": "layer_norm", "conv_context_size": "causal",
        },
        "decoder": {"_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": 512, "num_classes": 1024},
    }


def build_fastconformer(config: dict[str, Any], seed: int = 0) -> tuple[FastConformerCTC, CTCTokenizer]:
    """A random model (and placeholder tokenizer) from a NeMo-style config, e.g. `fastconformer_114m_config()`."""
    cfg, _ = config_from_nemo(config, where="config")
    return random_model(cfg, seed), synthetic_tokenizer(cfg.vocab_size)
