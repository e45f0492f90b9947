"""Whisper's vocabulary projection in weight-only int8 (`asr.head_weights = "int8"`), for greedy decoding on a CPU,
and the decoder layers' other linears likewise (`asr.decoder_weights = "int8"`, `Int8DecoderLinear`).

Why: every decoder step of Whisper ends in the vocabulary projection, tied to the token embedding: tiny.en's is
51,864 x 384 weights, 80 MB in float32 (40 MB in bfloat16), bigger than the CPU's last-level cache, so each step
reads it from memory again. The causal stream runs that step for every token and for every block's re-check of
its unstable tail, and the `offline` final pass for every token: a profile of the stream on a human clip put 60 %
of its time in this one matrix product. In int8 (one symmetric scale per vocabulary row, the
`lm.weights = "int8"` format of the answerer: `weight_formats.Int8Linear`) it is 20 MB, and torch's CPU kernel
`_weight_int8pack_mm` reads it with bfloat16 activations about ten times faster than the float32 product on one
core (1.2 ms against 14 ms here). The logits come back in float32. What it costs in accuracy is measured by
`runtime bench asr-quality` (docs/model_card_causal_whisper.md); the exactness tests of the stream keep the
float head.

Only CPUs: elsewhere the head stays as the model has it (the kernel's fast path is a CPU one, and a GPU reads
80 MB in well under a millisecond).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import WhisperForConditionalGeneration

from runtime.errors import ConfigError
from runtime.models.lm.weight_formats import Int8Linear

HEAD_WEIGHTS = ("", "int8")  # "": the model's own head, in its dtype


class Int8Head(nn.Module):
    """`x @ weight.T` with `weight` [vocab, d] quantised per row to int8; float32 logits."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.linear = Int8Linear.quantize(weight.detach(), None, torch.bfloat16)
        self.in_features, self.out_features = self.linear.in_features, self.linear.out_features

    def dequantized(self) -> Tensor:
        """The weight [vocab, d] the head multiplies by (float32): a float reference computes the same logits."""
        return self.linear.dequantized()

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.to(torch.bfloat16)).float()


def check_head(kind: str) -> str:
    if kind not in HEAD_WEIGHTS:
        raise ConfigError(f"asr.head_weights={kind!r} is not one of {', '.join(repr(k) for k in HEAD_WEIGHTS)}")
    return kind


def quantize_head(model: WhisperForConditionalGeneration, kind: str) -> WhisperForConditionalGeneration:
    """`model` with its vocabulary projection in `kind` (in place; the token embedding it was tied to stays as it
    is). Call it after any adapter is merged and the model is on its device; a no-op off the CPU and for ""."""
    if check_head(kind) == "int8" and model.device.type == "cpu" and not isinstance(model.proj_out, Int8Head):
        model.proj_out = Int8Head(model.proj_out.weight)
    return model


# `asr.decoder_weights`: the decoder layers' other linears (self-attention q/k/v/out, cross-attention q/out,
# fc1/fc2) in weight-only int8 too. The cross-attention k/v projections stay float: they read the encoder frames
# (a turn's 1500 once, or a block's few), not a token, and a [frames, d] product is compute-bound, not read-bound.
DECODER_WEIGHTS = ("float", "int8")
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                   "encoder_attn.q_proj", "encoder_attn.out_proj", "fc1", "fc2")


class Int8DecoderLinear(nn.Module):
    """`x @ weight.T + bias` with `weight` [out, in] quantised per row to int8: the product in bfloat16 activations,
    rounded to bfloat16, returned in `x`'s dtype, then the (float) bias added."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = Int8Linear.quantize(linear.weight.detach(), None, torch.bfloat16)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = self.linear.in_features, self.linear.out_features

    def dequantized(self) -> Tensor:
        """The weight [out, in] the layer multiplies by (float32)."""
        return self.linear.dequantized()

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x.to(torch.bfloat16)).to(x.dtype)
        return y if self.bias is None else y + self.bias


def check_decoder(kind: str) -> str:
    if kind not in DECODER_WEIGHTS:
        raise ConfigError(f"asr.decoder_weights={kind!r} is not one of {', '.join(repr(k) for k in DECODER_WEIGHTS)}")
    return kind


def quantize_decoder(model: WhisperForConditionalGeneration, kind: str) -> WhisperForConditionalGeneration:
    """`model` with its decoder layers' `DECODER_LINEARS` in `kind` (in place). As `quantize_head`: after any
    adapter is merged and the model is on its device; a no-op off the CPU and for "float"."""
    if check_decoder(kind) != "int8" or model.device.type != "cpu":
        return model
    for layer in model.model.decoder.layers:
        for name in DECODER_LINEARS:
            parent, _, attr = name.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            linear = getattr(owner, attr)
            if isinstance(linear, nn.Linear):
                setattr(owner, attr, Int8DecoderLinear(linear))
    return model
