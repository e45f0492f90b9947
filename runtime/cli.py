"""`runtime serve|demo|transcribe|ask|profiles|bench|train`: what each command does (its flags: `cli_parser.py`).

Every command loads a profile (`--profile`, `--device`, `--dtype`, `--set`), opens its source before
loading models (so a bad file or a missing camera fails at once), loads the models on the device worker,
and runs its session at the terminal (events on stdout, status on stderr: `cli_session.py`). Errors a user
can fix print one line and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from runtime import bench, train
from runtime.cli_parser import build_parser
from runtime.cli_session import Console, run_session
from runtime.config import Profile, require_device
from runtime.errors import UserError
from runtime.feed import ScheduledQuestion
from runtime.io.source import Source
from runtime.job_trace import JobTrace
from runtime.profile_files import load_profile
from runtime.stop_signals import on_stop_signals, terminate_like_ctrl_c
from runtime.worker import DeviceWorker

if TYPE_CHECKING:
    from runtime.io.file_source import FileSource
    from runtime.loaded_models import Models

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")  # where `serve` needs no token: only this machine can connect


def _setup(profile: Profile, console: Console, answers: bool = True,
           trace: Path | None = None) -> tuple[DeviceWorker, Models]:
    """The worker (recording its jobs to `trace` when given) and the profile's models; `answers=False` (transcribe)
    loads the ASR alone. The models' code (torch, transformers) is imported here, after the source opened: a
    mistyped file name fails at once."""
    from runtime.loaded_models import load_models

    console.quiet_libraries()

    random = [(role, ref) for role, ref in (("asr", profile.asr.model), ("lm", profile.lm.model))
              if ref.startswith("tiny:") and (answers or role == "asr")]
    if random:
        noise = " and ".join({"asr": "captions", "lm": "answers"}[role] for role, _ in random)
        models = ", ".join(f"{role} {ref}" for role, ref in random)
        verb = "has" if len(random) == 1 else "have"
        console.status(f"profile '{profile.name}': {models} {verb} random, untrained weights, so its {noise} are "
                       "noise; for real models offline run with the default profile, --profile demo (runtime "
                       "profiles lists them)")
    require_device(profile.device)
    jobs = JobTrace(trace) if trace is not None else None
    if jobs is not None:
        console.status(f"tracing the worker's jobs to {trace} (open it in https://ui.perfetto.dev)")
    worker = DeviceWorker(max_pending=profile.pipeline.worker_queue, threads=profile.pipeline.worker_threads,
                          trace=jobs).start()
    started = time.perf_counter()
    try:
        models = load_models(profile, worker, progress=console.status, answers=answers)
    except BaseException:
        worker.stop()
        raise
    console.status(f"models ready in {time.perf_counter() - started:.1f} s on {profile.device}/{profile.dtype}")
    _freeze_heap()
    return worker, models


def _freeze_heap() -> None:
    """Take what exists now (torch's and transformers' modules, the models) out of the garbage collector's view.
    Those objects live as long as the process, yet each full collection walked them all: about 370,000 objects, a
    1.4 s pause holding the GIL (the event loop included) on a 2-core machine, and the same walk again at exit,
    which made `runtime serve` take 14 s to stop after Ctrl-C. Frozen, a collection walks only what came after."""
    gc.collect()
    gc.freeze()


def without_unseen_screen(profile: Profile, has_video: bool) -> Profile:
    """`profile` without its screen reader when the file has no picture to read (a .wav): PP-OCRv4 is not loaded
    for nothing."""
    if has_video or not profile.screen.read:
        return profile
    return replace(profile, screen=replace(profile.screen, read=False))


def _file_source(path: Path, speed: float, profile: Profile, video: bool = True) -> FileSource:
    from runtime.io.file_source import FileSource

    return FileSource(path, chunk_ms=profile.pipeline.audio_chunk_ms, speed=speed, video=video,
                      max_side=profile.video.max_side)


def _speech_overrides(args: argparse.Namespace) -> list[str]:
    """`transcribe --language CODE --translate` as the profile fields they set (asr.language, asr.task)."""
    language = getattr(args, "language", None)
    if language is not None and not (language.isascii() and language.isalpha() and language.islower()
                                     and 2 <= len(language) <= 3):
        raise UserError(f"--language {language!r}: give a language code like en, de, es or fr")
    return ([f"asr.language={language}"] if language is not None else []) + (
        ["asr.task=translate"] if getattr(args, "translate", False) else [])


def _run(args: argparse.Namespace, console: Console) -> int:
    # Open the source first: a bad file or a missing camera fails before any model loads.
    profile = load_profile(args.profile, overrides=[*args.overrides, *_speech_overrides(args)], device=args.device,
                           dtype=args.dtype)
    questions: list[ScheduledQuestion] = []
    interactive = False
    if args.command in ("demo", "ask") and not args.question.strip():
        raise UserError("the question is empty")
    if args.command == "demo":
        from runtime.io.sample import ensure_demo_file

        source = _file_source(ensure_demo_file(), args.speed, profile)
        at = args.at if args.at is not None else round((source.duration or 0.0) * 0.6, 1)
        questions = [ScheduledQuestion(args.question, at)]
    elif args.command in ("transcribe", "ask"):  # transcribe takes frames only to read text on screen
        file = _file_source(args.file, args.speed, profile, video=args.command == "ask" or profile.screen.read)
        if args.command == "transcribe" and not file.has_audio:
            raise UserError(f"cannot read {args.file}: no audio stream to transcribe")
        profile = without_unseen_screen(profile, file.has_video)
        source = file
        if args.command == "ask":
            questions = [ScheduledQuestion(args.question, args.at)]
    else:  # serve
        return _serve(args, profile, console)
    speak: Path | None = getattr(args, "speak", None)
    if speak is not None:  # before any model loads: a missing voice package or folder fails at once
        _check_speak_path(speak)
        from runtime.models.tts import DEFAULT_VOICE, check_voice

        check_voice(DEFAULT_VOICE)
    worker, models = _setup(profile, console, answers=args.command != "transcribe", trace=args.trace_jobs)
    console.status(f"playing {source.description}" + (f" at {args.speed:g}x" if args.speed else " unpaced"))
    try:
        if speak is None:
            errors = asyncio.run(run_session(profile, models, worker, source, args, console, questions, interactive))
        else:
            errors = asyncio.run(_ask_and_speak(profile, models, worker, source, args, console, questions, speak))
    finally:
        worker.stop()
    if errors:  # each was printed as it happened; a script must not take a failed run for a good one
        print(f"runtime: the session reported {errors} error(s)", file=sys.stderr)
    return 1 if errors else 0


def _check_speak_path(path: Path) -> None:
    if path.is_dir():
        raise UserError(f"--speak {path}: is a folder; name the wav file to write")
    if not path.parent.is_dir():
        raise UserError(f"--speak {path}: the folder {path.parent} does not exist")


async def _ask_and_speak(
    profile: Profile, models: Models, worker: DeviceWorker, source: Source, args: argparse.Namespace,
    console: Console, questions: Sequence[ScheduledQuestion], path: Path,
) -> int:
    """`ask --speak`: the session as usual, its answer spoken clause by clause on the worker while it decodes."""
    from runtime.io.spoken_answer import SpokenAnswer
    from runtime.models.tts import DEFAULT_VOICE, load_voice
    from runtime.worker import Priority

    started = time.perf_counter()
    voice = await worker.run(Priority.CONTROL, load_voice, DEFAULT_VOICE)
    console.status(f"voice {voice.name} ready in {time.perf_counter() - started:.1f} s")
    speaker = SpokenAnswer(voice, worker, path)
    errors = await run_session(profile, models, worker, source, args, console, questions, publish=speaker.on_event)
    seconds = await speaker.finish()
    first = f"; first clause ready {speaker.first_clause_s:.2f} s after the answer's first words" \
        if speaker.first_clause_s is not None else ""
    console.status(f"spoke the answer: {seconds:.1f} s of audio in {len(speaker.clauses)} clause(s) to {path}{first}")
    return errors


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
        from runtime.io.devices import live_source

        source = live_source(args, profile)
    speech = None
    if args.speak:  # before any model loads: no voice package, no local source or no speaker fails at once
        from runtime.io.playback import local_speech

        speech = local_speech(args, source)
    worker, models = _setup(profile, console, trace=args.trace_jobs)
    models = _with_voice(models, worker, console)

    async def main() -> None:
        stop = asyncio.Event()
        if source is None:  # before the "serving" line: a signal sent after it always stops cleanly
            on_stop_signals(stop.set)
        try:
            local = Broadcast(source.description) if source is not None else None
            server = await RealtimeServer(profile, models, worker, host=args.host, port=args.port,
                                          max_sessions=args.max_sessions, token=token,
                                          allow_origins=args.allow_origins, local=local).start()
        except OSError as err:
            raise UserError(f"cannot serve on {args.host}:{args.port}: {err.strerror or err}") from None
        console.status(f"serving the browser demo at http://{args.host}:{server.port}/ and the websocket at "
                       f"ws://{args.host}:{server.port}/v1/realtime (health: /healthz)")
        try:
            if source is not None and local is not None:
                console.status(f"playing {source.description}" + (f" at {args.speed:g}x" if args.speed else "")
                               + f"; watch it at http://{args.host}:{server.port}/?watch=1")
                if speech is None:
                    await run_session(profile, models, worker, source, args, console, (), True, local.publish)
                else:
                    try:
                        await run_session(profile, models, worker, speech.source(source), args, console, (), True,
                                          speech.publish(local.publish), speech.config(profile, models))
                    finally:
                        console.status(speech.close())
                console.status(f"{source.description} ended: stopping the server")
            else:
                await stop.wait()
        finally:
            await server.stop()

    try:
        asyncio.run(main())
    finally:
        worker.stop()
    return 0


def _with_voice(models: Models, worker: DeviceWorker, console: Console) -> Models:
    """The server's models with the voice (loaded on the worker), so clients may ask for spoken answers; without
    the voice's packages it serves text only, said once."""
    from runtime.loaded_models import load_voice_model
    from runtime.worker import Priority

    started = time.perf_counter()
    voice = worker.call(Priority.CONTROL, load_voice_model, console.status)
    if voice is not None:
        console.status(f"voice {voice.name} ready in {time.perf_counter() - started:.1f} s")
        _freeze_heap()
    return replace(models, voice=voice)


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run a parsed command line (`runtime.__main__.main` parses it before this module's imports load torch)."""
    terminate_like_ctrl_c()
    console = Console(getattr(args, "quiet", False))
    try:
        if args.command in ("bench", "train"):
            console.quiet_libraries()
        if args.command == "bench":
            started = time.perf_counter()  # each status line says how far in it is: long benches show their stages

            def timed(line: str) -> None:
                console.status(f"[{time.perf_counter() - started:5.0f} s] {line}")

            return bench.run(args, timed)
        if args.command == "train":
            return train.run(args)
        if args.command == "profiles":
            from runtime.profile_list import run as list_profiles

            return list_profiles(args, sys.stdout)
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
