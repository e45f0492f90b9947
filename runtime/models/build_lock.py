"""One builder at a time for each artefact the runtime builds into its cache, the others waiting for it.

Why: what is built once (a checkpoint joined from its parts, a model packed into the engine's layouts, a tokenizer
converted from a GGUF file, an exported ONNX graph) takes seconds to a minute, and processes started together on a
fresh cache (a server's replicas, a test suite's workers, `runtime serve` beside `runtime ask`) all found it missing
and all built it: the same minute of work two or three times over on the same cores. Worse, a second join replaced
the joined file under a packing keyed by that file's modification time, so the next start packed it once more.

Every builder still writes through a temporary file renamed into place, so a reader never sees half a file; the lock
only lets the first build while the others wait, then read what it built (the caller checks again under the lock).
It is an advisory `flock` on a file beside the artefact, released by the kernel when its holder exits or dies, so a
killed builder never leaves a stale lock. A cache that cannot hold the lock file (read-only) builds without one.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def lock_path(target: Path) -> Path:
    """The lock file of `target`: hidden, beside it."""
    return target.parent / f".{target.name}.lock"


@contextmanager
def building(target: Path, progress: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold `target`'s build lock for the block, waiting (and saying so through `progress`) while another process
    holds it. The block should check whether `target` exists before building it: the holder before may have."""
    path = lock_path(target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+b")
    except OSError:  # a read-only cache: nothing can be kept there anyway, so nobody waits on this build
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is not None:
                progress(f"waiting for another process building {target.name} ...")
            start = time.perf_counter()
            fcntl.flock(handle, fcntl.LOCK_EX)
            if progress is not None:
                progress(f"waited {time.perf_counter() - start:.1f} s for {target.name}")
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
