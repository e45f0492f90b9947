"""Reading a transformers Llama/Qwen2 checkpoint without transformers' model classes.

`config.json` becomes a `ModelArgs` and the safetensors weights (one file, or shards listed by
`model.safetensors.index.json`) a state dict under the checkpoint's own names. `transformer.py` uses those
names for its modules except two fusions it builds at load time (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`: one GEMM instead of three or two per layer). Anything the engine does not implement (other
architectures, RoPE scalings beyond none/linear/llama3, sliding-window layers, other activations) is refused
with a one-line `ConfigError` instead of silently computing something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from runtime.errors import CheckpointNotFound, ConfigError

MODEL_TYPES = ("llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {} = plain RoPE; else rope_type + parameters
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048


def _rope(cfg: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """transformers 5 writes `rope_parameters`; older checkpoints write `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        known = ", ".join(ROPE_TYPES)
        raise ConfigError(f"{where}: rope scaling {kind!r} is not supported by the engine (known: {known})")
    if kind == "default":
        return theta, {}
    merged["rope_type"] = kind
    merged.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return theta, merged


def read_config(path: Path) -> ModelArgs:
    """Parse `path/config.json` into ModelArgs; refuse what the engine does not implement."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointNotFound(f"lm checkpoint {path} has no config.json")
    cfg = json.loads(file.read_text())
    where = f"lm checkpoint {path}"
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        known = ", ".join(MODEL_TYPES)
        raise ConfigError(f"{where}: model_type {kind!r} is not supported by the engine (known: {known})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported by the engine (only silu)")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise ConfigError(f"{where}: sliding-window attention layers are not supported by the engine")
    theta, scaling = _rope(cfg, where)
    heads = cfg["num_attention_heads"]
    qwen = kind == "qwen2"
    return ModelArgs(
        model_type=kind,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=True if qwen else bool(cfg.get("attention_bias", False)),  # Qwen2 always has q/k/v biases
        o_bias=False if qwen else bool(cfg.get("attention_bias", False)),
        mlp_bias=False if qwen else bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
    )


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards named by the index, or the single `model.safetensors`."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointNotFound(f"lm checkpoint {path} has no model.safetensors (or model.safetensors.index.json)")


def load_state(path: Path, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All weights, cast to `dtype` on `device`, under their checkpoint names (rotary buffers left out)."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        for name, tensor in load_file(str(file), device=str(device)).items():
            if name.endswith("rotary_emb.inv_freq"):  # older checkpoints saved this buffer; we compute it
                continue
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state
