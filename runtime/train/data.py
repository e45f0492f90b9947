"""Training data: a folder of audio files, each with a same-named `.txt` transcript beside it.

`clip.wav` + `clip.txt`, `talk.flac` + `talk.txt`, ...: any audio soundfile or PyAV reads; decoded once into
float32 mono 16 kHz (the pipeline's format) so training sees exactly what the stream will. Clips are limited
to the 30 s the encoder holds; a problem with a file is reported with the file named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError, MediaError
from runtime.io.rechunk import to_mono_float32

MAX_SECONDS = 30.0


@dataclass(frozen=True)
class Example:
    path: Path
    audio: np.ndarray  # float32 mono 16 kHz
    text: str


def load_audio(path: Path) -> np.ndarray:
    """float32 mono 16 kHz: soundfile for 16 kHz files it reads, else PyAV (any container, resampled)."""
    try:
        import soundfile

        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        if rate == SAMPLE_RATE:
            return to_mono_float32(data, channels_last=True)
    except Exception:  # not a format libsndfile reads: PyAV below
        pass
    import av

    try:
        pieces = []
        with av.open(str(path)) as container:
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in [*container.decode(audio=0), None]:
                pieces += [out.to_ndarray().reshape(-1) for out in resampler.resample(frame)]
    except (av.FFmpegError, OSError, ValueError, IndexError) as err:
        raise MediaError(f"cannot read training audio {path}: {err}") from None
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def load_examples(folder: str | Path) -> list[Example]:
    """Every audio file in `folder` (recursively) that has a `.txt` beside it, sorted by path."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(f"training data {root} is not a directory")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    audio_for = {}
    for p in files:
        if p.suffix != ".txt":
            audio_for.setdefault((p.parent, p.stem), p)
    examples = []
    for txt in (p for p in files if p.suffix == ".txt"):
        audio = audio_for.get((txt.parent, txt.stem))
        if audio is None:
            continue
        samples = load_audio(audio)
        if len(samples) == 0 or len(samples) > MAX_SECONDS * SAMPLE_RATE:
            raise MediaError(f"training audio {audio} must be 0-{MAX_SECONDS:g} s long, "
                             f"got {len(samples) / SAMPLE_RATE:.1f} s")
        examples.append(Example(audio, samples, txt.read_text(encoding="utf-8").strip()))
    if not examples:
        raise ConfigError(f"no training pairs in {root}: expected audio files with same-named .txt transcripts")
    return examples
