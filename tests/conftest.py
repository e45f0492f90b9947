"""Test-wide settings: never touch the network, and build tiny models into one temporary cache that the
CLI subprocesses share."""

import asyncio
import faulthandler
import gc
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"
# The run's cache: made by the first process (xdist's controller; its workers inherit it) and removed when that
# process ends the run (it holds joined checkpoints of 1.6 GB, exported graphs, converted models). A cache given
# in the environment is the caller's and stays.
_OWN_CACHE = None if "RUNTIME_CACHE" in os.environ else tempfile.mkdtemp(prefix="runtime-test-cache-")
if _OWN_CACHE is not None:
    os.environ["RUNTIME_CACHE"] = _OWN_CACHE
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402

from runtime.worker import DeviceWorker  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models are latency-bound; on a loaded 2-core machine spare intra-op threads only spin. Set before any
    fixture of any scope builds a model (a compiled step is keyed by the thread count it was built for)."""
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def one_torch_thread_again(one_torch_thread):
    """And again after every test: a test that ran a bench at 2 threads left them at 2 for every later test of its
    worker, and beside the other worker's load those spinning threads made a test of many small tensor ops 30-40
    times slower (the 10,000-frame video-memory test: 1.5 s alone, 61 s in CI's run)."""
    import torch

    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def nothing_frozen_after_a_test():
    """The CLI freezes the heap once its models are loaded (`cli._freeze_heap`): right for a process that keeps its
    models to the end, wrong for a test worker, where whatever a CLI test froze could never be collected later."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def demo_file():
    """The demo sample as an MP4 (speech + moving shapes), built once per test run."""
    from runtime.io.sample import ensure_demo_file

    return ensure_demo_file()


@pytest.fixture(scope="module")
def tiny_path():
    """The tiny random Qwen2 checkpoint (built once into the test cache)."""
    from runtime.models.loading import resolve_checkpoint

    return resolve_checkpoint("tiny:qwen2", role="lm")


@pytest.fixture(scope="module")
def hf(tiny_path):
    """transformers' own model over the tiny checkpoint: the reference the engine must equal."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="sdpa").eval()


@pytest.fixture
def worker():
    """A device worker of the test's own, stopped after it (a module may keep one with a wider scope)."""
    with DeviceWorker() as w:
        yield w


# `make test` runs the suite in two phases at once (docs/testing.md): everything but the tests marked `realtime` on
# both cores at the lowest CPU priority, and beside them those, one at a time, at normal priority. A realtime test
# paces media at real time under time-outs (servers, browsers, a fleet); beside a worker of equal priority one in
# three runs timed out.
PHASE = os.environ.get("RUNTIME_TEST_PHASE", "")  # "" (every test), "parallel" or "realtime"
if PHASE not in ("", "parallel", "realtime"):
    raise pytest.UsageError(f"RUNTIME_TEST_PHASE={PHASE!r}: expected parallel or realtime (or unset: every test)")
if PHASE == "realtime":
    # `make test` starts this phase as a shell's background job, which begins with SIGINT ignored: restored, the
    # Makefile's `kill -INT` on an interrupted run stops the test under way and its fixtures stop their servers.
    signal.signal(signal.SIGINT, signal.default_int_handler)


# a realtime test runs for seconds; one that has not ended by then is stuck
REALTIME_TEST_LIMIT_S = float(os.environ.get("RUNTIME_REALTIME_TEST_LIMIT_S", "300"))


@pytest.fixture(autouse=True)
def stuck_realtime_test_says_where(request: pytest.FixtureRequest):
    """A realtime test awaits servers, browsers and peers; one await that never completes would hold CI until its
    90 minutes run out, and its thread stacks only show an idle event loop. Past the limit, every task of the running
    loop prints its stack (what each was awaiting) and the tasks are cancelled: the test fails and says where."""
    if request.node.get_closest_marker("realtime") is None:
        yield
        return

    def running_loop(o: object) -> bool:
        try:
            return isinstance(o, asyncio.AbstractEventLoop) and o.is_running()
        except ReferenceError:  # a weakref.proxy whose object is gone: isinstance raised, and the watchdog died with
            return False        # it once, leaving a stuck browser test to hold CI (2026-11-30)

    def dump_and_cancel() -> None:
        with warnings.catch_warnings():  # (isinstance on every object wakes deprecated modules' warnings)
            warnings.simplefilter("ignore")
            loops = [o for o in gc.get_objects() if running_loop(o)]
        for loop in loops:
            def in_loop(loop: asyncio.AbstractEventLoop = loop) -> None:
                print(f"\n{request.node.nodeid}: still running after {REALTIME_TEST_LIMIT_S} s; its tasks:",
                      file=sys.stderr, flush=True)
                for task in asyncio.all_tasks(loop):
                    task.print_stack(file=sys.stderr)
                    task.cancel()
            loop.call_soon_threadsafe(in_loop)

    timer = threading.Timer(REALTIME_TEST_LIMIT_S, dump_and_cancel)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# Any test, from its first fixture to its last teardown, that has not ended by then is stuck, whatever it awaits: CI
# of 2026-12-02 ran out its 90 minutes with the realtime phase done in 3 and the other phase still running, and said
# nothing of where. Past the limit every thread's stack is printed (by faulthandler's own thread, which needs no GIL)
# and the process exits: under xdist the controller reports the worker crashed in that test and starts another, so
# the run goes on and fails. The slowest test takes about 2.5 minutes on 2 cores (docs/testing.md).
TEST_HARD_LIMIT_S = float(os.environ.get("RUNTIME_TEST_HARD_LIMIT_S", "600"))
_real_stderr: int | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Keep the real standard error (capture is suspended while plugins configure): a test's own is a capture file,
    which a process that exits mid-test never shows."""
    global _real_stderr
    _real_stderr = os.dup(2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _real_stderr is None or TEST_HARD_LIMIT_S <= 0:
        yield
        return
    faulthandler.dump_traceback_later(TEST_HARD_LIMIT_S, exit=True, file=_real_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The phase's tests only; the tests marked `slow` first, each kept in its place among them: under xdist they
    start while the short ones fill the other worker, instead of one landing last and holding the run's end on a
    single core. Run together under xdist (no phase), the realtime tests share one group: one at a time."""
    if PHASE:
        ours = [(item.get_closest_marker("realtime") is not None) == (PHASE == "realtime") for item in items]
        if not all(ours):
            config.hook.pytest_deselected(items=[item for item, mine in zip(items, ours, strict=True) if not mine])
            items[:] = [item for item, mine in zip(items, ours, strict=True) if mine]
    for item in items:
        if item.get_closest_marker("realtime") is not None:
            item.add_marker(pytest.mark.xdist_group("realtime"))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OWN_CACHE is not None and not hasattr(session.config, "workerinput"):  # the process that made it
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
