"""`runtime bench video-qa [--quick] --json`: a home StreamingBench. Are the answers about what the camera showed
and what was said right, when asked live at a moment of the stream?

Talks (`data/video_qa.json`) are rendered offline once into the cache: slides in a real font (titles, bullets,
numbers, names, dates) and scenes without text, 1280x720 at 1 fps, narrated by espeak-ng (one American voice,
seeded) that sometimes repeats the slide and sometimes adds what it does not show. Each talk is played unpaced
through the runtime's real path (`open_session` + `feed`, the profile's ASR, screen reader and answerer), and its
questions are asked at their media times, as `runtime ask --at` asks them; unpaced, nothing more is pushed while
an answer runs, so every machine answers from the same stream.

Per question kind (realtime, backward, speech_screen, not_yet): accuracy by expected keywords (`answers.is_right`;
a not_yet answer is right when it says the answer is not known and does not give it), and how many of the
questions had their answer in the context when asked (`answer_in_context`: a miss with the answer there is the
answerer's, one without it the ASR's or the screen reader's; per talk, `narration_wer` is the transcript's word
error rate against the script). Per talk: answer latency
(response created to first token and to done, wall seconds), the context the answerer holds at the end (tokens,
and those of the "On screen" lines; the screen notes' budget, consolidations and selections), and cost: screen
reads, their CPU seconds per video second, and the whole process's CPU seconds per video minute.
`--quick`: the first talk.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.bench.answers import is_right, says_not_known
from runtime.bench.timing import at_least, at_most, machine
from runtime.chunks import SAMPLE_RATE
from runtime.config import Profile
from runtime.errors import UserError
from runtime.events import Event, Metrics, ResponseCreated, ResponseDone, ResponseTextDelta
from runtime.io.sample import default_cache_dir, write_media_file
from runtime.io.slides import Slide, slide_frames
from runtime.profile_files import load_profile
from runtime.train.text_norm import wer
from runtime.worker import DeviceWorker

if TYPE_CHECKING:
    from runtime.loaded_models import Models

SET = Path(__file__).resolve().parent / "data" / "video_qa.json"
SIZE = (1280, 720)
FPS = 1.0
KINDS = ("realtime", "backward", "speech_screen", "not_yet")
# issue 51's for the default profile (the 1.5B); the issue before it asked 0.8, 0.8, 0.6 and 1.0 of the 135M
TARGETS = {"realtime": 0.9, "backward": 0.9, "speech_screen": 0.8, "not_yet": 1.0}
FIRST_TOKEN_P50_S = 1.0  # issue 51: the default's first token within 1.0 s of the question (p50)
OCR_CPU_S_PER_VIDEO_S = 0.2


def scenery(seconds: float, seed: int) -> np.ndarray:
    """A scene without text: soft colour gradients and discs."""
    rng = np.random.default_rng(seed)
    h, w = SIZE[1], SIZE[0]
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    image = np.stack([(0.5 + 0.4 * np.sin(6 * x * rng.uniform(0.5, 1.5) + c)) for c in rng.uniform(0, 6, 3)], -1)
    for _ in range(5):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 0.56), rng.uniform(0.03, 0.12)
        image[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 1, 3)
    return (image * 255).astype(np.uint8)


def talk_video(talk: dict[str, Any], folder: Path) -> Path:
    """The talk's .mp4 in `folder`, rendered once (named by a hash of its script)."""
    key = hashlib.sha256(json.dumps(talk["scenes"], sort_keys=True).encode()).hexdigest()[:12]
    path = folder / f"{talk['id']}-{key}.mp4"
    if path.is_file():
        return path
    from runtime.train.synthesizers import Voice, resample, synthesize

    voice, rng = Voice("espeak", "en-us"), np.random.default_rng(0)
    total = sum(s["seconds"] for s in talk["scenes"])
    audio = np.zeros(int(total * SAMPLE_RATE), np.float32)
    frames: list[tuple[float, np.ndarray]] = []
    start = 0.0
    for i, scene in enumerate(talk["scenes"]):
        said, rate, _ = synthesize(voice, scene["say"], rng)
        said = resample(said, rate, SAMPLE_RATE)
        at = int((start + 0.3) * SAMPLE_RATE)
        if at + len(said) > int((start + scene["seconds"]) * SAMPLE_RATE):
            raise UserError(f"{talk['id']} scene {i}: the narration ({len(said) / SAMPLE_RATE:.1f} s) outlasts the "
                            f"scene ({scene['seconds']} s)")
        audio[at : at + len(said)] = said
        if scene.get("title"):
            slide = Slide(scene["seconds"], scene["title"], scene.get("lines", []))
            frames += [(start + t, image) for t, image in slide_frames([slide], FPS, SIZE)]
        else:
            image = scenery(scene["seconds"], i)
            frames += [(start + k / FPS, image) for k in range(int(scene["seconds"] * FPS))]
        start += scene["seconds"]
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.mp4")
    write_media_file(partial, audio, frames, FPS)
    partial.rename(path)
    return path


