"""Profiles: TOML files in `configs/` naming the models, the device and the pipeline's limits, read into the
settings dataclasses of `runtime/config.py`.

A profile is looked up by name in `$RUNTIME_CONFIGS`, `./configs` and the repository's `configs/`, or given
as a path. `--set section.key=value` overrides any field; `--device`/`--dtype` are shortcuts. Unknown
keys are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from runtime.config import Profile, validate
from runtime.errors import ConfigError

C = TypeVar("C")  # a settings dataclass
V = TypeVar("V")  # a setting's value

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# the profile `serve`, `demo`, `transcribe` and `ask` load without --profile: captions, answers and the screen reader
DEFAULT_PROFILE = "demo"


def profile_search_path() -> list[Path]:
    """The directories a profile name is looked up in, first match wins."""
    paths = [Path(p) for p in os.environ.get("RUNTIME_CONFIGS", "").split(os.pathsep) if p]
    return [*paths, Path.cwd() / "configs", REPO_CONFIGS]


def available_profiles() -> list[str]:
    """The names of every profile on the search path, sorted."""
    names = {p.stem for d in profile_search_path() if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


def find_profile(name: str) -> Path:
    """The file of the profile `name`: a path to a .toml file, or a name on the search path."""
    candidate = Path(name)
    if candidate.suffix == ".toml" or os.sep in name:
        if candidate.is_file():
            return candidate
        raise ConfigError(f"profile file {name} does not exist")
    for directory in profile_search_path():
        path = directory / f"{name}.toml"
        if path.is_file():
            return path
    known = ", ".join(available_profiles()) or "none"
    raise ConfigError(f"unknown profile {name!r} (known: {known}); or pass a path to a .toml file")


def _build(cls: type[C], data: dict[str, object], where: str) -> C:
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        default = getattr(cls(), key)
        if is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}.{key} must be a table")
            kwargs[key] = _build(type(default), value, f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, default, f"{where}.{key}")
    return cls(**kwargs)


def _coerce(value: object, default: V, where: str) -> V:
    """Accept the default's type; an int where a float is expected is widened. bool is never an int here."""
    kind = type(default)
    if isinstance(value, bool) != (kind is bool):
        raise ConfigError(f"{where} must be a {kind.__name__}, got {value!r}")
    if kind is float and isinstance(value, int):
        return float(value)
    if kind is float and isinstance(value, float) and not math.isfinite(value):  # TOML reads nan and inf
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    if isinstance(value, kind):
        return value
    raise ConfigError(f"{where} must be a {kind.__name__}, got {value!r}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`asr.model=/path` -> (["asr", "model"], "/path"); values are read as TOML, else as a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def profile_data(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The TOML tables of the profile at `path`, over those of the profile it `extends` (a name or path): a
    profile that differs from another in a few settings says only those. Its own name, description and cost are
    never inherited."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"profile {path}: {err}") from None
    base_name = data.pop("extends", None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise ConfigError(f"profile {path}: extends must be a profile name, got {base_name!r}")
    base_path = find_profile(base_name)
    if base_path.resolve() in seen:
        raise ConfigError(f"profile {path}: extends {base_name!r}, which extends it back")
    base = {k: v for k, v in profile_data(base_path, (*seen, path.resolve())).items()
            if k not in ("name", "description", "cost")}
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def load_profile(
    name: str = "tiny",
    *,
    overrides: list[str] | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> Profile:
    """The profile `name` (or path) with its `extends`, `--set` overrides and --device/--dtype applied,
    validated."""
    path = find_profile(name)
    data = profile_data(path)
    data.setdefault("name", path.stem)
    for text in overrides or []:
        keys, value = parse_override(text)
        table = data
        for key in keys[:-1]:
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                raise ConfigError(f"--set {text}: {key} is not a table")
        table[keys[-1]] = value
    if device is not None:
        data["device"] = device
    if dtype is not None:
        data["dtype"] = dtype
    profile = _build(Profile, data, f"profile {path.stem}")
    return validate(profile)
