"""`runtime bench remote-lm [--quick] [--json] [--lm-url URL]`: a remote answerer's time to first token at
question time, after 1k and 4k tokens of streamed context (`--quick`: 500), with and without prefix-cache warming.

Why: a remote server prefills whatever it has not cached when the question comes. The remote answerer
(`lm.backend = openai`) keeps the prompt append-only and warms the server's prefix cache while the transcript
streams in (`pipeline/prefix_warming.py`), so at question time only the question is left. This measures what
that buys, against a real server.

How: the server is `--lm-url` (any /v1/chat/completions server; `--lm-model` names its model), or else llama.cpp's
own (llama-cpp-python[server], the shipped SmolLM2-135M GGUF, 2 threads, started here; a row says why when it is
not installed). For each context size a real session (`open_session`, the remote answerer, its warmer) receives
a scripted meeting transcript line by line as user items, paced like speech arriving (`LINE_GAP_S` apart), then
a question; time to first token is `response.create` to the first `response.output_text.delta`. Before each run
an unrelated request replaces the server's cache (llama.cpp keeps one prompt), so a run without warming starts
cold, as a question after an hour of unrelated traffic would. Context tokens are counted with the shipped model's
tokenizer when the server runs it (else characters / 4, and `tokens_estimated` says so).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

from runtime.bench.llama_server import LlamaServer, installed
from runtime.bench.timing import machine
from runtime.chunks import AudioChunk
from runtime.config import Profile, with_overrides
from runtime.loaded_models import Models
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.lm import NoAnswerer
from runtime.models.lm.remote_answerer import RemoteAnswerer
from runtime.profile_files import load_profile
from runtime.session_builder import open_session
from runtime.worker import DeviceWorker

SIZES = (1000, 4000)  # tokens of streamed context before the question
# --quick: one size, small enough that the cold row (llama.cpp prefilling it all at question time: 100-180 tok/s
# on 2 busy cores, 65-73 s for 1k tokens at load 5) leaves the run within 3 minutes; the warm row and the
# paired speedup are measured on the same lines
QUICK_SIZES = (500,)
LINE_GAP_S = 0.05  # between transcript lines: a fast talker, so the warmer has little slack
WARM_INTERVAL_S = 0.5
QUESTION = "When is the weekly meeting, and who brings the budget numbers?"
NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lucas", "Priya", "Omar", "Elena"]
TOPICS = ["the budget for the third quarter", "the launch of the new app", "hiring two engineers",
          "the office move to Lisbon", "customer feedback on the beta", "the security audit"]


def transcript_lines(n: int) -> list[str]:
    """A deterministic meeting: who said what about which topic, with numbers and times, `n` lines."""
    lines = ["The weekly meeting moved to Thursday at ten.", "Maria will bring the budget numbers."]
    i = 0
    while len(lines) < n:
        who, topic = NAMES[i % len(NAMES)], TOPICS[(i * 5) % len(TOPICS)]
        lines.append(f"{who} said the work on {topic} is {20 + (i * 7) % 80} percent done and asked for an update "
                     f"by {1 + i % 12} o'clock on day {1 + i % 28}.")
        i += 1
    return lines[:n]


class _Deaf:
    """The bench's transcript arrives as typed items: a session needs an ASR, and this one hears nothing."""

    name = "deaf"

    def open_stream(self) -> _Deaf:
        return self

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        return []

    def finish(self) -> list[TranscriptUpdate]:
        return []

    def close(self) -> None:
        pass


def _profile(url: str, model: str, warm: bool) -> Profile:
    lm = {"backend": "openai", "base_url": url, "model": model, "max_new_tokens": 8, "warm_interval_s":
          WARM_INTERVAL_S if warm else 0.0, "request_timeout_s": 600.0}
    return with_overrides(load_profile("tiny"), lm=lm, pipeline={"metrics_interval_s": 0.0})