_STAMP = re.compile(r"^\[(\d+):(\d+(?:\.\d+)?)\] (.*)$")


def context_lines(context: str) -> list[tuple[float, str]]:
    """(media seconds, text) of each stamped line of an answerer's context ("[00:08.1] The board ...")."""
    out = []
    for line in context.splitlines():
        if found := _STAMP.match(line):
            out.append((int(found[1]) * 60 + float(found[2]), found[3]))
    return out


def spoken(lines: list[tuple[float, str]]) -> list[str]:
    """The transcript's lines: neither a screen read nor a user's question."""
    return [text for _, text in lines if not text.startswith(("On screen: ", "User: "))]


def held_before(lines: list[tuple[float, str]], at: float, expect: list[list[str]]) -> bool:
    """Whether the context stamped before `at` holds the expected answer: a wrong answer to a question whose
    answer was there is the answerer's miss; one whose answer was not is the ASR's or the screen reader's."""
    return is_right("\n".join(text for t, text in lines if t < at and not text.startswith("User: ")), expect)


def score(question: dict[str, Any], answer: str) -> bool:
    if question["kind"] == "not_yet":
        return says_not_known(answer, question["forbid"])
    return is_right(answer, question["expect"])


async def play(profile: Profile, models: Models, worker: DeviceWorker, path: Path, questions: list[dict[str, Any]],
               status: Callable[[str], None] | None = None) -> tuple[list[Event], str, float]:
    """Play one talk through a session; (events, the context the answerer read at the end, video seconds). `status`
    hears of each answer as it ends: a talk plays for a minute or more, its answers on a 1.5B for longer."""
    from runtime.feed import ScheduledQuestion, feed
    from runtime.io.file_source import FileSource
    from runtime.session_builder import open_session

    source = FileSource(path, chunk_ms=profile.pipeline.audio_chunk_ms, speed=0, video=True,
                        max_side=profile.video.max_side)
    session = await (await open_session(profile, models, worker)).start()
    events: list[Event] = []

    async def consume() -> None:
        async for event in session.events:
            events.append(event)
            if status is not None and isinstance(event, ResponseDone):
                done = sum(isinstance(e, ResponseDone) for e in events)
                status(f"{path.stem}: answer {done}/{len(questions)} done ({event.response.get('status')})")

    consumer = asyncio.create_task(consume())
    try:
        reached = await feed(source, session, [ScheduledQuestion(q["q"], float(q["at"])) for q in questions])
    finally:
        await source.aclose()
        await session.finish()
        await consumer
    return events, session.conversation.context(), reached


def answers_of(events: list[Event]) -> list[dict[str, Any]]:
    """Each response in order: its question, text, wall seconds to first token and to done, and the words nothing
    heard or shown mentioned when `lm.grounded` answered without the model (else None)."""
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, ResponseCreated):
            out[str(e.response.get("id"))] = {"question": e.response.get("question"), "created": e.wall_time,
                                              "text": "", "first": None, "done": None, "not_heard": None}
        elif isinstance(e, ResponseTextDelta) and e.response_id in out:
            r = out[e.response_id]
            r["first"] = r["first"] or e.wall_time
            r["text"] += e.delta
        elif isinstance(e, ResponseDone) and str(e.response.get("id")) in out:
            r = out[str(e.response.get("id"))]
            r["done"] = e.wall_time
            grounding = e.response.get("grounding")
            r["not_heard"] = grounding.get("not_heard") if isinstance(grounding, dict) else None
    return list(out.values())


