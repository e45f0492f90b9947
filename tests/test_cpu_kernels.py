"""The CPU kernels `runtime_kernels::q4_linear` / `q8_linear` (runtime/models/lm/cpu_kernels): against an
independent reference of the same arithmetic, rows independent of their batch and of the thread count, every
instruction-set path the same, the packing's byte layout, and the ops inside torch.compile."""

import shutil

import pytest
import torch

from runtime.models.lm import cpu_kernels as ck

GROUP = 32


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Built once per test session into the test cache (about 15 s), loaded once per process."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build the kernels")
    ck.load()
    before = ck.isa()
    yield
    ck.set_isa(before)


def vector_paths() -> list[str]:
    return [p for p in ck.ISAS[1:] if ck.ISAS.index(p) <= ck.ISAS.index(ck.best_isa())]


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it, by the documented rule written independently: per row and group of 32,
    dx = max|x| / 127, qx = round-half-even(x * (1 / dx)) in [-127, 127], x' = qx * dx (float64)."""
    g = x.float().reshape(x.shape[0], -1, GROUP)
    dx = g.abs().amax(-1) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    qx = torch.round(g * inv[..., None]).clamp(-127, 127)
    return (qx.double() * dx.double()[..., None]).reshape(x.shape)


def check_close(y: torch.Tensor, xq: torch.Tensor, w: torch.Tensor) -> None:
    """y equals xq @ w.T to float32 summation rounding: each group adds two roundings to the running sum."""
    ref = xq @ w.T
    bound = (xq.abs() @ w.abs().T) * (w.shape[1] // GROUP + 4) * 2.0**-23 + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"worst error {float((err / bound).max()):.2f} bounds"


def q4_weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // GROUP, generator=gen) * 0.05 + 1e-3
    low = -8 * scale + torch.randn(n, k // GROUP, generator=gen) * 0.01
    return q, scale.half().float(), low.half().float()  # fp16-exact, as the layout stores them


def q8_weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.05 + 1e-3).half().float()
    return q, scale


def activations(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :GROUP] = 0  # a group of zeros: scale 0, no division by it
    if m > 1:
        x[1, GROUP : 2 * GROUP] = 1.5  # ties of the rounding
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ck.ISAS)
def test_q4_matches_reference(path, dtype):
    if path != "scalar" and path not in vector_paths():
        pytest.skip(f"this CPU has no {path}")
    n, k = 37, 96  # an odd N: the last tile of 16 rows is partly padding
    q, scale, low = q4_weights(n, k)
    x = activations(5, k, dtype)
    w = (q.double().reshape(n, -1, GROUP) * scale.double()[..., None] + low.double()[..., None]).reshape(n, k)
    with ck.using_isa(path):
        y = ck.q4_linear(x, ck.pack_q4(q, scale, low), n, torch.float32)
    assert y.shape == (5, n) and y.dtype == torch.float32
    check_close(y, quantized_activations(x), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ck.ISAS)
def test_q8_matches_reference(path, dtype):
    if path != "scalar" and path not in vector_paths():
        pytest.skip(f"this CPU has no {path}")
    n, k = 21, 128
    q, scale = q8_weights(n, k)
    q[0, :GROUP] = -128  # the extremes of int8 weights
    q[1, :GROUP] = 127
    x = activations(4, k, dtype)
    w = (q.double().reshape(n, -1, GROUP) * scale.double()[..., None]).reshape(n, k)
    with ck.using_isa(path):
        y = ck.q8_linear(x, ck.pack_q8(q, scale), n, torch.float32)
    check_close(y, quantized_activations(x), w)


