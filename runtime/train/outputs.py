"""The output folder every `runtime train` recipe writes into, made (or checked) before any slow work.

Kept apart from `run_state.py` (which needs torch) so that `synth-speech`, which never imports torch, can use it.
"""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ConfigError


def out_folder(path: Path, flag: str = "--out", create: bool = True) -> Path:
    """Make the output folder `path` (with its parents), or with `create=False` only check that it could be
    made, and turn what the file system refuses into one line naming the flag. Recipes call it before their
    slow work, so a mistyped --out fails at once rather than as a traceback after the data was loaded."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"cannot create {flag} {path}: {blocker} is a file, not a folder")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot create {flag} {path}: {err.strerror or err}") from None
    return path
