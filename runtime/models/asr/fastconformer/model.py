"""Cache-aware FastConformer-CTC (NeMo's cache-aware streaming FastConformer), without NeMo.

Module and parameter names mirror NeMo's (`preprocessor.featurizer`, `encoder.pre_encode.conv.N`,
`encoder.layers.N.{feed_forward1,self_attn,conv,feed_forward2,norm_*}`, `decoder.decoder_layers.0`), so a
`.nemo` state dict loads with no renaming (see nemo.py). Everything here is the *offline* forward: one pass
over a whole utterance with the chunked-limited attention mask. cache_aware_encoder.py runs the same modules
incrementally with caches and must reproduce this forward exactly; that equality is what the tests check.

- Subsampling `dw_striding` (NeMo `causal_downsampling: true`): conv2d 3x3 stride 2, then (log2(factor) - 1)
  x [depthwise 3x3 stride 2 + pointwise 1x1], ReLU after each stage, padding (left 2, right 1) on time and
  frequency (NeMo's `CausalConv2D`), then a linear over channels x remaining mel bins. Output j of a stage
  reads inputs 2j - 2 .. 2j: causal in time, 80 ms per encoder step at factor 8.
- Conformer block: macaron FF halves, Transformer-XL relative-position MHSA (`linear_pos`, `pos_bias_u/v`,
  NeMo's `rel_shift`), causal depthwise conv module (left pad kernel - 1; batch or layer norm), final norm.
- Attention context `chunked_limited` [left, right] exactly as NeMo's `_create_masks`: chunk size right + 1;
  a frame sees its own chunk and `left // (right + 1)` whole chunks before it.
- CTC head: 1x1 conv to vocab + 1 classes, blank last (NeMo's `ConvASRDecoder`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.asr.fastconformer.features import FeatureConfig, MelFeaturizer

# The multi-lookahead contexts of NeMo's streaming FastConformer: look-ahead 1040 / 480 / 80 / 0 ms.
DEFAULT_CONTEXTS = ((70, 13), (70, 6), (70, 1), (70, 0))
MASK_VALUE = -10000.0  # NeMo's INF_VAL: masked scores, then zeroed after softmax


@dataclass(frozen=True)
class FastConformerConfig:
    vocab_size: int  # tokenizer size; the CTC head has vocab_size + 1 outputs, blank = vocab_size
    n_layers: int = 17
    d_model: int = 512
    n_heads: int = 8
    ff_expansion_factor: int = 4
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    conv_kernel_size: int = 9
    conv_norm_type: str = "layer_norm"  # layer_norm | batch_norm
    att_context_sizes: tuple[tuple[int, int], ...] = DEFAULT_CONTEXTS  # first = NeMo's default
    xscaling: bool = True
    use_bias: bool = True
    features: FeatureConfig = field(default_factory=FeatureConfig)

    @property
    def sampling_num(self) -> int:
        return int(math.log2(self.subsampling_factor))

    @property
    def frame_seconds(self) -> float:
        """Media seconds per encoder step (80 ms for factor 8 and a 10 ms hop)."""
        return self.subsampling_factor * self.features.window_stride / self.features.sample_rate

    def lookahead_ms(self, context: tuple[int, int]) -> int:
        return round(context[1] * self.frame_seconds * 1000)


# Subsampling stage geometry (NeMo's CausalConv2D for dw_striding): kernel 3, stride 2, pad left 2, right 1.
SUB_KERNEL, SUB_STRIDE, SUB_LEFT, SUB_RIGHT = 3, 2, 2, 1


class ConvSubsampling(nn.Module):
    """NeMo's `ConvSubsampling('dw_striding', is_causal=True)`; `conv` indices match its Sequential."""

    def __init__(self, cfg: FastConformerConfig) -> None:
        super().__init__()
        ch = cfg.subsampling_conv_channels
        layers: list[nn.Module] = [nn.Conv2d(1, ch, SUB_KERNEL, SUB_STRIDE), nn.ReLU()]
        self.stage_slices = [(0, 2)]
        for _ in range(cfg.sampling_num - 1):
            start = len(layers)
            layers += [nn.Conv2d(ch, ch, SUB_KERNEL, SUB_STRIDE, groups=ch), nn.Conv2d(ch, ch, 1), nn.ReLU()]
            self.stage_slices.append((start, len(layers)))
        self.conv = nn.Sequential(*layers)
        freq = cfg.features.features
        for _ in range(cfg.sampling_num):
            freq = (freq + SUB_LEFT + SUB_RIGHT - SUB_KERNEL) // SUB_STRIDE + 1
        self.out = nn.Linear(ch * freq, cfg.d_model)

    def stage(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Stage i on [B, C, T, F] that already holds its time context (no time padding added here)."""
        x = F.pad(x, (SUB_LEFT, SUB_RIGHT, 0, 0))
        start, end = self.stage_slices[i]
        for layer in self.conv[start:end]:
            x = layer(x)
        return x

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T, F'] -> [B, T, d_model]."""
        b, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, c * f))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, mels] -> [B, T', d_model], T' = NeMo's calc_length (floor(T / 2) + 1 per stage)."""
        x = features.unsqueeze(1)
        for i in range(len(self.stage_slices)):
            x = self.stage(i, F.pad(x, (0, 0, SUB_LEFT, SUB_RIGHT)))
        return self.project(x)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, bias: bool) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.silu(self.linear1(x)))