def run(args: argparse.Namespace, status: Callable[[str], None]) -> dict[str, Any]:
    from runtime.loaded_models import load_models

    data = json.loads(SET.read_text())
    talks = data["talks"][:1] if args.quick else data["talks"]
    profile = load_profile(getattr(args, "profile", None) or "whisper-tiny-en")
    if profile.random_weights:
        raise UserError(f"profile {profile.name} has random weights: its answers mean nothing; use a profile with "
                        "trained models (default: whisper-tiny-en)")
    if not profile.screen.read:
        raise UserError(f"profile {profile.name} does not read text on screen (screen.read = false)")
    folder = default_cache_dir() / "video-qa"
    status(f"rendering {len(talks)} talk(s) into {folder} (once) ...")
    paths = [talk_video(t, folder) for t in talks]
    worker = DeviceWorker(max_pending=profile.pipeline.worker_queue, threads=profile.pipeline.worker_threads).start()
    try:
        models = load_models(profile, worker, progress=status)
        tokenizer = getattr(models.answerer, "tokenizer", None)
        rows, per_talk = [], []
        for talk, path in zip(talks, paths, strict=True):
            status(f"{talk['id']}: {len(talk['questions'])} questions ...")
            cpu = time.process_time()
            events, context, seconds = asyncio.run(play(profile, models, worker, path, talk["questions"], status))
            cpu = time.process_time() - cpu
            got = answers_of(events)
            if len(got) != len(talk["questions"]):
                raise RuntimeError(f"{talk['id']}: {len(got)} responses for {len(talk['questions'])} questions")
            lines = context_lines(context)
            for q, a in zip(talk["questions"], got, strict=True):
                rows.append({"talk": talk["id"], "at": q["at"], "kind": q["kind"], "question": q["q"],
                             "answer": a["text"].strip(), "right": score(q, a["text"]),
                             "answer_in_context": held_before(lines, q["at"], q["expect"]) if "expect" in q else None,
                             "first_token_s": round(a["first"] - a["created"], 3) if a["first"] else None,
                             "done_s": round(a["done"] - a["created"], 3) if a["done"] else None,
                             "not_heard": a["not_heard"]})
            metrics = [e for e in events if isinstance(e, Metrics)][-1].metrics
            screen = metrics.get("screen", {})
            screen_lines = "\n".join(line for line in context.splitlines() if "] On screen: " in line)
            per_talk.append({
                "talk": talk["id"], "video_s": round(seconds, 1), "questions": len(got),
                # the narration as the transcript holds it, against the script (percent, text_norm.normalize)
                "narration_wer": round(100 * wer([" ".join(s["say"] for s in talk["scenes"])],
                                                 [" ".join(spoken(lines))]), 1),
                "context_tokens": len(tokenizer(context)["input_ids"]) if tokenizer else None,
                "screen_tokens": len(tokenizer(screen_lines)["input_ids"]) if tokenizer else None,
                "screens": screen.get("screens"), "ocr_reads": screen.get("reads"),
                # the screen notes' budget: what fills it, batches that rewrote older lines, screens given to questions
                "screen_notes": {k: screen.get(k) for k in ("context_tokens", "budget_tokens", "consolidations",
                                                              "recut_tokens", "selected")},
                "ocr_cpu_s_per_video_s": round(screen.get("read_s", 0.0) / seconds, 4) if seconds else None,
                "cpu_s_per_video_min": round(cpu / seconds * 60, 1) if seconds else None,
                # where that time went: the worker's seconds by kind of job, and the tokens the context prefilled
                "worker_busy_s": metrics["worker"]["busy_by_priority_s"],
                "prefilled_tokens": metrics["answers"]["prefilled_tokens"],
                "context": context})  # what the last answer read: the transcript and the screens, in order
    finally:
        worker.stop()
    check = getattr(models.answerer, "refusal_check", None)  # lm.not_known_reply: answers that would have refused
    accuracy = {k: _rate([r for r in rows if r["kind"] == k]) for k in KINDS}
    latency = {key: _median([r[key] for r in rows if r[key] is not None]) for key in ("first_token_s", "done_s")}
    ocr = max((t["ocr_cpu_s_per_video_s"] or 0.0) for t in per_talk)
    targets = {f"{k}_accuracy": at_least(accuracy[k]["rate"], TARGETS[k]) for k in KINDS}
    targets["ocr_cpu_s_per_video_s"] = at_most(ocr, OCR_CPU_S_PER_VIDEO_S)
    targets["first_token_p50_s"] = at_most(latency["first_token_s"], FIRST_TOKEN_P50_S)
    return {"bench": "video-qa", "quick": bool(args.quick), "profile": profile.name, "lm": profile.lm.model,
            "asr": profile.asr.model,
            "answering": {"grounded": profile.lm.grounded, "answers_in_context": profile.lm.answers_in_context,
                          "refusal_check": None if check is None else {"checked": check.checked,
                                                                       "answered": check.overturned}},
            "accuracy": accuracy, "latency_median_s": latency, "talks": per_talk,
            "targets": targets, "questions": rows, "machine": machine("cpu", profile.dtype, profile.threads)}


def _rate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    right = sum(r["right"] for r in rows)
    return {"right": right, "asked": len(rows), "rate": round(right / len(rows), 3) if rows else None,
            "not_known_without_model": sum(r["not_heard"] is not None for r in rows),  # `lm.grounded` answered
            # questions whose answer the context held when asked (None: not_yet, whose answer must not be there)
            "answer_in_context": (sum(bool(r["answer_in_context"]) for r in rows)
                                  if all(r["answer_in_context"] is not None for r in rows) else None)}


def _median(values: list[float]) -> float | None:
    return round(float(np.median(values)), 3) if values else None
