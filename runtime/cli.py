"""`runtime serve|demo|transcribe|ask|bench|train`.

Every command loads a profile (`--profile`, `--device`, `--dtype`, `--set`), opens its source before
loading models (so a bad file or a missing camera fails at once), loads the models on the device worker,
and prints the session's events: readable text, or one JSON event per line with `--json`. Status and
progress go to stderr so stdout stays clean. Errors a user can fix print one line and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from runtime import __version__, bench, train
from runtime.config import Profile, available_profiles, load_profile, require_device
from runtime.errors import UserError
from runtime.events import Event
from runtime.feed import ScheduledQuestion, feed
from runtime.io.printers import JsonLinesPrinter, TextPrinter
from runtime.io.source import Source
from runtime.session import Models, Session, load_models
from runtime.stop_signals import on_stop_signals, remove_stop_signals, terminate_like_ctrl_c
from runtime.worker import DeviceWorker

DEMO_QUESTION = "What did the red ball do?"
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")  # where `serve` needs no token: only this machine can connect


class Console:
    """Status lines and progress on stderr; silent with --quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._bar = None
        if quiet or not sys.stderr.isatty():  # the libraries' own bars too, as ours
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


# -- argument parsing ----------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser, profile: str = "tiny") -> None:
    g = p.add_argument_group("profile")
    g.add_argument("--profile", default=profile, help=f"profile name in configs/ or a .toml path (default: "
                   f"{profile}; known: {', '.join(available_profiles()) or 'none'})")
    g.add_argument("--device", help="override the profile's device: cpu, cuda, cuda:N")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="override the profile's dtype")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any profile field, e.g. --set asr.model=/models/whisper-base (repeatable)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON event per line on stdout")
    o.add_argument("--metrics", action="store_true", help="also print metrics events in text mode")
    o.add_argument("-q", "--quiet", action="store_true", help="no status lines or progress on stderr")