def test_paths_agree_bitwise():
    """Every path rounds alike (kernels.cpp), so a machine's forced AVX2 gives its AVX-512 logits exactly."""
    n, k = 40, 160
    q, scale, low = q4_weights(n, k, seed=3)
    q8, scale8 = q8_weights(n, k, seed=4)
    p4, p8 = ck.pack_q4(q, scale, low), ck.pack_q8(q8, scale8)
    x = activations(11, k, torch.bfloat16)
    outs = {}
    for path in ["scalar", *vector_paths()]:
        with ck.using_isa(path):
            outs[path] = (ck.q4_linear(x, p4, n, torch.float32), ck.q8_linear(x, p8, n, torch.float32))
    for path, (y4, y8) in outs.items():
        assert torch.equal(y4, outs["scalar"][0]), path
        assert torch.equal(y8, outs["scalar"][1]), path


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_rows_independent_of_batch_and_threads(kind):
    """A row's output is bitwise the same alone, among 7 or among 300 rows, at 1 or 2 threads: the engine verifies
    a speculative draft of many rows and needs the logits one-row steps give."""
    n, k = 16 * 30, 512  # 30 tiles: two threads split them (a thread takes at least ~64 KB of weights)
    if kind == "q4":
        packed, op = ck.pack_q4(*q4_weights(n, k, seed=5)), ck.q4_linear
    else:
        packed, op = ck.pack_q8(*q8_weights(n, k, seed=6)), ck.q8_linear
    x = activations(300, k, torch.bfloat16, seed=7)
    threads = torch.get_num_threads()
    try:
        for path in vector_paths():
            with ck.using_isa(path):
                torch.set_num_threads(1)
                all_rows = op(x, packed, n, torch.float32)
                torch.set_num_threads(2)
                assert torch.equal(op(x, packed, n, torch.float32), all_rows), path
                assert torch.equal(op(x[3:10], packed, n, torch.float32), all_rows[3:10]), path
                for i in (0, 7, 299):
                    assert torch.equal(op(x[i : i + 1], packed, n, torch.float32), all_rows[i : i + 1]), (path, i)
    finally:
        torch.set_num_threads(threads)


def test_output_dtype_and_leading_dims():
    n, k = 33, 64
    packed = ck.pack_q4(*q4_weights(n, k))
    x = activations(6, k, torch.bfloat16).reshape(2, 3, k)
    y32 = ck.q4_linear(x, packed, n, torch.float32)
    y = ck.q4_linear(x, packed, n)
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, y32.to(torch.bfloat16))  # the float32 sum, rounded once
    assert ck.q4_linear(x[:0].reshape(0, k), packed, n).shape == (0, n)


def test_bad_inputs_are_refused():
    packed = ck.pack_q4(*q4_weights(20, 64))
    with pytest.raises(RuntimeError, match="last size must be 64"):
        ck.q4_linear(torch.randn(1, 96), packed, 20)
    with pytest.raises(RuntimeError, match="does not fit"):
        ck.q4_linear(torch.randn(1, 64), packed, 40)
    with pytest.raises(RuntimeError, match="blocks|packed"):
        ck.q8_linear(torch.randn(1, 64), packed, 20)
    with pytest.raises(ValueError, match="0..15"):
        ck.pack_q4(torch.full((16, 32), 16), torch.ones(16, 1), torch.zeros(16, 1))


