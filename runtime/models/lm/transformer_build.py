"""Building our `Transformer` from a checkpoint: a safetensors directory, a GGUF file (its own 4-bit and 8-bit
blocks kept where the weight format allows, never dequantised first), or the packed cache's saved state.

Apart from the model because loading is its own concern: names and fusions of the checkpoints' tensors, shape checks
with errors that name the file, weight formats made layer by layer so that no float copy of the whole model is
held, and the meta device so that nothing is initialised at random first. `transformer.py` is the network alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from runtime.errors import CheckpointNotFound
from runtime.models.lm.gguf_checkpoint import gguf_file, open_gguf
from runtime.models.lm.kernel_linears import PackedEmbedding, on_runtime_kernels
from runtime.models.lm.transformer import Transformer, rope_inv_freq
from runtime.models.lm.weight_formats import (
    QUANTIZED,
    Block8Source,
    BlockSource,
    empty_like_state,
    format_dtype,
    quantize_linears,
)
from runtime.models.lm.weights import ModelArgs, load_state, read_config

FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpoint names to ours, in place: each layer's q/k/v_proj become `qkv_proj` and gate/up_proj
    `gate_up_proj` (weights and biases concatenated along the output dimension, in that order)."""
    layers = {name.split(".")[2] for name in state if name.startswith("model.layers.")}
    for i in sorted(layers):
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    state[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([state.pop(name) for name in names])
    return state


def built_from_blocks(four_bit: Callable[[str], bool], args: ModelArgs) -> frozenset[str]:
    """The checkpoint weights the int4 layers are built from their own 4-bit blocks (`four_bit(name)`), so that their
    float values are never needed: a projection's, or a fused projection's when every part is 4-bit; the head's
    when it is not tied to the embeddings (which stay float)."""
    names = set()
    for i in range(args.num_layers):
        stem = f"model.layers.{i}."
        groups = [[f"{stem}{p}.weight" for p in parts] for parts in FUSED.values()]
        groups += [[f"{stem}self_attn.o_proj.weight"], [f"{stem}mlp.down_proj.weight"]]
        names.update(n for g in groups if all(four_bit(p) for p in g) for n in g)
    if not args.tie_word_embeddings and four_bit("lm_head.weight"):
        names.add("lm_head.weight")
    return frozenset(names)


def load_transformer(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     weights: str = "auto", kernels: bool = False) -> Transformer:
    """Build from `config.json` and the safetensors weights, or from a GGUF file (`gguf_checkpoint`), in the
    weight format `weights` (`weight_formats`: auto keeps `dtype`); `kernels`: its int8/int4 layers on the
    runtime's own CPU kernels (`kernel_linears`) rather than torch's."""
    path = Path(path)
    if (file := gguf_file(path)) is not None:
        ckpt = open_gguf(file)
        # cast tensor by tensor (no float32 copy of all); weights int4 takes from their blocks not dequantised
        skip = built_from_blocks(ckpt.four_bit, ckpt.args) if weights in ("int4", "native") else frozenset()
        # the state is transformer_from_state's alone: each float weight goes as soon as its int8/int4 layer is made
        return transformer_from_state(ckpt.args, ckpt.state_dict(format_dtype(weights, dtype), skip=skip),
                                      where=str(file), device=device, dtype=dtype, weights=weights,
                                      blocks=ckpt.q4_blocks, blocks8=ckpt.q8_blocks, kernels=kernels)
    args = read_config(path)
    state = load_state(path, device=device, dtype=format_dtype(weights, dtype))
    return transformer_from_state(args, state, where=str(path), device=device, dtype=dtype, weights=weights,
                                  kernels=kernels)


def _pack_embeddings(model: Transformer, weights: str, blocks: BlockSource | None,
                     blocks8: Block8Source | None) -> None:
    """The embeddings kept in the file's own blocks where they are 4-bit (formats int4 and native) or 8-bit Q8_0/Q5_0
    (`kernel_linears.PackedEmbedding`); any other storage stays a float table."""
    name = "model.embed_tokens.weight"
    own = (blocks(name) if blocks is not None and weights != "int8" else None) or (
        blocks8(name) if blocks8 is not None else None)
    if own is not None:
        model.model.embed_tokens = PackedEmbedding.from_blocks(own, model.dtype)


def transformer_from_packed(args: ModelArgs, state: dict[str, Tensor], *, weights: str) -> Transformer:
    """Rebuild a model from its own `state_dict` (int8/int4 layers included; `packed_weights` saves them),
    on the CPU, without repacking anything."""
    with torch.device("meta"):
        model = Transformer(args)
    empty_like_state(model, state, format_dtype(weights, torch.float32))
    if args.tie_word_embeddings and type(model.lm_head) is nn.Linear and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # a quantised head has its own buffers
    model.load_state_dict(state, strict=True, assign=True)
    if args.tie_word_embeddings and type(model.lm_head) is nn.Linear:  # a float head reads the embeddings
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args)
    model.weights = weights
    model.kernel_attention = on_runtime_kernels(model)
    return model.eval().requires_grad_(False)


def transformer_from_state(args: ModelArgs, state: dict[str, Tensor], *, where: str, device: str | torch.device,
                           dtype: torch.dtype, weights: str = "auto", blocks: BlockSource | None = None,
                           blocks8: Block8Source | None = None, kernels: bool = False) -> Transformer:
    """Build from a checkpoint's state dict (transformers' names), without random init (meta device); q/k/v
    and gate/up are fused here, once (`fuse_projections`); int8/int4 projections are made last, from the
    float weights or, for int4, from the checkpoint's own 4-bit blocks (`blocks`)."""
    dtype = format_dtype(weights, dtype)
    with torch.device("meta"):
        model = Transformer(args)
    state = {k: v if v.is_meta else v.to(device=device, dtype=torch.float32 if k.endswith("norm.weight") else dtype)
             if v.is_floating_point() else v.to(device) for k, v in state.items()}  # norms: see RMSNorm
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = fuse_projections(state)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    wrong = [f"{k} {tuple(state[k].shape)} (config: {expected[k]})" for k in sorted(expected.keys() & state.keys())
             if tuple(state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        what = (f"lacks {missing[:3]}" if missing else f"has unexpected {unexpected[:3]}" if unexpected
                else f"has weights of the wrong shape: {wrong[:2]}")
        raise CheckpointNotFound(f"lm checkpoint {where} {what} (a {args.model_type} checkpoint was expected)")
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()  # the model holds each weight now; a float one goes when quantize_linears replaces its layer
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args).to(device)
    if weights in QUANTIZED:
        quantize_linears(model, weights, blocks=blocks, blocks8=blocks8, fused=FUSED, kernels=kernels)
        if kernels:
            _pack_embeddings(model, weights, blocks, blocks8)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError(f"lm checkpoint {where}: weights left unread after building the {weights} format")
    model.weights = weights
    model.kernel_attention = on_runtime_kernels(model)
    return model.eval().requires_grad_(False)
