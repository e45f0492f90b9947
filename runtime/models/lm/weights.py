"""Reading a transformers Llama/Qwen2 checkpoint without transformers' model classes.

`config.json` becomes a `ModelArgs` and the safetensors weights (one file, or shards listed by
`model.safetensors.index.json`) a state dict under the checkpoint's own names. `transformer.py` uses those
names for its modules except two fusions it builds at load time (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`: one GEMM instead of three or two per layer). Anything the engine does not implement (other
architectures, RoPE scalings beyond none/linear/llama3, sliding-window layers, other activations) is refused
with a one-line `ConfigError` instead of silently computing something else.

A vision-language checkpoint (LLaVA-OneVision) is read the same way: its `text_config` is the language
model's config and `lm_name` maps its language-model weights onto the plain names (both the hub layout,
`language_model.model.*`, and the one transformers 5 saves, `model.language_model.*`); the vision tower's
weights are left for `runtime.models.vlm` and never loaded here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from runtime.errors import CheckpointNotFound, ConfigError

MODEL_TYPES = ("llama", "qwen2")
VLM_TYPES = ("llava_onevision",)  # vision-language checkpoints whose language model the engine runs
# (prefix in the checkpoint, prefix in the plain layout) for a VLM's language-model weights, most specific first
_LM_PREFIXES = (
    ("model.language_model.", "model."),  # transformers 5 save_pretrained
    ("language_model.model.", "model."),  # the hub's llava-hf layout
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
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
    if cfg.get("model_type") in VLM_TYPES:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", "qwen2")
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        cfg, where = text, f"{where} (its text_config)"
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


def is_vlm(path: Path) -> bool:
    """True when `path/config.json` describes a vision-language model this project can run."""
    file = Path(path) / "config.json"
    return file.is_file() and json.loads(file.read_text()).get("model_type") in VLM_TYPES


def lm_name(name: str) -> str | None:
    """A checkpoint weight's name in the plain causal-LM layout, or None when it is not a language-model weight
    (a VLM's vision tower and projector). Plain checkpoints' names pass through unchanged."""
    if name.endswith("rotary_emb.inv_freq"):  # older checkpoints saved this buffer; we compute it
        return None
    for old, new in _LM_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    if name.startswith(("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                        "multi_modal_projector.", "model.image_newline", "image_newline")):
        return None
    return name


def load_state(path: Path, *, device: str | torch.device, dtype: torch.dtype,
               rename: Callable[[str], str | None] = lm_name) -> dict[str, torch.Tensor]:
    """The weights `rename` keeps (by default the language model's), cast to `dtype` on `device`, under the
    names it gives. Only those tensors are read from disk."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                new = rename(name)
                if new is None:
                    continue
                tensor = f.get_tensor(name)
                state[new] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state
