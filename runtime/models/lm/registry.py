"""The answering backends by `lm.backend` name. The registry sits above the backends it registers: it imports
them, they never import it."""

from __future__ import annotations

from collections.abc import Callable

from runtime.config import LMConfig
from runtime.errors import ConfigError
from runtime.models.lm.backend import AnswerBackend
from runtime.models.lm.generate_answerer import GenerateAnswerer

BACKENDS = ("generate", "engine", "openai")


def load_answerer(
    cfg: LMConfig,
    *,
    device: str,
    dtype: str,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> AnswerBackend:
    if cfg.backend == "generate":
        return GenerateAnswerer.load(cfg, device=device, dtype=dtype, seed=seed, progress=progress)
    if cfg.backend == "engine":
        from runtime.models.lm.engine_answerer import EngineAnswerer  # lazy: imports the engine's own model

        return EngineAnswerer.load(cfg, device=device, dtype=dtype, seed=seed, progress=progress)
    if cfg.backend == "openai":
        raise ConfigError("lm.backend = openai answers from a server, on the event loop: load it with "
                          "RemoteAnswerer.load (runtime.loaded_models does)")
    raise ConfigError(f"unknown lm.backend {cfg.backend!r} (known: {', '.join(BACKENDS)})")
