"""`runtime bench NAME [--quick] [--json]`: shape-true benchmarks that print one JSON object.

Shape-true: the real architectures' configs with random weights. Compute does not depend on weight values,
so speed and memory are real; accuracy, acceptance rates and answer quality are not, and no benchmark here
reports them. `--quick` shrinks shapes and data (every row and peer kept) so a run fits in 3 minutes on 2 CPU
cores, most in well under one (CI-sized); `llm --model` is the exception: about 5 minutes, most of it compiling
the int8 and int4 decode steps at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.config import require_device
from runtime.errors import UserError

# name -> (module, one-line description); each module has `run(args) -> dict`.
BENCHES: dict[str, tuple[str, str]] = {
    "asr": ("runtime.bench.asr", "streaming ASR: exactness, per-chunk cost, RTF, cost growth, buffered peer"),
    "llm": ("runtime.bench.llm", "language engine: KV window exactness, TTFT, decode speed, verify cost, KV bytes"),
    "asr-quality": ("runtime.bench.asr_quality", "trained ASR: held-out WER/CER streamed at each look-ahead and "
                    "offline, the demo sample's WER; Whisper systems vs peers on synthetic and human speech: WER, "
                    "CER, compute, word latency (needs trained weights)"),
    "video": ("runtime.bench.video", "video path: ingest fps, memory tokens and RSS over an hour, answer TTFT"),
    "serve": ("runtime.bench.serve", "server: N live SDK clients at real-time pace: event latency, loop lag, RSS"),
    "answers": ("runtime.bench.answers", "answer accuracy on the committed question set, from the scripted text "
                "and from espeak-ng speech through the ASR, per prompt variant (needs trained weights)"),
    "video-qa": ("runtime.bench.video_qa", "answers about what was shown and said, asked live at a media time on "
                 "rendered slide talks with narration: accuracy per kind, latency, context tokens, OCR cost (needs "
                 "trained weights)"),
    "grammar": ("runtime.bench.grammar", "constrained decoding (JSON schemas): xgrammar vs llguidance on the real "
                "tokenizer: schema compile time, per-token mask, consume and rollback, mask application"),
    "remote-lm": ("runtime.bench.remote_lm", "a remote answerer (lm.backend = openai): time to first token after 1k "
                  "and 4k tokens of streamed context, with and without warming the server's prefix cache (llama.cpp's "
                  "server on the shipped SmolLM2, or --lm-url)"),
    "turns": ("runtime.bench.turns", "turn detection, server_vad vs semantic_vad, on human speech with pauses inserted "
              "mid-utterance: false cut-offs, end-of-turn delay, Smart Turn calls, CPU"),
    "voice": ("runtime.bench.voice", "the voice (builtin:piper-en-us-joe-medium): synthesis real-time factor against "
              "the piper command on the same text, first-clause synthesis time, round-trip WER through Whisper "
              "tiny.en on 25 spoken answers, output encoding cost, voice-to-voice latency at 1, 2 and 4 "
              "conversations through the server (--profile)"),
}
# the flags that pick a checkpoint or data set, per benchmark that takes them
CHECKPOINT_FLAGS = {"asr-quality": ("model", "data", "systems", "whisper", "chunks", "adapter", "human",
                                    "lookaheads_ms"),
                    "llm": ("model",), "answers": ("model", "data", "prompts", "profile"), "turns": ("human",),
                    "video-qa": ("profile",), "grammar": ("model",), "voice": ("profile",),
                    "remote-lm": ("lm_url", "lm_model")}
NOT_BUILT: dict[str, str] = {}  # name -> the issue that will build it


def _option(dest: str) -> str:
    """The command-line spelling of an argparse destination: lm_url -> --lm-url."""
    return "--" + dest.replace("_", "-")


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def _sessions(text: str) -> tuple[int, ...]:
    """`--sessions 1,2,4`: the concurrent conversations of each phase of `serve --url`, in order."""
    try:
        ns = tuple(int(x) for x in text.split(","))
    except ValueError:
        ns = ()
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1 separated by commas, e.g. 1,2,4; got {text!r}")
    return ns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join([*BENCHES, *NOT_BUILT])
    parser.add_argument("name", metavar="NAME", help=f"which benchmark: {names}")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and less data, every row kept; within 3 minutes on 2 CPU cores "
                             "(llm --model: about 5)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--threads", type=_count, default=0, help="torch CPU threads (0: one per core but one)")
    parser.add_argument("--model", default=None, help="asr-quality: the FastConformer checkpoint to score "
                        "(default: builtin:demo-fastconformer); llm: a real language model (builtin:smollm2-135m-"
                        "instruct, a GGUF file, a checkpoint folder) measured per weight format against "
                        "transformers and llama.cpp, with the speculative-decoding table; grammar: the tokenizer "
                        "whose vocabulary is masked (default: builtin:smollm2-135m-instruct)")
    parser.add_argument("--data", default=None, help="asr-quality: a `runtime train synth-speech` folder whose "
                        "heldout.jsonl to score (default: the fixed held-out set, generated into the cache once); "
                        "answers: a question set in the format of tests/data/answer_set.json")
    parser.add_argument("--systems", default=None, help="asr-quality: which systems, comma-separated, of offline, "
                        "causal, two-pass (causal with each final pass: decoder, offline), previewed (causal and "
                        "causal+offline with --preview-ms previews), buffered, faster-whisper, fastconformer, "
                        "captions, multilingual (Whisper base on espeak-ng German, Spanish, French, with its peers) "
                        "(default: all)")
    parser.add_argument("--whisper", default=None, help="asr-quality: the Whisper of the Whisper systems (default: "
                        "builtin:whisper-tiny.en)")
    parser.add_argument("--chunks", default=None, help="asr-quality: causal Whisper chunk sizes in ms (default: "
                        "100,200,300)")
    parser.add_argument("--adapter", default=None, help="asr-quality: a LoRA folder merged into the causal Whisper "
                        "(default: the whisper-tiny-en profile's, builtin:causal-whisper-tiny.en, when scoring its "
                        "Whisper, as a session streams it; none: the bare block-causal Whisper)")
    parser.add_argument("--lookaheads-ms", default=None, help="asr-quality: the FastConformer look-aheads its own "
                        "report streams at, comma-separated ms, of those the model was trained with (default: all)")
    parser.add_argument("--preview-ms", type=int, default=100, help="asr-quality: the `previewed` systems' "
                        "asr.preview_ms, for each --chunks size it divides (default: 100)")
    parser.add_argument("--refresh-ms", type=_count, default=None, help="asr-quality: the causal systems' "
                        "asr.refresh_ms, stale decoder positions re-fed when a block stops (default: the "
                        "whisper-tiny-en profile's; 300 suits 100 and 200 ms chunks)")
    parser.add_argument("--final-pass-beam", type=int, default=None, help="asr-quality: beams of the two-pass "
                        "systems' offline pass, asr.final_pass_beam (default: the whisper-tiny-en profile's; "
                        "1: greedy)")
    parser.add_argument("--repeats", type=_positive, default=1, help="asr-quality: run each clip this many times and "
                        "count its fastest run's compute, so that other load on the machine moves the ratios less "
                        "(default: 1)")
    parser.add_argument("--graph-runtime", choices=("auto", "torch", "onnxruntime"), default=None,
                        help="asr-quality: what runs the causal systems' encoder layers and decoder step, "
                        "asr.graph_runtime (default: the whisper-tiny-en profile's, auto)")
    parser.add_argument("--prompts", default=None, help="answers: prompt variants, comma-separated, of "
                        "plain, short, quote (default: all)")
    parser.add_argument("--profile", default=None, help="answers: the profile whose language model and ASR answer "
                        "(default: demo); voice: the profile the server answers with (default: the default profile)")
    parser.add_argument("--trace-jobs", type=Path, default=None, metavar="FILE", help="voice: the server's "
                        "`--trace-jobs FILE` (its device worker's jobs as Chrome trace-event JSON)")
    parser.add_argument("--conversations", action="store_true", help="serve: N sessions each holding a "
                        "multi-turn voice conversation with server VAD: turn latency, nothing lost, disconnects")
    parser.add_argument("--url", default=None, metavar="URL", help="serve: drive the conversations through a "
                        "server already running, a fleet's proxy or one replica (ws://HOST:PORT/v1), instead of "
                        "starting one: turn latency and errors per number of sessions (docs/fleet.md)")
    parser.add_argument("--sessions", type=_sessions, default=None, metavar="M,M,...", help="serve --url: the "
                        "concurrent conversations of each phase (default: 1,2,4; --quick: 1,2)")
    parser.add_argument("--lm-url", default=None, metavar="URL", help="remote-lm: an OpenAI-compatible server's "
                        "base URL (http://HOST:PORT/v1; default: start llama.cpp's server on the shipped SmolLM2)")
    parser.add_argument("--lm-model", default=None, metavar="NAME", help="remote-lm: the model name that server "
                        "knows (default: smollm2)")
    parser.add_argument("--human", default=None, help="asr-quality, turns: a folder of human speech with "
                        "manifest.jsonl (default: ../shared/speech/dev beside the repository)")


def run(args: argparse.Namespace, status: Callable[[str], None]) -> int:
    if args.name in NOT_BUILT:
        print(f"runtime bench {args.name}: not built yet: arrives with {NOT_BUILT[args.name]}.", file=sys.stderr)
        return 2
    if args.name not in BENCHES:
        print(f"runtime: error: unknown benchmark {args.name!r} (known: {', '.join(BENCHES)})", file=sys.stderr)
        return 2
    flags = list(dict.fromkeys(flag for names in CHECKPOINT_FLAGS.values() for flag in names))
    given = [flag for flag in flags if getattr(args, flag, None) is not None]
    wrong = [_option(flag) for flag in given if flag not in CHECKPOINT_FLAGS.get(args.name, ())]
    if wrong:
        takers = ", ".join(f"{name} ({', '.join(map(_option, fl))})" for name, fl in CHECKPOINT_FLAGS.items())
        raise UserError(f"{' and '.join(wrong)}: {args.name} does not take it; the benchmarks that score a checkpoint "
                        f"or data set: {takers}")
    require_device(args.device)  # a missing GPU is one line here, not torch's assertion mid-benchmark
    name = BENCHES[args.name][0]
    if args.name == "llm" and args.model is not None:  # a real model, not the shapes
        from runtime.bench.llm_big import is_big

        name = "runtime.bench.llm_big" if is_big(args.model) else "runtime.bench.llm_model"
    if getattr(args, "sessions", None) is not None and getattr(args, "url", None) is None:
        raise UserError("--sessions: only with runtime bench serve --url URL")
    if getattr(args, "trace_jobs", None) is not None and args.name != "voice":
        raise UserError(f"--trace-jobs: {args.name} does not take it; `runtime bench voice` passes it to its server "
                        "(or run `runtime serve --trace-jobs FILE` and drive it yourself)")
    if getattr(args, "url", None) is not None:
        if args.name != "serve":
            raise UserError(f"--url: {args.name} does not take it; it is a mode of `runtime bench serve`")
        name = "runtime.bench.serve_url"
    elif getattr(args, "conversations", False):
        if args.name != "serve":
            raise UserError(f"--conversations: {args.name} does not take it; it is a mode of `runtime bench serve`")
        name = "runtime.bench.serve_conversations"
    module = importlib.import_module(name)
    result: dict[str, Any] = module.run(args, status)
    print(json.dumps(result, indent=None if args.json else 2, sort_keys=False))
    return 0
