"""The project's own FastConformer-CTC checkpoint: a directory small enough to ship in the repository.

    model.safetensors   the state dict under NeMo's parameter names (the same names `.nemo` archives use, so
                        `nemo.load_weights` checks it), float32
    config.json         {"format", "version", "model": FastConformerConfig fields, "features": FeatureConfig
                        fields, "trained_contexts": [[left, right], ...], "trained_lookahead_ms": [...], "training"}
    tokenizer.json      the `tokenizers`-library tokenizer (`CTCTokenizer.to_json`)

Why not only `.nemo`: a tar of a pickled state dict is opaque to review and diff, and `torch.load` of it is a
pickle; safetensors + JSON can be read, checked and size-audited without running code, which is what a
checkpoint committed to the repository should be. `.nemo` stays supported for NeMo's own checkpoints, and
`save_nemo` can still export a trained model. `FastConformerASR.load` takes either (stream.find_checkpoint).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from runtime.errors import ConfigError
from runtime.models.asr.fastconformer.features import FeatureConfig
from runtime.models.asr.fastconformer.model import FastConformerConfig, FastConformerCTC
from runtime.models.asr.fastconformer.nemo import load_weights
from runtime.models.asr.fastconformer.tokenizer import CTCTokenizer

FORMAT, VERSION = "fastconformer-ctc", 1
WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE = "model.safetensors", "config.json", "tokenizer.json"
CHECKPOINT_FILES = (WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE)


def is_checkpoint_dir(path: Path) -> bool:
    """True when `path` is a directory holding this format's weights and config (the tokenizer is checked on load)."""
    path = Path(path)
    return path.is_dir() and (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file()


def config_to_dict(cfg: FastConformerConfig) -> dict[str, Any]:
    """JSON-ready config: model fields (contexts as lists) and the feature fields in their own section."""
    model = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "features"}
    model["att_context_sizes"] = [list(c) for c in cfg.att_context_sizes]
    features = asdict(cfg.features)
    for key in ("fixed_mean", "fixed_std"):
        if features[key] is not None:
            features[key] = list(features[key])
    return {"model": model, "features": features}


def config_from_dict(data: dict[str, Any], *, where: str = CONFIG_FILE) -> FastConformerConfig:
    """The inverse of `config_to_dict`; unknown keys are refused so a typo never silently becomes a default."""
    model, feats = dict(data.get("model") or {}), dict(data.get("features") or {})
    known_model = {f.name for f in fields(FastConformerConfig)} - {"features"}
    known_feats = {f.name for f in fields(FeatureConfig)}
    unknown = sorted(set(model) - known_model) + sorted(f"features.{k}" for k in set(feats) - known_feats)
    if unknown:
        raise ConfigError(f"{where}: unknown config keys {', '.join(unknown)}")
    if "vocab_size" not in model:
        raise ConfigError(f"{where}: model.vocab_size is missing")
    for key in ("fixed_mean", "fixed_std"):
        if feats.get(key) is not None:
            feats[key] = tuple(float(v) for v in feats[key])
    if "att_context_sizes" in model:
        try:
            model["att_context_sizes"] = tuple((int(a), int(b)) for a, b in model["att_context_sizes"])
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: model.att_context_sizes must be a list of [left, right]") from None
    try:
        return FastConformerConfig(**model, features=FeatureConfig(**feats))
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


def save_checkpoint(
    model: FastConformerCTC, tokenizer: CTCTokenizer, directory: Path, *, training: dict[str, Any] | None = None
) -> Path:
    """Write `directory` (created if needed) with the three files; float32 on CPU whatever the model's device.
    `training` (steps, data, seed, ...) is recorded in config.json for the model card, never read back."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's head {model.cfg.vocab_size}")
    state = {k: (v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": FORMAT})
    config = {
        "format": FORMAT,
        "version": VERSION,
        **config_to_dict(model.cfg),
        "trained_contexts": [list(c) for c in model.cfg.att_context_sizes],
        "trained_lookahead_ms": [model.cfg.lookahead_ms(c) for c in model.cfg.att_context_sizes],
        "training": training or {},
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    (directory / TOKENIZER_FILE).write_text(tokenizer.to_json(), encoding="utf-8")
    return directory


def load_checkpoint(directory: Path) -> tuple[FastConformerCTC, CTCTokenizer]:
    """Read a checkpoint directory into our model (fp32, CPU, eval) and its tokenizer, with one-line errors that
    name the file at fault."""
    directory = Path(directory)
    missing = [name for name in CHECKPOINT_FILES if not (directory / name).is_file()]
    if missing:
        raise ConfigError(f"{directory}: not a FastConformer checkpoint directory (missing {', '.join(missing)})")
    try:
        data = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{directory / CONFIG_FILE}: unreadable ({err})") from None
    where = directory / CONFIG_FILE
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise ConfigError(f"{where}: format is {found!r}, expected {FORMAT!r}")
    if int(data.get("version", 0)) > VERSION:
        raise ConfigError(f"{where}: version {data['version']} is newer than this runtime's {VERSION}")
    config = config_from_dict(data, where=str(directory / CONFIG_FILE))
    try:
        tokenizer = CTCTokenizer.from_json((directory / TOKENIZER_FILE).read_text(encoding="utf-8"))
    except Exception as err:  # a corrupt tokenizer: say which file
        raise ConfigError(f"{directory / TOKENIZER_FILE}: unreadable tokenizer ({err})") from None
    if tokenizer.vocab_size != config.vocab_size:
        raise ConfigError(f"{directory}: tokenizer has {tokenizer.vocab_size} tokens, the CTC head {config.vocab_size}")
    try:
        state = load_file(str(directory / WEIGHTS_FILE), device="cpu")
    except Exception as err:  # safetensors raises its own error types
        raise ConfigError(f"{directory / WEIGHTS_FILE}: unreadable safetensors file ({err})") from None
    model = FastConformerCTC(config)
    load_weights(model, {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, "decoder",
                 where=str(directory / WEIGHTS_FILE))
    return model, tokenizer
