"""A GGUF model repacked into the engine's int8/int4 layouts once, kept in the runtime's cache, read back after.

Why: building the int4 model of Qwen2.5-Coder-1.5B from its GGUF file took about a minute on 2 cores: gguf's
reader walks the 151,646-token vocabulary and its merges in Python (17 s), the 5- to 8-bit tensors are
dequantised in numpy and quantised again, and every 4-bit block is unpacked and packed into torch's kernel layout.
None of it depends on anything but the file, the format and the torch build, so the result (the model's own
`state_dict`: packed int4 buffers, int8 weights and scales, bf16 embeddings, float32 norms) is saved once as
safetensors beside its `ModelArgs`, and a later load is a read of that file.

The key (`packed_file`) is the file's name, size and modification time, the weight format and activations' dtype,
the torch version and the CPU capability torch's kernels were chosen for (the packed int4 layout is the CPU
kernel's own), and `VERSION`, raised when the packing changes. A file that does not match any of those is packed
again; an older packing of the same file and format is removed then. Writes go to a temporary file renamed into
place, and processes started together pack once: the others wait on its build lock (`build_lock`) and read it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from runtime.models.build_lock import building, lock_path
from runtime.models.lm.gguf_checkpoint import close_gguf_files, gguf_file
from runtime.models.lm.transformer import Transformer
from runtime.models.lm.transformer_build import load_transformer, transformer_from_packed
from runtime.models.lm.weight_formats import QUANTIZED, format_dtype
from runtime.models.lm.weights import ModelArgs
from runtime.models.loading import cache_dir

VERSION = 2  # 2: embeddings in the file's own blocks (kernel_linears.PackedEmbedding)
PACKED_FORMATS = QUANTIZED  # the formats whose build from a GGUF file repacks every weight
SPARE = 512 << 20  # bytes a packing leaves free on its disk: a cache that fills the disk breaks everything beside it


def packed_file(file: Path, weights: str, dtype: torch.dtype, kernels: bool = False) -> Path:
    """Where the packed form of GGUF `file` in format `weights` is kept (see the module docstring for the key);
    `kernels`: on the runtime's own kernels (their layout does not depend on the CPU; torch's int4 may)."""
    stat = file.stat()
    cpu = "rk" if kernels else torch.backends.cpu.get_cpu_capability().lower()
    dt = str(format_dtype(weights, dtype)).removeprefix("torch.")
    key = f"{file.stem}-{stat.st_size}-{stat.st_mtime_ns}-{weights}-{dt}-torch{torch.__version__}-{cpu}-v{VERSION}"
    return cache_dir() / "packed-lm" / f"{key}.safetensors"


def load_model(path: Path, *, device: str | torch.device, dtype: torch.dtype, weights: str, kernels: bool = False,
               progress: Callable[[str], None] | None = None) -> Transformer:
    """`load_transformer(path, ...)`, through the packed cache when `path` is a GGUF file loaded to the
    CPU in an int8/int4 format: read back when packed before, else built and saved for the next load."""
    file = gguf_file(path)
    if file is None or weights not in PACKED_FORMATS or torch.device(device).type != "cpu":
        return load_transformer(path, device=device, dtype=dtype, weights=weights, kernels=kernels)
    target = packed_file(file, weights, dtype, kernels)
    if (model := _read_if_packed(target, weights, progress)) is not None:
        return model
    with building(target, progress):  # processes started together: one packs, the others read its file after
        if (model := _read_if_packed(target, weights, progress)) is not None:
            return model
        if progress is not None:
            progress(f"packing {file.name} into {weights} once (read back from {target.parent} after) ...")
        start = time.perf_counter()
        model = load_transformer(path, device=device, dtype=dtype, weights=weights, kernels=kernels)
        try:
            write_packed(model, target)
        except OSError as err:  # a read-only or full cache: this load still works, the next one packs again
            if progress is not None:
                progress(f"could not keep the packed weights in {target.parent} ({err})")
        else:
            for old in target.parent.glob(f"{file.stem}-*-{weights}-*.safetensors"):
                if old != target and ("-rk-" in old.name) == kernels:
                    old.unlink(missing_ok=True)
                    lock_path(old).unlink(missing_ok=True)
            # served as a warm cache serves it: the packing read the whole GGUF file, whose pages stayed resident
            # while anything kept it mapped (the model's views of its blocks, the open files): 1.2 GB over a warm
            # load for the 1.5B (2.95 against 1.75 GB RSS), for the life of the process
            try:
                model = read_packed(target)
                close_gguf_files()
            except Exception as err:  # removed or spoilt since it was written: the model built serves this load
                if progress is not None:
                    progress(f"the packed {weights} weights in {target} did not read back ({type(err).__name__}); "
                             "using the model as built")
        if progress is not None:
            progress(f"packed in {time.perf_counter() - start:.1f} s")
    return model


def _read_if_packed(target: Path, weights: str, progress: Callable[[str], None] | None) -> Transformer | None:
    """The model packed in `target`, or None when there is none (or it is unreadable: packed again by the caller)."""
    if not target.is_file():
        return None
    try:
        return read_packed(target)
    except Exception as err:  # a truncated or foreign file: packed again, never the load's end
        if progress is not None:
            progress(f"the packed {weights} weights in {target} are unreadable ({type(err).__name__}); packing again")
        return None


def write_packed(model: Transformer, target: Path) -> None:
    """Save `model`'s state and args to `target`, atomically (a temporary file renamed into place). Raises OSError
    when it cannot, before writing anything when the disk lacks room for the file and `SPARE` more."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    head = getattr(model.lm_head, "weight", None)
    if head is not None and head is getattr(model.model.embed_tokens, "weight", None):
        state.pop("lm_head.weight")  # one tensor under two names: tied again at load
    meta = {"args": json.dumps(dataclasses.asdict(model.args)), "weights": model.weights}
    target.parent.mkdir(parents=True, exist_ok=True)
    need = sum(v.numel() * v.element_size() for v in state.values())
    free = shutil.disk_usage(target.parent).free
    if free < need + SPARE:
        raise OSError(errno.ENOSPC, f"the packing needs {need / 2**30:.1f} GiB and {SPARE >> 20} MiB to spare, "
                      f"the disk has {free / 2**30:.1f} GiB free")
    fd, tmp = tempfile.mkstemp(prefix=".packing-", suffix=".safetensors", dir=target.parent)
    os.close(fd)
    try:
        try:
            save_file(state, tmp, metadata=meta)
        except SafetensorError as err:  # safetensors reports a full disk or an I/O error as its own type
            raise OSError(errno.EIO, str(err)) from err
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def read_packed(source: Path) -> Transformer:
    """The model `write_packed` saved, on the CPU."""
    from safetensors import safe_open

    with safe_open(str(source), framework="pt") as f:
        meta = f.metadata()
    args = ModelArgs(**json.loads(meta["args"]))
    return transformer_from_packed(args, _read_tensors(source), weights=meta["weights"])


_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "F16": torch.float16,
           "BF16": torch.bfloat16, "F32": torch.float32}


def _read_tensors(source: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, each read straight into a tensor of its own. Why not `load_file`: it
    copies every tensor out of the file's mapped pages, and its tensors sat at any offset of one buffer, where torch's
    int8 kernel crashed on a misaligned weight (a segfault at 6 rows of activations), so each was cloned once more:
    the 1.5B's load peaked at 2.9 GB for 1.3 GB of weights. Read into fresh tensors (aligned by torch's allocator),
    the peak is the weights themselves. The format: an 8-byte little-endian header size, a JSON header naming each
    tensor's dtype, shape and byte range in the data that follows."""
    with open(source, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        state = {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            f.seek(8 + size + begin)
            read = f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) if tensor.numel() else 0
            if read != end - begin or tensor.nbytes != end - begin:
                raise SafetensorError(f"{source}: tensor {name} is cut short")
            state[name] = tensor
    return state
