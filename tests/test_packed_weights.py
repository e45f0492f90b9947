"""The packed cache of GGUF models (`packed_weights`): what is read back is the model that was built, bit for bit,
and the key makes a changed file, format or packing build anew."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf import tiny, write_gguf

from runtime.models.lm import packed_weights
from runtime.models.lm.kernel_linears import PackedEmbedding, use_runtime_kernels
from runtime.models.lm.packed_weights import load_model, packed_file
from runtime.models.lm.transformer_build import load_transformer


@pytest.fixture(params=[("qwen2", "Q4_0", True), ("llama", "Q8_0", False)], ids=lambda p: f"{p[0]}-{p[1]}")
def gguf(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    arch, qtype, tie = request.param
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(tiny(arch), path, arch, GGMLQuantizationType[qtype], tie=tie)
    return path


@pytest.mark.parametrize("kernels", [False, True], ids=["torch-kernels", "runtime-kernels"])
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_read_back_equals_the_built_model(gguf: Path, weights: str, kernels: bool) -> None:
    if kernels and not use_runtime_kernels("auto", "cpu"):
        pytest.skip("the runtime's kernels do not build here")
    built = load_transformer(gguf, weights=weights, kernels=kernels)
    first = load_model(gguf, device="cpu", dtype=torch.float32, weights=weights, kernels=kernels)  # builds, keeps
    target = packed_file(gguf, weights, torch.float32, kernels)
    assert target.is_file()
    packed_weights.read_packed(target)  # readable as written (load_model would quietly pack an unreadable one again)
    again = load_model(gguf, device="cpu", dtype=torch.float32, weights=weights, kernels=kernels)  # reads it back
    assert type(again.lm_head) is type(built.lm_head) and again.weights == weights
    assert again.args == built.args
    ids = torch.tensor([5, 17, 3, 42, 8, 1])
    want = built(ids, torch.arange(6))
    assert torch.equal(first(ids, torch.arange(6)), want)
    assert torch.equal(again(ids, torch.arange(6)), want)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in again.state_dict().items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in built.state_dict().items()}


@pytest.mark.parametrize("weights", ["int4", "int8", "native"])
def test_embeddings_stay_in_the_files_blocks_on_the_runtimes_kernels(gguf: Path, weights: str) -> None:
    """Q4_0 embeddings (4-bit formats) and Q8_0 ones (every format) are looked up from the file's own blocks, each
    row the float table's (the torch kernels' model keeps one), in the activations' dtype, read back alike."""
    if not use_runtime_kernels("auto", "cpu"):
        pytest.skip("the runtime's kernels do not build here")
    packed = load_model(gguf, device="cpu", dtype=torch.float32, weights=weights, kernels=True)
    again = load_model(gguf, device="cpu", dtype=torch.float32, weights=weights, kernels=True)  # from the cache
    table = load_transformer(gguf, weights=weights).model.embed_tokens  # torch's kernels: a float table
    assert isinstance(table, torch.nn.Embedding)
    four_bit = gguf.name.endswith("qwen2.gguf")  # the fixture's Q4_0 file
    ids = torch.tensor([[0, 5, 95], [17, 16, 15]])
    for model in (packed, again):
        emb = model.model.embed_tokens
        if four_bit and weights == "int8":  # int8 keeps no 4-bit table
            assert isinstance(emb, torch.nn.Embedding)
            continue
        assert isinstance(emb, PackedEmbedding) and emb.kind == ("q4" if four_bit else "q8")
        assert model.dtype == table.weight.dtype == torch.bfloat16
        assert torch.equal(emb(ids), table(ids))
        assert sum(t.nbytes for t in emb.buffers()) < table.weight.nbytes


def test_the_reader_gives_each_tensor_aligned_and_equal_to_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = {"a": torch.arange(7, dtype=torch.uint8), "b": torch.randn(3, 5).to(torch.bfloat16),
             "c": torch.randn(4), "d": torch.tensor([1, -2], dtype=torch.int64), "e": torch.empty(0, 3)}
    save_file(state, tmp_path / "x.safetensors", metadata={"k": "v"})
    got, want = packed_weights._read_tensors(tmp_path / "x.safetensors"), load_file(tmp_path / "x.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
        assert got[k].numel() == 0 or got[k].data_ptr() % 64 == 0
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:-3])
    with pytest.raises(Exception, match="cut short"):
        packed_weights._read_tensors(tmp_path / "cut.safetensors")