async def _run(url: str, model: str, lines: list[str], warm: bool, worker: DeviceWorker,
               status: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    profile = _profile(url, model, warm)
    remote = RemoteAnswerer.load(profile.lm)
    status("remote-lm: replacing the server's cache with an unrelated conversation")
    await remote.warm("(an unrelated conversation that replaces the server's cache) " + "x " * 64)
    status(f"remote-lm: streaming {len(lines)} lines, then asking (the first token can take a minute on 2 cores)")
    session = await open_session(profile, Models(_Deaf(), NoAnswerer(), remote=remote), worker)
    await session.start()
    try:
        for line in lines:
            await session.add_item("user", line)
            await asyncio.sleep(LINE_GAP_S)
        if warm:  # the transcript has stopped: the warmer's last request lands, then the question comes
            deadline = time.monotonic() + 120
            while session.warmer is not None and not session.warmer.caught_up \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        asked = time.perf_counter()
        rid = await session.create_response(text=QUESTION)
        first, error = None, None
        while True:
            event = await asyncio.wait_for(session.events.get(), 300)
            if event is None:
                raise RuntimeError("the session ended before its answer")
            if event.type == "error":
                error = event.error["message"]
            if event.type == "response.output_text.delta" and first is None:
                first = time.perf_counter() - asked
            if event.type == "response.done" and event.response["id"] == rid:
                status = event.response["status"]
                break
        return {"ttft_s": None if first is None else round(first, 4), "status": status,
                "warm_requests": session.warmer.sent if session.warmer else 0, **({"error": error} if error else {})}
    finally:
        await session.stop()


def _count_tokens(text: str, builtin: bool) -> tuple[int, bool]:
    if builtin:
        from runtime.models.lm.tokenizer import load_tokenizer
        from runtime.models.loading import resolve_checkpoint

        tokenizer, _ = load_tokenizer(resolve_checkpoint("builtin:smollm2-135m-instruct", role="lm"))
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]), False
    return len(text) // 4, True


def run(args: argparse.Namespace, status: Any) -> dict[str, Any]:  # noqa: ANN401 (the bench's status callback)
    sizes = QUICK_SIZES if args.quick else SIZES
    url, model = getattr(args, "lm_url", None), getattr(args, "lm_model", None) or "smollm2"
    out: dict[str, Any] = {"bench": "remote-lm", "quick": bool(args.quick), "machine": machine("cpu", None, 0),
                           "question": QUESTION, "line_gap_s": LINE_GAP_S, "warm_interval_s": WARM_INTERVAL_S,
                           "sizes": list(sizes)}
    server = None
    if url is None:
        reason = installed()
        if reason is not None:
            out["rows"] = [{"server": "llama.cpp", "skipped": reason}]
            return out
        status("remote-lm: starting llama.cpp's server on the shipped SmolLM2 (2 threads)")
        server = LlamaServer(n_ctx=8192, threads=2).start()
        url = server.base_url
    out["server"] = {"url": url, "model": model, "llama_cpp": server is not None}
    rows = []
    try:
        with DeviceWorker() as worker:
            for size in sizes:
                lines, n = [], 0
                for line in transcript_lines(10_000):  # as many lines as make `size` tokens
                    lines.append(line)
                    n += len(line) // 4
                    if n >= size:
                        break
                tokens, estimated = _count_tokens("\n".join(lines), server is not None)
                row: dict[str, Any] = {"context_tokens": tokens, "tokens_estimated": estimated, "lines": len(lines)}
                for warm in (False, True):
                    status(f"remote-lm: {tokens} tokens of context, {'with' if warm else 'without'} warming")
                    row["warm" if warm else "cold"] = asyncio.run(_run(url, model, lines, warm, worker, status))
                cold, hot = row["cold"]["ttft_s"], row["warm"]["ttft_s"]
                row["speedup"] = round(cold / hot, 2) if cold and hot else None
                rows.append(row)
    finally:
        if server is not None:
            server.stop()
    out["rows"] = rows
    return out
