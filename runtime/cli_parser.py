"""The command line's grammar: `runtime serve|demo|transcribe|ask|profiles|bench|train` and their options.

Kept apart from `cli.py` (what the commands do) so that either reads on its own: every flag with its help and
default here, the data path there. Argument types refuse nan, inf and out-of-range numbers as argparse errors,
before anything loads.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from runtime import __version__, bench, train
from runtime.profile_files import DEFAULT_PROFILE, available_profiles

DEMO_QUESTION = "What did the red ball do?"

def _common(p: argparse.ArgumentParser) -> None:
    """The profile and output flags every session command shares; all four default to one profile, so a user need
    not guess which command sees what (`runtime profiles` lists them)."""
    g = p.add_argument_group("profile")
    g.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile name in configs/ or a .toml path (default: "
                   f"{DEFAULT_PROFILE}; known: {', '.join(available_profiles()) or 'none'}; runtime profiles "
                   "says what each loads)")
    g.add_argument("--device", help="override the profile's device: cpu, cuda, cuda:N")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="override the profile's dtype")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any profile field, e.g. --set asr.model=/models/whisper-base (repeatable)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON event per line on stdout")
    o.add_argument("--metrics", action="store_true", help="also print metrics events in text mode")
    o.add_argument("-q", "--quiet", action="store_true", help="no status lines or progress on stderr")
    o.add_argument("--trace-jobs", type=Path, metavar="FILE", help="write every job the device worker runs (ASR "
                   "chunks, prefills, decode steps, synthesis: its thread, priority, start and duration) to FILE as "
                   "Chrome trace-event JSON, to open in https://ui.perfetto.dev: where a turn's latency goes")


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
                   help="sessions admitted at once, websocket and WebRTC together; the next is refused with "
                        "server_busy (default: 8)")
    p.add_argument("--camera", default=None, metavar="N|PATH", help="caption a local camera: index or device "
                   "path (0 = /dev/video0), with the default microphone unless --no-mic")
    p.add_argument("--no-camera", action="store_true", help="audio only")
    p.add_argument("--mic", default=None, metavar="NAME", help="microphone device (default with --camera: default)")
    p.add_argument("--mic-backend", default="alsa", choices=["alsa", "pulse"], help="audio input backend")
    p.add_argument("--no-mic", action="store_true", help="video only")
    p.add_argument("--source", type=Path, metavar="FILE", help="play FILE as the live source instead of devices; "
                   "the server stops when it ends (Ctrl-D or Ctrl-C before)")
    p.add_argument("--speak", action="store_true", help="with --camera, --mic or --source: answer each spoken turn "
                   "(and typed question) aloud with the voice (builtin:piper-en-us-joe-medium) through the output "
                   "device (--speaker). While it speaks, and 0.3 s after, the microphone is gated (silenced), so it "
                   "does not answer itself: you cannot interrupt it by voice (type /cancel)")
    p.add_argument("--speaker", default="default", metavar="NAME", help="output device for --speak (ALSA name, "
                   "aplay -L; default: default)")
    _speed(p, 1.0, "with --source")
    _common(p)

    p = sub.add_parser("demo", help="play the built-in sample through the whole pipeline",
                       description="Play a built-in sample (speech and moving objects) through the pipeline at "
                       "real-time pace, printing live captions and a streamed answer to a question asked "
                       "mid-stream.")
    _speed(p, 1.0, "real time")
    p.add_argument("--question", default=DEMO_QUESTION, help=f"the scripted question (default: {DEMO_QUESTION!r})")
    p.add_argument("--at", type=_seconds, metavar="SECONDS", help="media time to ask at (default: 60%% through)")
    _common(p)

    p = sub.add_parser("transcribe", help="stream a file through the ASR and print the live transcript",
                       description="Stream any audio or video file PyAV reads through the streaming ASR and "
                       "print transcript events as they would appear live.")
    p.add_argument("file", type=Path, help="an audio or video file with an audio track (wav, mp3, mp4, ...)")
    p.add_argument("--language", metavar="CODE", help="the language spoken (ISO 639-1: en, de, es, fr, ...; default: "
                   "the profile's asr.language, which multilingual profiles leave empty: detected)")
    p.add_argument("--translate", action="store_true", help="write the captions in English whatever the language "
                   "spoken (Whisper's translate task; multilingual profiles: --profile whisper-base)")
    _speed(p, 0.0, "as fast as possible")
    _common(p)

    p = sub.add_parser("ask", help="stream a file and ask a question about it at a media time",
                       description="Stream a file, ask QUESTION when the media reaches --at SECONDS (default: "
                       "the end), and print the streamed answer.")
    p.add_argument("file", type=Path, help="an audio or video file (its frames are seen when the model can see)")
    p.add_argument("question", help="the question, asked at --at")
    p.add_argument("--at", type=_seconds, metavar="SECONDS", help="media time to ask at (default: the end)")
    p.add_argument("--speak", type=Path, metavar="WAV", help="also speak the answer with the voice (builtin:piper-"
                   "en-us-joe-medium; clause by clause as it decodes) and write it to WAV (16-bit mono, 22,050 Hz)")
    _speed(p, 0.0, "as fast as possible")
    _common(p)

    p = sub.add_parser("profiles", help="list the profiles: what each loads, hears and sees, and what it costs",
                       description="List every profile in configs/ (and $RUNTIME_CONFIGS), one line each: the models "
                       "it loads, what it hears and sees, and its cost (load time and resident memory where "
                       "measured, else the models' size), the default marked. Reads the TOML files only: no model "
                       "loads.")
    p.add_argument("--json", action="store_true", help="print one JSON object: the default and every profile")

    p = sub.add_parser("bench", help="benchmarks printing one JSON object",
                       description="Benchmarks, each printing one JSON object. Speed and memory run shape-true (real "
                       "architectures' configs; random weights where no real checkpoint ships, and then no "
                       "accuracy is reported); asr-quality, answers, video-qa, turns and llm --model score the "
                       "real shipped weights.")
    bench.add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no status lines on stderr")

    p = sub.add_parser("train", help="train models: causal Whisper LoRA adapters, synthetic speech data, a small "
                       "FastConformer and its word LM",
                       description="Train models with the project's recipes.")
    train.add_arguments(p)
    return parser