def test_a_changed_file_or_packing_packs_again(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_model(gguf, device="cpu", dtype=torch.float32, weights="int4")
    old = packed_file(gguf, "int4", torch.float32)
    os.utime(gguf, ns=(1, 1))  # the file changed: a new key, and the old packing is removed when it is replaced
    new = packed_file(gguf, "int4", torch.float32)
    assert new != old
    load_model(gguf, device="cpu", dtype=torch.float32, weights="int4")
    assert new.is_file() and not old.exists()
    monkeypatch.setattr(packed_weights, "VERSION", packed_weights.VERSION + 1)
    assert packed_file(gguf, "int4", torch.float32) != new


def test_an_unreadable_packing_is_rebuilt(gguf: Path) -> None:
    target = packed_file(gguf, "int8", torch.float32)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not safetensors")
    said: list[str] = []
    model = load_model(gguf, device="cpu", dtype=torch.float32, weights="int8", progress=said.append)
    assert any("unreadable" in s for s in said)
    ids = torch.tensor([4, 9, 2])
    assert torch.equal(model(ids, torch.arange(3)), load_transformer(gguf, weights="int8")(
        ids, torch.arange(3)))
    assert packed_weights.read_packed(target).weights == "int8"


def test_other_formats_are_not_packed(gguf: Path) -> None:
    load_model(gguf, device="cpu", dtype=torch.float32, weights="bf16")
    assert not packed_file(gguf, "bf16", torch.float32).parent.exists()


def test_a_full_disk_still_loads_and_says_why_nothing_was_kept(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI run once died in `save_file` on a full disk: the load must go on, unpacked-to-disk, and say so."""
    usage = packed_weights.shutil.disk_usage(gguf.parent)
    monkeypatch.setattr(packed_weights.shutil, "disk_usage", lambda _: usage._replace(free=packed_weights.SPARE))
    said: list[str] = []
    model = load_model(gguf, device="cpu", dtype=torch.float32, weights="int8", progress=said.append)
    assert any("could not keep" in s and "GiB free" in s for s in said), said
    target = packed_file(gguf, "int8", torch.float32)
    assert not target.exists() and not list(target.parent.glob(".packing-*"))
    ids = torch.tensor([4, 9, 2])
    assert torch.equal(model(ids, torch.arange(3)), load_transformer(gguf, weights="int8")(
        ids, torch.arange(3)))


def test_a_failed_write_is_an_os_error_and_leaves_no_partial_file(gguf: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def full(_state, tmp, metadata=None) -> None:
        Path(tmp).write_bytes(b"partial")
        raise packed_weights.SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(packed_weights, "save_file", full)
    said: list[str] = []
    load_model(gguf, device="cpu", dtype=torch.float32, weights="int4", progress=said.append)
    assert any("No space left" in s for s in said), said
    target = packed_file(gguf, "int4", torch.float32)
    assert not target.exists() and not list(target.parent.glob(".packing-*"))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads which files the process maps (Linux)")
def test_a_packing_load_leaves_the_gguf_file_unmapped(gguf: Path) -> None:
    """A packing reads every weight of the file; while the file stayed mapped (the model's views of its blocks, a
    method cache keeping the open file alive) its pages stayed in the process's resident memory: 1.2 GB for the
    1.5B, for a server's life. The load that packs returns the model read back, as a warm cache would."""
    from runtime.models.lm.gguf_checkpoint import open_gguf

    model = load_model(gguf, device="cpu", dtype=torch.float32, weights="int4", kernels=False)
    assert packed_file(gguf, "int4", torch.float32).is_file()
    assert str(gguf.resolve()) not in Path("/proc/self/maps").read_text()
    open_gguf(gguf).q4_blocks("model.embed_tokens.weight")  # reading the file again maps it again
    assert str(gguf.resolve()) in Path("/proc/self/maps").read_text()
    assert model.weights == "int4"
