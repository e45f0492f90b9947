"""`build_lock`: of processes that find a cache artefact missing at once, one builds it and the others wait and read
it; a builder that dies leaves no lock behind. Each side is a real process, as in a server's replicas or the test
suite's workers; the packing of a GGUF model is tested the same way through `packed_weights.load_model`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from test_gguf import tiny, write_gguf

from runtime.models.build_lock import building, lock_path
from runtime.models.lm.packed_weights import load_model, packed_file

BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from runtime.models.build_lock import building
    target, log = Path(sys.argv[1]), Path(sys.argv[2])
    with building(target, progress=lambda line: print(line, flush=True)):
        if not target.exists():
            with log.open("a") as f:
                f.write("built\\n")
            time.sleep(float(sys.argv[3]))  # the build's work, during which the others start and wait
            target.write_text("artefact")
    print("read", target.read_text(), flush=True)
""")


def _builder(target: Path, log: Path, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(target), str(log), str(seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_processes_started_together_build_once_and_all_read_it(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "artefact.bin", tmp_path / "log"
    procs = [_builder(target, log, 1.0) for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert log.read_text() == "built\n"  # one build
    assert all(out.splitlines()[-1] == "read artefact" for out, _ in outs)
    waited = [out for out, _ in outs if "waiting for another process building artefact.bin" in out]
    assert waited and all("waited " in out for out in waited)  # the others said why they were idle


def test_a_builder_killed_mid_build_leaves_no_lock(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "artefact.bin", tmp_path / "log"
    dying = _builder(target, log, 60.0)
    deadline = time.monotonic() + 30
    while not log.exists():  # it holds the lock and is building
        assert time.monotonic() < deadline and dying.poll() is None, dying.communicate()
        time.sleep(0.02)
    os.kill(dying.pid, signal.SIGKILL)
    dying.wait(timeout=10)
    assert lock_path(target).exists() and not target.exists()  # the lock file stays; the kernel dropped the lock
    lines: list[str] = []
    with building(target, progress=lines.append):
        pass
    assert lines == []  # taken at once: nothing to wait for


def test_packing_a_gguf_model_at_once_in_two_threads_packs_it_once(tmp_path: Path, monkeypatch) -> None:
    """`load_model` of a GGUF file not packed before, in two threads at once (flock holds between two opens of the
    lock file in one process as between processes): one packs, the other reads the packed file, the same model."""
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(tiny("qwen2"), path, "qwen2", GGMLQuantizationType.Q4_0, tie=True)
    lines: list[str] = []
    models: list[torch.nn.Module] = []
    barrier = threading.Barrier(2)

    def load() -> None:
        barrier.wait()
        models.append(load_model(path, device="cpu", dtype=torch.float32, weights="int8", progress=lines.append))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(models) == 2 and packed_file(path, "int8", torch.float32).is_file()
    assert sum(line.startswith("packing ") for line in lines) == 1, lines
    ids = torch.tensor([5, 17, 3, 42])
    assert torch.equal(models[0](ids, torch.arange(4)), models[1](ids, torch.arange(4)))
