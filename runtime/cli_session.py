"""A session run at the terminal: its events printed to stdout (readable text, or one JSON event per line with
`--json`), questions typed on stdin, stopped by Ctrl-C or SIGTERM, and the `Console` that puts status and progress
on stderr so stdout stays clean.

Apart from `cli.py` because every session command (`demo`, `transcribe`, `ask`, `serve` with a local source) runs
its session through here, while `cli.py` decides what each command opens and loads; this reads as one loop, top
to bottom, without the commands around it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from runtime.config import Profile
from runtime.events import Event
from runtime.feed import ScheduledQuestion, feed
from runtime.io.printers import JsonLinesPrinter, TextPrinter
from runtime.io.source import Source
from runtime.stop_signals import on_stop_signals, remove_stop_signals
from runtime.worker import DeviceWorker

if TYPE_CHECKING:
    from runtime.loaded_models import Models
    from runtime.session import Session
    from runtime.session_config import SessionConfig


class Console:
    """Status lines and progress on stderr; silent with --quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._bar = None

    def quiet_libraries(self) -> None:
        """Before models load: the libraries' own progress bars go where ours go (none when quiet or not on a
        terminal). Not at construction: importing transformers takes half a second a mistyped path should not."""
        if self.quiet or not sys.stderr.isatty():
            from huggingface_hub.utils import disable_progress_bars
            from transformers.utils import logging as transformers_logging

            disable_progress_bars()
            transformers_logging.disable_progress_bar()  # "Loading weights"

    def status(self, line: str) -> None:
        if not self.quiet:
            print(f"runtime: {line}", file=sys.stderr, flush=True)

    def progress_bar(self, total: float | None, desc: str) -> Callable[[float], None] | None:
        if self.quiet or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        bar = tqdm(total=round(total, 1) if total else None, desc=desc, unit="s", file=sys.stderr, leave=False,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s media [{elapsed}]")
        self._bar = bar

        def update(media_time: float) -> None:
            bar.update(max(0.0, round(media_time, 1) - bar.n))  # tqdm throttles redraws itself

        return update

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# -- running a session ---------------------------------------------------------------------------------------
def _printer(args: argparse.Namespace) -> JsonLinesPrinter | TextPrinter:
    if args.json:
        return JsonLinesPrinter(sys.stdout)
    return TextPrinter(sys.stdout, show_metrics=args.metrics)


async def _consume(session: Session, write: Callable[[Event], None]) -> None:
    async for event in session.events:
        write(event)


def _read_stdin(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[str | None]) -> None:
    """A daemon thread: stdin is read off the loop so a blocked read never stalls it."""
    for line in sys.stdin:
        loop.call_soon_threadsafe(lines.put_nowait, line.rstrip("\n"))
    loop.call_soon_threadsafe(lines.put_nowait, None)


async def _questions_from_stdin(session: Session, console: Console, stop: asyncio.Event) -> None:
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    threading.Thread(target=_read_stdin, args=(asyncio.get_running_loop(), lines), daemon=True).start()
    while (line := await lines.get()) is not None:
        if line.strip() == "/cancel":
            session.cancel_response()
        elif line.strip() in ("/quit", "/exit"):
            break
        elif line.strip():
            await session.ask(line)
    else:  # end of input: Ctrl-D at a terminal ends the session; a closed pipe only ends the questions, so
        if not sys.stdin.isatty():  # wait here (no question comes) until the source ends or a signal stops us
            await stop.wait()
            return
    stop.set()


async def run_session(
    profile: Profile, models: Models, worker: DeviceWorker, source: Source, args: argparse.Namespace,
    console: Console, questions: Sequence[ScheduledQuestion] = (), interactive: bool = False,
    publish: Callable[[Event], None] | None = None, config: SessionConfig | None = None,
) -> int:
    """Returns how many `error` events the session emitted. `publish`: also hand every event to it (serve's
    browser watchers, the speaker of `serve --speak`), after the printer. `config`: the session's (default: a
    captioner's)."""
    from runtime.session_builder import open_session

    printer = _printer(args)
    session = await (await open_session(profile, models, worker, config=config)).start()
    errors = 0

    def write(event: Event) -> None:
        nonlocal errors
        errors += event.type == "error"
        printer.write(event)
        if publish is not None:
            publish(event)

    consumer = asyncio.create_task(_consume(session, write))
    progress = console.progress_bar(source.duration, source.description) if args.speed != 1.0 else None
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    feeding = asyncio.create_task(feed(source, session, questions, progress))
    waiters = [feeding, asyncio.create_task(stop.wait())]
    if interactive:
        waiters.append(asyncio.create_task(_questions_from_stdin(session, console, stop)))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if feeding.done() and feeding.exception() is not None:
            raise feeding.exception()  # type: ignore[misc]
        if not feeding.done():
            console.status("stopping: flushing the transcript")
    finally:
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await source.aclose()
        console.close()
        remove_stop_signals()
        await session.finish()
        await consumer
        printer.close()
    return errors
