"""Compiling kernels.cpp into a library once per machine, and loading it into the process.

Why a build at run time: the library is C++ against this process's torch (its ABI changes between versions), so
it cannot ship prebuilt. It is compiled once into the runtime's cache, in a folder named by a hash of everything
the binary depends on (the source, the compiler flags and version, torch's version, the CPU's flags), and later
processes only load it. The file carries every instruction-set path, each function compiled for its own target
(`__attribute__((target))`), and picks one at run time from the CPU's features (`kernels.cpp`, `best_isa`), so the
AVX2 path stays callable on an AVX-512 machine; the CPU's flags are in the hash only so that a cache copied to
another machine rebuilds rather than trusts a binary built elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.errors import UserError
from runtime.models.loading import cache_dir

SOURCES = (Path(__file__).with_name("kernels.cpp"), Path(__file__).with_name("attention.cpp"))
# -ffp-contract=off: no fused multiply-adds the source did not ask for, so every path rounds alike
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]


class KernelBuildError(UserError):
    """The kernels could not be built or loaded here; the caller falls back to torch's own kernels."""

    code = "kernel_build_failed"


def build_dir() -> Path:
    """Where this machine's build of the kernels lives: `<cache>/kernels/<hash>`."""
    return cache_dir() / "kernels" / _key()


def load_library() -> Path:
    """Build the library if this machine has none yet (saying so on stderr), then load it; its path.

    Raises `KernelBuildError` with the reason when there is no compiler or the build fails."""
    folder = build_dir()
    name = f"runtime_cpu_kernels_{folder.name[:16]}"
    library = folder / f"{name}.so"
    folder.mkdir(parents=True, exist_ok=True)
    # Looked for under the lock: processes starting together (test workers) build once, and none loads the file
    # while another is still writing it (it exists from the linker's first write: "file too short").
    with _locked(folder / ".lock"):
        if not library.exists():
            # torch's own build lock (cpp_extension's `FileBaton`) is a file it removes when the build ends; a builder
            # killed mid-build (a server stopped during its first start, a terminal closed) leaves it behind, and every
            # later build would wait on it for ever. Under our lock nobody else is building: any such file is stale.
            (folder / "lock").unlink(missing_ok=True)
            _build(name, folder)
            return library  # cpp_extension.load has loaded it into this process already
    try:
        torch.ops.load_library(str(library))
    except OSError as err:
        raise KernelBuildError(f"could not load the CPU kernels from {library} ({err}); delete that folder to "
                               "rebuild them") from err
    return library


def _build(name: str, folder: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"the CPU kernels need a C++ compiler ({compiler!r} is not on PATH): install g++ "
                               "(apt-get install g++), or run with torch's own kernels")
    print(f"runtime: building the CPU kernels for this machine (once, about a minute) in {folder}",
          file=sys.stderr, flush=True)
    try:
        cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                           build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as err:  # a compiler error, a missing header: the caller falls back to torch's kernels
        detail = str(err).strip().splitlines()
        raise KernelBuildError(f"the CPU kernels did not build in {folder}: {detail[-1] if detail else err}") from err


def _key() -> str:
    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
                 _compiler_version().encode(), _cpu_flags().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "no compiler"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
