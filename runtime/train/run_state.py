"""What every training recipe needs to stop and resume exactly: `checkpoint-N/` folders written whole or not at
all, the RNG state, and a step log cut back to the checkpoint it resumes from. Each recipe decides what else
a checkpoint holds (an adapter, a model directory, the optimizer)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _numbered(out: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.name.split("-")[1]), p) for p in out.glob("checkpoint-*")
                  if p.is_dir() and p.name.split("-")[1].isdigit())


def latest_checkpoint(out: Path) -> Path | None:
    found = _numbered(out) if out.is_dir() else []
    return found[-1][1] if found else None


def write_checkpoint(out: Path, step: int, fill: Callable[[Path], None], keep: int | None = None) -> Path:
    """`out/checkpoint-{step}`: `fill` writes into a temporary folder that is then renamed, so a crash never
    leaves a half checkpoint as the latest; with `keep`, only the newest `keep` checkpoints remain."""
    tmp, final = out / f".checkpoint-{step}.tmp", out / f"checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    if keep is not None:
        for _, old in _numbered(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def rng_state() -> dict[str, Any]:
    rng: dict[str, Any] = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def truncate_log(log_path: Path, step: int) -> None:
    """Keep the step log's lines up to `step`: a resumed run rewrites what came after its checkpoint."""
    kept = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] <= step] \
        if log_path.exists() else []
    log_path.write_text("".join(line + "\n" for line in kept))