def _seconds(text: str) -> float:
    """An argparse type: a finite number >= 0 (float() alone takes nan, inf and negatives)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    if not (text.isdigit() and 0 <= int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {text!r}")
    return int(text)


def _speed(p: argparse.ArgumentParser, default: float, what: str) -> None:
    p.add_argument("--speed", type=_seconds, default=default, metavar="N",
                   help=f"play media N times faster than real time; 0 = as fast as the pipeline takes it "
                        f"(default: {default:g}, {what})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runtime", description="A runtime for streaming multimodal real-time agents: live captions and "
        "questions answered over audio and video as they arrive.")
    parser.add_argument("--version", action="version", version=f"runtime {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="the realtime server (browser demo page, websocket, WebRTC); with --camera or "
                       "--source, also live local captioning", description="Serve the browser demo page "
                       "(http://HOST:PORT/: camera and microphone over WebRTC, live captions, questions), the "
                       "realtime websocket protocol (ws://HOST:PORT/v1/realtime), WebRTC signalling (POST "
                       "/v1/webrtc/offer) and GET /healthz; docs/protocol.md. With --camera N (and the default "
                       "microphone), --mic or --source FILE it also captions that input locally and answers "
                       "questions typed on stdin (a line is a question; /cancel stops the current answer; Ctrl-D "
                       "or Ctrl-C ends).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1); any address other "
                   "than loopback (127.0.0.1, ::1, localhost) needs --token")
    p.add_argument("--token", default=None, metavar="TOKEN", help="require this token on every websocket "
                   "connection and WebRTC offer (the demo page asks for it; Authorization: Bearer TOKEN or "
                   "?token=TOKEN; default: $RUNTIME_TOKEN, else none)")
    p.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN", dest="allow_origins",
                   help="a browser origin admitted to the websocket, e.g. https://app.example.com (repeatable; "
                   "default: the demo page's own, http://127.0.0.1:PORT and http://localhost:PORT)")
    p.add_argument("--port", type=_port, default=8765, help="port (default: 8765; 0 = any free port)")
    p.add_argument("--max-sessions", type=int, default=8, metavar="N",
                   help="websocket sessions admitted at once; the next is refused with server_busy (default: 8)")
    p.add_argument("--camera", default=None, metavar="N|PATH", help="caption a local camera: index or device "
                   "path (0 = /dev/video0), with the default microphone unless --no-mic")
    p.add_argument("--no-camera", action="store_true", help="audio only")
    p.add_argument("--mic", default=None, metavar="NAME", help="microphone device (default with --camera: default)")
    p.add_argument("--mic-backend", default="alsa", choices=["alsa", "pulse"], help="audio input backend")
    p.add_argument("--no-mic", action="store_true", help="video only")
    p.add_argument("--source", type=Path, metavar="FILE", help="play FILE as the live source instead of devices")
    _speed(p, 1.0, "with --source")
    _common(p)

    p = sub.add_parser("demo", help="play the built-in sample through the whole pipeline",
                       description="Play a built-in sample (speech and moving objects) through the pipeline at "
                       "real-time pace, printing live captions and a streamed answer to a question asked "
                       "mid-stream.")
    _speed(p, 1.0, "real time")
    p.add_argument("--question", default=DEMO_QUESTION, help=f"the scripted question (default: {DEMO_QUESTION!r})")
    p.add_argument("--at", type=_seconds, metavar="SECONDS", help="media time to ask at (default: 60%% through)")
    _common(p, profile="demo")  # the shipped ASR trained on synthetic speech: captions that match the script

    p = sub.add_parser("transcribe", help="stream a file through the ASR and print the live transcript",
                       description="Stream any audio or video file PyAV reads through the streaming ASR and "
                       "print transcript events as they would appear live.")
    p.add_argument("file", type=Path)
    _speed(p, 0.0, "as fast as possible")
    _common(p)

    p = sub.add_parser("ask", help="stream a file and ask a question about it at a media time",
                       description="Stream a file, ask QUESTION when the media reaches --at SECONDS (default: "
                       "the end), and print the streamed answer.")
    p.add_argument("file", type=Path)
    p.add_argument("question")
    p.add_argument("--at", type=_seconds, metavar="SECONDS", help="media time to ask at (default: the end)")
    _speed(p, 0.0, "as fast as possible")
    _common(p)

    p = sub.add_parser("bench", help="benchmarks printing one JSON object",
                       description="Shape-true benchmarks (real architectures' configs with random weights, so "
                       "speed and memory are real and accuracy is not reported), and asr-quality, which scores a "
                       "trained checkpoint's accuracy. Prints one JSON object.")
    bench.add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no status lines on stderr")

    p = sub.add_parser("train", help="train models: causal Whisper LoRA adapters, synthetic speech data, a small "
                       "FastConformer and its word LM",
                       description="Train models with the project's recipes.")
    train.add_arguments(p)
    return parser


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


async def _run_session(
    profile: Profile, models: Models, worker: DeviceWorker, source: Source, args: argparse.Namespace,
    console: Console, questions: Sequence[ScheduledQuestion] = (), interactive: bool = False,
    publish: Callable[[Event], None] | None = None,
) -> int:
    """Returns how many `error` events the session emitted. `publish`: also hand every event to it (serve's
    browser watchers), after the printer."""
    printer = _printer(args)
    session = await Session(profile, models, worker).start()
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


def _setup(profile: Profile, console: Console, answers: bool = True) -> tuple[DeviceWorker, Models]:
    """The worker and the profile's models; `answers=False` (transcribe) loads the ASR alone."""
    random = [(role, ref) for role, ref in (("asr", profile.asr.model), ("lm", profile.lm.model))
              if ref.startswith("tiny:") and (answers or role == "asr")]
    if random:
        noise = " and ".join({"asr": "captions", "lm": "answers"}[role] for role, _ in random)
        models = ", ".join(f"{role} {ref}" for role, ref in random)
        verb = "has" if len(random) == 1 else "have"
        console.status(f"profile '{profile.name}': {models} {verb} random, untrained weights, so its {noise} are "
                       "noise; for real models run with --profile cpu or --profile gpu (see README)")
    require_device(profile.device)
    worker = DeviceWorker(max_pending=profile.pipeline.worker_queue).start()
    started = time.perf_counter()
    try:
        models = load_models(profile, worker, progress=console.status, answers=answers)
    except BaseException:
        worker.stop()
        raise
    console.status(f"models ready in {time.perf_counter() - started:.1f} s on {profile.device}/{profile.dtype}")
    return worker, models


def _file_source(path: Path, speed: float, profile: Profile, video: bool = True) -> Source:
    from runtime.io.file_source import FileSource

    return FileSource(path, chunk_ms=profile.pipeline.audio_chunk_ms, speed=speed, video=video,
                      max_side=profile.video.max_side)


