"""The fast GGUF reader (runtime/models/lm/gguf_reader.py) reads every field and tensor exactly as gguf's own reader
does: the same parts (dtype, shape, bytes), the same value indices and types, the same contents. On a file written
here with every kind of value and, where installed, on the real SmolLM2 file (its vocabulary and merges are what the
fast path is for)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from runtime.errors import CheckpointNotFound
from runtime.models.lm.gguf_checkpoint import gguf_file
from runtime.models.lm.gguf_reader import fast_reader
from runtime.models.loading import resolve_checkpoint


def same_as_gguf(path: Path) -> int:
    """Every field of `path` read by both readers is the same; returns how many fields there were."""
    theirs, ours = GGUFReader(path), fast_reader()(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, want in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.name, got.data, got.types) == (want.offset, want.name, want.data, want.types), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), name
        assert got.contents() == want.contents(), name
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors]
    return len(theirs.fields)


def test_every_kind_of_value_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "values.gguf"
    w = GGUFWriter(path, "llama")
    w.add_array("t.strings", ["", "a", "héllo wörld", "<|im_end|>", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])  # int32
    w.add_key_value("t.u8s", [0, 255, 7], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    w.add_key_value("t.i64s", [-(2**40), 2**40], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT64)
    w.add_key_value("t.f64s", [0.5, -1e300], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT64)
    w.add_array("t.floats", [0.25, -3.5])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])  # arrays of arrays: gguf's own walk
    w.add_string("t.string", "plain")
    w.add_uint32("t.scalar", 7)
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert same_as_gguf(path) > 10
    ours = fast_reader()(path)
    assert ours.fields["t.strings"].contents() == ["", "a", "héllo wörld", "<|im_end|>", "x" * 300]
    assert ours.fields["t.i64s"].contents() == [-(2**40), 2**40]


def test_the_real_file_reads_as_gguf_reads_it() -> None:
    """SmolLM2's 49,152-token vocabulary and merges (Qwen2.5's files hold the same kinds of fields, three times as
    long: gguf's own reader takes 10 s over one of them here)."""
    try:
        path = resolve_checkpoint("builtin:smollm2-135m-instruct", role="lm")
    except CheckpointNotFound as err:
        pytest.skip(str(err))
    file = gguf_file(path)
    assert file is not None
    assert same_as_gguf(file) > 20
    tokens = fast_reader()(file).fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) > 40_000 and "<|im_end|>" in tokens
