"""Compiled decode steps kept on disk: a process reads in about 2 s the step another process compiled in 25-60 s.

Why: torch's own on-disk caches do not serve a step compiled ahead (`aot_compile`, compiled_step.py) to another
process. The compiled function's backend id carries a uuid4 (torch 2.13, `OutputGraph`), and precompiled graphs key
the AOTAutograd cache with it, so every new process (a test worker, `runtime ask`, a benchmark's child, a server
start) traced and lowered the step again: SmolLM2-135M's int4 step took 25 s with inductor's cache warm on the Zen 4,
and read back from here 2.2 s, its logits bitwise the freshly compiled step's. Torch's precompile API writes an
ahead-compiled function (`save_compiled_function`) and reads it back given the objects it closes over
(`external_closure_data`): here the model, whose weights the step reads at every call and never bakes in.

What may reuse a file: its name hashes everything the compiled code assumes (`step_key`): torch's and Python's
versions, the vector ISA inductor generated code for and the one ATen dispatches to, the source of the model code
it traced (this package, the runtime's C++ kernels among it), the model's structure (each module's type and
scalar settings, each parameter's and buffer's name, shape, dtype and strides), the step's input key
(`compiled_step._key`: shapes, strides, dtypes, device, OpenMP threads) and the compile options. A file that does
not read back (another build of torch, a torn write), or reads back and fails its first run on copies of the inputs
(`CompiledStep._ahead`), is compiled anew and written again; a step that cannot be
written (an object torch cannot serialize) is used as compiled and not kept. Files are written whole and renamed
into place (`save_compiled_function` does), so processes sharing the folder never read half a file. Every change to
the model code names new files, so the folder keeps the `KEEP` most recently used (0.5-4 MB each) and drops the rest
when it writes one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)
_SOURCES = Path(__file__).parent  # the model code a step traces: this package, its C++ kernels included
_SCALARS = (bool, int, float, str, torch.dtype)
KEEP = 32  # files the store keeps, the most recently used (`StepStore.save`)


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted([*_SOURCES.glob("*.py"), *_SOURCES.glob("cpu_kernels/*.py"),
                        *_SOURCES.glob("cpu_kernels/*.cpp")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _model_signature(model: nn.Module) -> str:
    """Each module's type and scalar settings (eps, scale, group sizes: constants in the compiled code) and each
    parameter's and buffer's name, shape, dtype and strides; never the weights' values (the step reads them)."""
    lines = []
    for name, module in model.named_modules():
        scalars = sorted((k, v) for k, v in vars(module).items() if isinstance(v, _SCALARS))
        lines.append(f"{name}:{type(module).__qualname__}:{scalars}")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        lines.append(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.stride()}")
    return "\n".join(lines)


def step_key(model: nn.Module, kind: str, key: tuple[object, ...], options: dict[str, object]) -> str:
    """The file name of `kind` (a step function's name) compiled for `model` and input `key` (module docstring)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    args = getattr(model, "args", None)
    parts = [kind, torch.__version__, sys.version, str(pick_vec_isa()), torch.backends.cpu.get_cpu_capability(),
             _source_digest(), repr(args), repr(sorted(options.items())), repr(key), _model_signature(model)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32] + ".step"


class StepStore:
    """A folder of compiled steps (`step_key` names them), shared by every process that uses it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.loaded = 0  # steps read back (tests and logs say whether the store served)
        self.saved = 0

    def load(self, name: str, model: nn.Module) -> Callable[..., torch.Tensor] | None:
        """The step stored as `name`, reading `model`'s weights, its guard check off; None when there is none or it
        does not read back (it is then compiled and written again)."""
        path = self.folder / name
        if not path.is_file():
            return None
        try:
            from torch._dynamo.aot_compile import AOTCompiledFunction

            step = AOTCompiledFunction.deserialize(path.read_bytes(), external_closure_data={"model": model})
        except Exception as err:  # another torch's file, a truncated one: compile it again
            log.warning("lm.compile: the stored step %s did not read back (%s); compiling it again", path,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return None
        step.disable_guard_check()
        self.loaded += 1
        try:
            os.utime(path)  # used: the last to go (`_prune`)
        except OSError:
            pass
        return step

    def save(self, name: str, step: object, model: nn.Module) -> None:
        """Keep `step` (an ahead-compiled function closing over `model`) as `name`; a step torch cannot write is
        logged and not kept."""
        save = getattr(step, "save_compiled_function", None)
        if save is None:  # a torch without ahead compilation: the guarded step, nothing to keep
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save(str(self.folder / name), external_data={"model": model})
        except Exception as err:
            log.warning("lm.compile: the compiled step could not be kept in %s (%s); the next process compiles it "
                        "again", self.folder, str(err).splitlines()[0] if str(err) else type(err).__name__)
            return
        self.saved += 1
        self._prune()

    def _prune(self) -> None:
        """Keep the `KEEP` files used last (written or read back); older ones, steps of model code since changed or
        a write torn by a killed process, are removed. Another process removing the same file is no error."""
        try:
            files = sorted((p for p in self.folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime,
                           reverse=True)
        except OSError:
            return
        for old in files[KEEP:]:
            old.unlink(missing_ok=True)
