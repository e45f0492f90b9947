"""Where the human development clips are: `$RUNTIME_SPEECH_DEV`, else `../shared/speech/dev` beside the repository
(where CI lays shared/). They live outside the repository, so a clone without them skips the tests that read
them, saying where it looked, instead of failing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile

REPO = Path(__file__).resolve().parents[1]


def dev_folder() -> Path:
    folder = Path(os.environ.get("RUNTIME_SPEECH_DEV") or REPO.parent / "shared" / "speech" / "dev")
    if not has_dev_clips():
        pytest.skip(f"no human development clips at {folder} (set RUNTIME_SPEECH_DEV)")
    return folder


def has_dev_clips() -> bool:
    folder = Path(os.environ.get("RUNTIME_SPEECH_DEV") or REPO.parent / "shared" / "speech" / "dev")
    return (folder / "manifest.jsonl").is_file()


def dev_rows() -> list[dict]:
    folder = dev_folder()
    return [{**json.loads(line), "file": folder / json.loads(line)["path"]}
            for line in (folder / "manifest.jsonl").read_text().splitlines() if line.strip()]


def dev_clips() -> list[tuple[str, np.ndarray, str]]:
    """(id, 16 kHz float32 audio, transcript) of each clip."""
    clips = []
    for row in dev_rows():
        audio, rate = soundfile.read(row["file"], dtype="float32")
        assert rate == 16000
        clips.append((row["id"], audio, row["text"]))
    return clips