def test_packing_round_trip_and_gguf_bytes():
    """pack/unpack are inverses, and a row's 4-bit bytes are GGUF Q4_0/Q4_1's (low nibble = input i, high =
    input i + 16), four at a time: row r's bytes 4c..4c+3 of group g at block [r // 16, g, 64c + 4 (r % 16)]."""
    n, k = 35, 64
    q, scale, low = q4_weights(n, k)
    packed = ck.pack_q4(q, scale, low)
    assert packed.shape == (3, 2, 320) and packed.dtype == torch.uint8
    uq, us, ul = ck.unpack_q4(packed, n)
    assert torch.equal(uq, q.int()) and torch.equal(us, scale) and torch.equal(ul, low)
    r, g = 18, 1
    gguf = [int(q[r, g * 32 + i]) | int(q[r, g * 32 + i + 16]) << 4 for i in range(16)]
    for c in range(4):
        at = 64 * c + 4 * (r % 16)
        assert packed[r // 16, g, at : at + 4].tolist() == gguf[4 * c : 4 * c + 4]
    q8, scale8 = q8_weights(n, k)
    uq8, us8 = ck.unpack_q8(ck.pack_q8(q8, scale8), n)
    assert torch.equal(uq8, q8) and torch.equal(us8, scale8)
    w = ck.dequantize(packed, n)
    assert torch.allclose(w, (q.float().reshape(n, -1, 32) * scale[..., None] + low[..., None]).reshape(n, k))


def test_packing_a_few_rows_at_a_time_equals_packing_all_at_once(monkeypatch):
    """Big layers (the vocabulary) are packed ROWS_AT_ONCE rows at a time to bound the copies: the same bytes."""
    from runtime.models.lm.cpu_kernels import packing
    from runtime.models.lm.kernel_linears import q8_blocks_of
    from runtime.models.lm.weight_formats import q4_blocks_of

    n, k = 16 * 5 + 3, 64  # the last piece holds a partial tile
    q, scale, low = q4_weights(n, k)
    q8, scale8 = q8_weights(n, k)
    w = torch.randn(n, k)
    whole = (ck.pack_q4(q, scale, low), ck.pack_q8(q8, scale8), q8_blocks_of(w), q4_blocks_of(w))
    monkeypatch.setattr(packing, "ROWS_AT_ONCE", 32)
    monkeypatch.setattr("runtime.models.lm.kernel_linears.ROWS_AT_ONCE", 32)
    monkeypatch.setattr("runtime.models.lm.weight_formats.ROWS_AT_ONCE", 32)
    pieces = (ck.pack_q4(q, scale, low), ck.pack_q8(q8, scale8), q8_blocks_of(w), q4_blocks_of(w))
    assert torch.equal(whole[0], pieces[0]) and torch.equal(whole[1], pieces[1])
    assert torch.equal(whole[2].q, pieces[2].q) and torch.equal(whole[2].scale, pieces[2].scale)
    assert all(torch.equal(getattr(whole[3], f), getattr(pieces[3], f)) for f in ("q", "scale", "low"))


def test_forced_path_from_environment(monkeypatch):
    monkeypatch.setenv("RUNTIME_KERNEL_ISA", "avx2")
    assert ck._forced_isa() == ("avx2" if "avx2" in vector_paths() else None)
    monkeypatch.setenv("RUNTIME_KERNEL_ISA", "")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert ck._forced_isa() == ("avx2" if "avx2" in vector_paths() else None)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert ck._forced_isa() is None
    with pytest.raises(ValueError, match="not one of"):
        ck.set_isa("sse9")


def test_fake_shapes_under_compile():
    """The fake implementations give torch.compile the output's shape and dtype (aot_eager traces with them)."""
    n, k = 24, 64
    packed = ck.pack_q8(*q8_weights(n, k))

    def f(x):
        return ck.q8_linear(torch.nn.functional.silu(x), packed, n, torch.float32) * 2

    x = activations(3, k, torch.bfloat16).reshape(1, 3, k)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    assert y.shape == (1, 3, n) and y.dtype == torch.float32
    assert torch.equal(y, f(x))


@pytest.mark.slow
def test_inductor_calls_the_op_with_the_cpp_wrapper():
    """Inside an inductor graph compiled as the decode step is (cpp_wrapper), the op stays one extern call."""
    from runtime.models.lm.compiled_step import OPTIONS

    n, k = 40, 64
    packed = ck.pack_q4(*q4_weights(n, k))

    def f(x):
        return ck.q4_linear(x * 2, packed, n).float() + 1

    x = activations(2, k, torch.bfloat16)
    y = torch.compile(f, fullgraph=True, options=OPTIONS)(x)
    assert torch.equal(y, f(x))


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    """Without a compiler the build says so in one line (the caller then falls back to torch's kernels)."""
    from runtime.models.lm.cpu_kernels import build

    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ck.KernelBuildError, match="C\\+\\+ compiler"):
        build.load_library()


def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(monkeypatch, tmp_path):
    """torch's build lock is a file removed when its build ends: one left by a killed builder made every later build
    wait for ever (CI of 2026-12-02 ran out its time). The next build takes the lock as if none had been left."""
    import os

    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    from runtime.models.lm.cpu_kernels import build

    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    folder = build.build_dir()
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what a builder killed mid-build leaves
    took: list[bool | None] = []

    def load(name: str, sources: list[str], build_directory: str, **kwargs: object) -> None:
        baton = FileBaton(os.path.join(build_directory, "lock"))  # what cpp_extension.load does first
        took.append(baton.try_acquire())
        (folder / f"{name}.so").touch()
        baton.release()

    monkeypatch.setattr(cpp_extension, "load", load)
    library = build.load_library()
    assert took == [True] and library.exists() and not (folder / "lock").exists()


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_dequantized_alone_are_the_whole_weights(bits: int) -> None:
    """`dequantize_rows` (an embedding lookup in the packed layout) reads each row as `dequantize` and an
    independent float computation do, whatever tile and lane it sits at, repeated and out of order."""
    torch.manual_seed(3)
    n, k = 37, 96  # a partial last tile
    scale = torch.rand(n, k // GROUP).half().float()
    if bits == 4:
        q, low = torch.randint(0, 16, (n, k)), torch.randn(n, k // GROUP).half().float()
        packed = ck.pack_q4(q, scale, low)
        want = q.float().reshape(n, -1, GROUP) * scale[..., None] + low[..., None]
    else:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        packed = ck.pack_q8(q, scale)
        want = q.float().reshape(n, -1, GROUP) * scale[..., None]
    rows = torch.tensor([36, 0, 15, 16, 31, 32, 0, 20])
    got = ck.dequantize_rows(packed, rows)
    assert torch.equal(got, ck.dequantize(packed, n)[rows])
    assert torch.equal(got, want.reshape(n, k)[rows])