class RelPositionMultiHeadAttention(nn.Module):
    """Transformer-XL attention as NeMo's: scores = ((q + u) k^T + rel_shift((q + v) p^T)) / sqrt(d_k)."""

    def __init__(self, n_heads: int, d_model: int, bias: bool) -> None:
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model, bias=bias)
        self.linear_k = nn.Linear(d_model, d_model, bias=bias)
        self.linear_v = nn.Linear(d_model, d_model, bias=bias)
        self.linear_out = nn.Linear(d_model, d_model, bias=bias)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:
        """[b, h, t1, p] -> [b, h, t1, p]: row i shifted so column j holds relative position (t1 - 1 - i) + j
        counted from the pos_emb's first (most positive) entry; NeMo's exact index trick."""
        b, h, t1, p = x.shape
        x = F.pad(x, (1, 0)).view(b, h, p + 1, t1)
        return x[:, :, 1:].reshape(b, h, t1, p)

    def forward(
        self, query: torch.Tensor, keys: torch.Tensor, pos_emb: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """query [B, T, d]; keys [B, K, d] (cache + query frames, the query frames last); pos_emb [2K - 1, d]
        for relative positions K - 1 .. -(K - 1); allowed [T, K] or [B, T, K] bool."""
        b, t, _ = query.shape
        k_len = keys.shape[1]
        q = self.linear_q(query).view(b, t, self.h, self.d_k)
        k = self.linear_k(keys).view(b, k_len, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(keys).view(b, k_len, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)
        ac = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        bd = self.rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))[..., :k_len]
        scores = (ac + bd) / math.sqrt(self.d_k)
        masked = ~(allowed if allowed.dim() == 3 else allowed.unsqueeze(0)).unsqueeze(1)
        attn = torch.softmax(scores.masked_fill(masked, MASK_VALUE), dim=-1).masked_fill(masked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out)