def _run(args: argparse.Namespace, console: Console) -> int:
    # Open the source first: a bad file or a missing camera fails before any model loads.
    profile = load_profile(args.profile, overrides=args.overrides, device=args.device, dtype=args.dtype)
    questions: list[ScheduledQuestion] = []
    interactive = False
    if args.command in ("demo", "ask") and not args.question.strip():
        raise UserError("the question is empty")
    if args.command == "demo":
        from runtime.io.sample import ensure_demo_file

        source = _file_source(ensure_demo_file(), args.speed, profile)
        at = args.at if args.at is not None else round((source.duration or 0.0) * 0.6, 1)
        questions = [ScheduledQuestion(args.question, at)]
    elif args.command in ("transcribe", "ask"):  # transcribe needs no frames: a file without audio is an error
        source = _file_source(args.file, args.speed, profile, video=args.command == "ask")
        if args.command == "ask":
            questions = [ScheduledQuestion(args.question, args.at)]
    else:  # serve
        return _serve(args, profile, console)
    worker, models = _setup(profile, console, answers=args.command != "transcribe")
    console.status(f"playing {source.description}" + (f" at {args.speed:g}x" if args.speed else " unpaced"))
    try:
        errors = asyncio.run(_run_session(profile, models, worker, source, args, console, questions, interactive))
    finally:
        worker.stop()
    if errors:  # each was printed as it happened; a script must not take a failed run for a good one
        print(f"runtime: the session reported {errors} error(s)", file=sys.stderr)
    return 1 if errors else 0


def _serve(args: argparse.Namespace, profile: Profile, console: Console) -> int:
    """The websocket server, plus a local live session when a camera, microphone or file is named."""
    from runtime.web.broadcast import Broadcast
    from runtime.web.server import RealtimeServer

    # Before any source opens or model loads: an open port on the network is refused at once, not after a minute.
    token = args.token or os.environ.get("RUNTIME_TOKEN") or None
    if args.host not in LOOPBACK_HOSTS and token is None:
        raise UserError(f"refusing to bind {args.host} without a token: anyone who can reach it could use the "
                        "models; pass --token TOKEN (or set RUNTIME_TOKEN), or use --host 127.0.0.1")
    source: Source | None = None
    if args.source is not None:
        source = _file_source(args.source, args.speed, profile)
    elif args.camera is not None or args.mic is not None or args.no_camera:
        source = _live_source(args, profile)
    worker, models = _setup(profile, console)

    async def main() -> None:
        stop = asyncio.Event()
        if source is None:  # before the "serving" line: a signal sent after it always stops cleanly
            on_stop_signals(stop.set)
        try:
            server = await RealtimeServer(profile, models, worker, host=args.host, port=args.port,
                                          max_sessions=args.max_sessions, token=token,
                                          allow_origins=args.allow_origins).start()
        except OSError as err:
            raise UserError(f"cannot serve on {args.host}:{args.port}: {err.strerror or err}") from None
        console.status(f"serving the browser demo at http://{args.host}:{server.port}/ and the websocket at "
                       f"ws://{args.host}:{server.port}/v1/realtime (health: /healthz)")
        try:
            if source is not None:
                server.local = Broadcast(source.description)
                console.status(f"playing {source.description}" + (f" at {args.speed:g}x" if args.speed else "")
                               + f"; watch it at http://{args.host}:{server.port}/?watch=1")
                await _run_session(profile, models, worker, source, args, console, (), True, server.local.publish)
            else:
                await stop.wait()
        finally:
            await server.stop()

    try:
        asyncio.run(main())
    finally:
        worker.stop()
    return 0


def _live_source(args: argparse.Namespace, profile: Profile) -> Source:
    from runtime.io.devices import CameraSource, LiveSource, MicrophoneSource, camera_path

    if args.no_camera and args.no_mic:
        raise UserError("--no-camera and --no-mic leave nothing to listen to or watch")
    camera = None
    if not args.no_camera and args.camera is not None:
        camera = CameraSource(camera_path(args.camera), fps=max(profile.video.fps, 1.0),
                              max_side=profile.video.max_side)
    mic = None if args.no_mic else MicrophoneSource(args.mic or "default", backend=args.mic_backend,
                                                   chunk_ms=profile.pipeline.audio_chunk_ms)
    return LiveSource(camera, mic)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    terminate_like_ctrl_c()
    console = Console(getattr(args, "quiet", False))
    try:
        if args.command == "bench":
            return bench.run(args, console.status)
        if args.command == "train":
            return train.run(args)
        return _run(args, console)
    except UserError as err:
        console.close()
        print(f"runtime: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        console.close()
        print("runtime: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
