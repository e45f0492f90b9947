"""How a command stops: Ctrl-C (SIGINT) and SIGTERM, which `docker stop`, systemd and `timeout` send, mean the
same thing everywhere.

Why one place: a process killed where it stands leaves a benchmark's multi-GB temporary checkpoint on disk, a
half-written file, and a server's sessions open. Turned into KeyboardInterrupt, SIGTERM unwinds like Ctrl-C and
every `finally` runs; inside an event loop both signals set a stop event instead, so a server closes its
sessions and a live session flushes its transcript. Worker processes, which their pool ends with SIGTERM, keep
the default and die quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def terminate_like_ctrl_c() -> None:
    """SIGTERM raises KeyboardInterrupt from now on. Only the main thread may set handlers (tests call the CLI
    from others, where this does nothing)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def on_stop_signals(callback: Callable[[], None]) -> None:
    """Ctrl-C and SIGTERM call `callback` on the running loop (a graceful stop) instead of raising."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, callback)


def remove_stop_signals() -> None:
    """Undo `on_stop_signals` on the running loop; SIGTERM goes back to raising KeyboardInterrupt (the loop's
    removal alone would reset it to the default, killing)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(sig)
    terminate_like_ctrl_c()


def worker_process_defaults() -> None:
    """For a pool's worker processes: SIGTERM kills (what `Pool.terminate` expects, without a KeyboardInterrupt
    traceback per worker), and Ctrl-C is left to the parent, which terminates the pool."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