class ConformerConvolution(nn.Module):
    """pointwise (2d) -> GLU -> causal depthwise (left pad kernel - 1) -> norm -> Swish -> pointwise."""

    def __init__(self, d_model: int, kernel: int, norm_type: str, bias: bool) -> None:
        super().__init__()
        self.norm_type = norm_type
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1, bias=bias)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel, groups=d_model, bias=bias)
        if norm_type == "batch_norm":
            self.batch_norm: nn.Module = nn.BatchNorm1d(d_model)
        elif norm_type == "layer_norm":
            self.batch_norm = nn.LayerNorm(d_model)
        else:
            raise ValueError(f"conv_norm_type {norm_type!r} (batch_norm | layer_norm)")
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1, bias=bias)

    @property
    def context(self) -> int:
        return self.depthwise_conv.kernel_size[0] - 1

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, d, T]: the depthwise conv's input, which the last-time cache keeps."""
        return F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)

    def post(self, x: torch.Tensor) -> torch.Tensor:
        """Depthwise conv over [B, d, context + T] (time context included) -> [B, T, d]."""
        x = self.depthwise_conv(x)
        x = self.batch_norm(x.transpose(1, 2)).transpose(1, 2) if self.norm_type == "layer_norm" else self.batch_norm(x)
        return self.pointwise_conv2(F.silu(x)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(F.pad(self.pre(x), (self.context, 0)))


class ConformerLayer(nn.Module):
    def __init__(self, cfg: FastConformerConfig) -> None:
        super().__init__()
        d, bias = cfg.d_model, cfg.use_bias
        self.norm_feed_forward1 = nn.LayerNorm(d)
        self.feed_forward1 = FeedForward(d, d * cfg.ff_expansion_factor, bias)
        self.norm_self_att = nn.LayerNorm(d)
        self.self_attn = RelPositionMultiHeadAttention(cfg.n_heads, d, bias)
        self.norm_conv = nn.LayerNorm(d)
        self.conv = ConformerConvolution(d, cfg.conv_kernel_size, cfg.conv_norm_type, bias)
        self.norm_feed_forward2 = nn.LayerNorm(d)
        self.feed_forward2 = FeedForward(d, d * cfg.ff_expansion_factor, bias)
        self.norm_out = nn.LayerNorm(d)

    def forward(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        allowed: torch.Tensor,
        att_cache: torch.Tensor | None = None,
        conv_cache: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block over [B, T, d]. Offline: no caches (zero conv context). Streaming: `att_cache` [B, C, d]
        holds earlier attention inputs, `conv_cache` [B, d, kernel - 1] earlier depthwise inputs. Returns the
        output and this call's attention input and depthwise input, from which the caller keeps the tails."""
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        att_in = self.norm_self_att(x)
        keys = att_in if att_cache is None else torch.cat([att_cache, att_in], dim=1)
        x = x + self.self_attn(att_in, keys, pos_emb, allowed)
        conv_in = self.conv.pre(self.norm_conv(x))
        if conv_cache is None:
            conv_cache = conv_in.new_zeros(conv_in.shape[0], conv_in.shape[1], self.conv.context)
        conv_full = torch.cat([conv_cache, conv_in], dim=2)
        x = x + self.conv.post(conv_full)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x), keys, conv_full


class ConformerEncoder(nn.Module):
    def __init__(self, cfg: FastConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pre_encode = ConvSubsampling(cfg)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.n_layers))
        self._pos_cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    @property
    def xscale(self) -> float:
        return math.sqrt(self.cfg.d_model) if self.cfg.xscaling else 1.0

    def pos_emb(self, keys: int, like: torch.Tensor) -> torch.Tensor:
        """Sinusoids [2K - 1, d] for relative positions K - 1 .. -(K - 1) (NeMo's RelPositionalEncoding)."""
        key = (keys, like.device, like.dtype)
        if key not in self._pos_cache:
            positions = torch.arange(keys - 1, -keys, -1, dtype=torch.float32).unsqueeze(1)
            d = self.cfg.d_model
            div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * -(math.log(10000.0) / d))
            pe = torch.zeros(2 * keys - 1, d)
            pe[:, 0::2] = torch.sin(positions * div)
            pe[:, 1::2] = torch.cos(positions * div)
            if len(self._pos_cache) > 8:
                self._pos_cache.clear()
            self._pos_cache[key] = pe.to(like.device, like.dtype)
        return self._pos_cache[key]

    def forward(self, features: torch.Tensor, context: tuple[int, int]) -> torch.Tensor:
        """Offline: [B, T, mels] -> [B, T', d] with the chunked-limited mask for `context` = [left, right]."""
        x = self.pre_encode(features) * self.xscale
        t = x.shape[1]
        allowed = chunked_limited_mask(t, context, x.device)
        pos = self.pos_emb(t, x)
        for layer in self.layers:
            x = layer(x, pos, allowed)[0]
        return x


