"""CTranslate2's `model.bin`, read without CTranslate2: what faster-whisper users already have on disk.

The file is a flat, little-endian serialisation of a model spec (CTranslate2's `ModelSpec._serialize`):

    uint32 binary version (6)        string spec name ("WhisperSpec")     uint32 spec revision
    uint32 variable count, then per variable:
        string name, uint8 rank, uint32 dims[rank], uint8 dtype code, uint32 byte count, raw bytes
    uint32 alias count, then per alias: string alias, string name of the variable it shares

A string is a uint16 length (counting a trailing NUL) and its bytes. dtype codes: 0 float32, 1 int8, 2 int16,
3 int32, 4 float16, 5 bfloat16. An alias is how the spec ties weights (Whisper's output projection is the
token embedding). Scalars (rank 0) carry settings such as the head count.

Nothing here knows a model family: `read_model_bin` gives names to arrays; `models/asr/whisper_ct2.py` maps a
WhisperSpec onto transformers' Whisper.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.errors import CheckpointNotFound

SUPPORTED_VERSIONS = (5, 6)
_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    5: np.dtype("<u2"),  # bfloat16: raw 16-bit words, widened in `as_tensor`
}
DTYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}


@dataclass
class CT2Model:
    """The spec's name and revision and its variables, aliases resolved (a tied weight appears under both)."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)  # the stored dtype code of each variable
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> the variable it shares

    def tensor(self, name: str) -> torch.Tensor:
        """A variable as a torch tensor (bfloat16 restored from its raw words; others keep their dtype)."""
        array = self.variables[name]
        if self.dtypes[name] == 5:
            return torch.from_numpy(array.astype(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(array.copy())

    def scalar(self, name: str) -> int:
        return int(self.variables[name].reshape(-1)[0])

    def weight(self, name: str) -> torch.Tensor:
        """A float weight; an int8-quantised one (CTranslate2's `quantization="int8"`: int8 rows and a
        per-row `weight_scale`) is dequantised to float32 as CTranslate2 does, w / scale."""
        name = self.aliases.get(name, name)  # a tied weight's scale is stored beside the variable it shares
        tensor = self.tensor(name)
        scale = f"{name}_scale"
        if scale in self.variables and not tensor.is_floating_point():
            return tensor.float() / self.tensor(scale).float().reshape(-1, *([1] * (tensor.dim() - 1)))
        return tensor


class _Reader:
    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.offset, self.path = data, 0, path

    def take(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.offset)
        except struct.error:
            raise self.truncated() from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<H")
        raw = self.data[self.offset : self.offset + n]
        if len(raw) != n:
            raise self.truncated()
        self.offset += n
        return raw.rstrip(b"\0").decode("utf-8")

    def array(self, shape: list[int], dtype: np.dtype, nbytes: int) -> np.ndarray:
        if self.offset + nbytes > len(self.data):
            raise self.truncated()
        if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CheckpointNotFound(f"{self.path}: a variable of shape {shape} holds {nbytes} bytes; the file is "
                                     "not a CTranslate2 model")
        array = np.frombuffer(self.data, dtype=dtype, count=nbytes // dtype.itemsize, offset=self.offset)
        self.offset += nbytes
        return array.reshape(shape)

    def truncated(self) -> CheckpointNotFound:
        return CheckpointNotFound(f"{self.path}: ends early at byte {self.offset}; the file is truncated or not a "
                                  "CTranslate2 model.bin")


def read_model_bin(path: str | Path) -> CT2Model:
    """Read a CTranslate2 `model.bin` (arrays share the file's bytes; nothing is copied until `tensor`)."""
    path = Path(path)
    reader = _Reader(path.read_bytes(), path)
    version = reader.take("<I")
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointNotFound(f"{path}: CTranslate2 binary version {version} is not supported (reads "
                                 f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    model = CT2Model(spec=reader.string(), revision=reader.take("<I"))
    for _ in range(reader.take("<I")):
        name = reader.string()
        shape = [reader.take("<I") for _ in range(reader.take("<B"))]
        code = reader.take("<B")
        if code not in _DTYPES:
            raise CheckpointNotFound(f"{path}: variable {name!r} has unknown dtype code {code}")
        model.variables[name] = reader.array(shape, _DTYPES[code], reader.take("<I"))
        model.dtypes[name] = code
    for _ in range(reader.take("<I")):
        alias, target = reader.string(), reader.string()
        if target not in model.variables:
            raise CheckpointNotFound(f"{path}: alias {alias!r} names a missing variable {target!r}")
        model.aliases[alias] = target
        model.variables[alias] = model.variables[target]
        model.dtypes[alias] = model.dtypes[target]
    return model