def chunked_limited_mask(t: int, context: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """[T, T] bool, True = may attend: NeMo's `chunked_limited` style."""
    left, right = context
    chunk = right + 1
    idx = torch.arange(t, device=device) // chunk
    diff = idx.unsqueeze(1) - idx.unsqueeze(0)
    return (diff >= 0) & (diff <= left // chunk)


class ConvASRDecoder(nn.Module):
    def __init__(self, d_model: int, num_classes: int) -> None:
        super().__init__()
        self.decoder_layers = nn.Sequential(nn.Conv1d(d_model, num_classes + 1, 1, bias=True))

    def forward(self, encoded: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, classes + 1] log-probabilities."""
        return torch.log_softmax(self.decoder_layers(encoded.transpose(1, 2)).transpose(1, 2).float(), dim=-1)


class Preprocessor(nn.Module):
    def __init__(self, cfg: FeatureConfig) -> None:
        super().__init__()
        self.featurizer = MelFeaturizer(cfg)


class FastConformerCTC(nn.Module):
    """The whole model; `state_dict()` keys are NeMo's (EncDecCTCModel layout)."""

    def __init__(self, cfg: FastConformerConfig) -> None:
        super().__init__()
        if cfg.subsampling_factor < 2 or 2**cfg.sampling_num != cfg.subsampling_factor:
            raise ValueError(f"subsampling_factor must be a power of 2 >= 2, got {cfg.subsampling_factor}")
        self.cfg = cfg
        self.preprocessor = Preprocessor(cfg.features)
        self.encoder = ConformerEncoder(cfg)
        self.decoder = ConvASRDecoder(cfg.d_model, cfg.vocab_size)
        self.eval().requires_grad_(False)  # inference only: inference-mode tensors may meet the weights anywhere

    @property
    def blank(self) -> int:
        return self.cfg.vocab_size

    def to_runtime(self, device: str | torch.device, dtype: torch.dtype) -> FastConformerCTC:
        """Move the encoder and head; the featurizer stays on CPU in float32 (features are float64 math)."""
        self.encoder.to(device=device, dtype=dtype)
        self.decoder.to(device=device, dtype=dtype)
        return self

    @property
    def device(self) -> torch.device:
        return self.encoder.pre_encode.out.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.pre_encode.out.weight.dtype

    @torch.inference_mode()
    def encode_offline(self, audio: np.ndarray, context: tuple[int, int]) -> torch.Tensor:
        """The reference: one full-sequence forward of a whole signal -> [T', d]."""
        feats = self.preprocessor.featurizer(audio).to(self.device, self.dtype)
        return self.encoder(feats.unsqueeze(0), context)[0]

    @torch.inference_mode()
    def transcribe_offline(self, audio: np.ndarray, context: tuple[int, int]) -> list[int]:
        """Greedy CTC token ids of a whole signal: argmax per frame, collapse repeats, drop blanks."""
        labels = self.decoder(self.encode_offline(audio, context).unsqueeze(0))[0].argmax(-1).tolist()
        return ctc_collapse(labels, self.blank)


def ctc_collapse(labels: list[int], blank: int, previous: int | None = None) -> list[int]:
    """Greedy CTC: drop a label equal to the one before it (`previous` carries it across calls), then blanks."""
    out = []
    for label in labels:
        if label != previous and label != blank:
            out.append(label)
        previous = label
    return out
