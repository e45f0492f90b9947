"""`runtime bench answers [--quick] --json`: are the answers right? The committed question set
(`tests/data/answer_set.json`: scripted meetings, instructions and stories with numbers, names and times) run
through the runtime's answering path, and scored by expected keywords.

The path is the pipeline's: each transcript line becomes a completed transcript item at its media time, the
transcript memory renders the context, and the answerer's stream is prefilled as each line lands (what the
pipeline's prefill jobs do); the question is asked after `after_line` lines. Two inputs:
- `text`: the scripted lines themselves;
- `speech`: the lines spoken by espeak-ng and transcribed by the profile's streaming ASR, so ASR errors count.

Besides the 25 questions answered in the transcript's own words (issue 51's targets count these), each item asks
one in other words than the transcript's (`reworded`) and one before the line that answers it (`not_yet`: right
when the answer says it is not known yet); `*_by_type` counts each kind.

Prompt variants (`--prompts`, default all of `VARIANTS`) report accuracy each: the system prompt and answer
length a small model needs are measured here, not guessed. The model is loaded once and shared by the variants,
and each item's lines are prefilled once for all its questions (one stream per item, as a session keeps one).
`--quick` keeps every variant and both inputs on the first item's questions (`QUICK_ITEMS`).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from runtime.config import LMConfig
from runtime.errors import UserError
from runtime.memory.conversation import Conversation
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.lm.engine_answerer import EngineAnswerer
from runtime.models.loading import configure_threads
from runtime.profile_files import load_profile

Status = Callable[[str], None]
DEFAULT_SET = Path(__file__).resolve().parents[2] / "tests" / "data" / "answer_set.json"
LINE_S = 4.0  # media seconds per scripted line
# words that say an answer is not known (a not_yet question's right answer holds one; video-qa's too)
NOT_KNOWN = ["not", "no", "unknown", "yet", "don't", "doesn't", "cannot", "can't", "isn't", "unclear", "unsure"]
VARIANTS: dict[str, dict[str, Any]] = {
    "profile": {},  # the profile's own system prompt and answer length (demo's says what is not known yet)
    # the same without its refusal check (lm.not_known_reply; models/lm/refusal_check.py): what the check changes
    "profile-unchecked": {"not_known_reply": ""},
    # the other variants' prompts name no reply for what is not known: no check
    "plain": {"system_prompt": LMConfig().system_prompt, "max_new_tokens": 48, "not_known_reply": ""},
    "short": {"system_prompt": "You answer questions about a live transcript. Answer in one short sentence, using "
                               "only facts from the transcript.", "max_new_tokens": 32, "not_known_reply": ""},
    "quote": {"system_prompt": "You answer questions about a live transcript. Reply with one short sentence that "
                               "repeats the exact words, names and numbers from the transcript. If the transcript "
                               "does not say, reply that it was not mentioned.", "max_new_tokens": 32,
              "not_known_reply": ""},
}
_NUMBERS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
            "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
            "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30,
            "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}


def normalise(text: str) -> str:
    """Lower case, number words as digits ("forty five" -> "45"), thousands separators dropped."""
    words = re.sub(r"(?<=\d),(?=\d{3})", "", text.lower()).replace("-", " ").split()
    out: list[str] = []
    tens = False  # the last word was a number word of tens ("forty"), which a unit word joins ("forty five")
    for w in words:
        value = _NUMBERS.get(w.strip(".,!?;:'\"()"))
        if value is not None and tens and 0 < value < 10:
            out[-1] = str(int(out[-1]) + value)
            tens = False
        elif value is not None:
            out.append(str(value))
            tens = value >= 20
        else:
            out.append(w)
            tens = False
    return " ".join(out)


def is_right(answer: str, expect: list[list[str]]) -> bool:
    text = normalise(answer)
    return all(any(re.search(rf"(?<![\w]){re.escape(normalise(s))}(?![\w])", text) for s in group)
               for group in expect)


def load_set(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["items"]


def question_type(question: dict[str, Any]) -> str:
    """answerable (in the transcript's own words), reworded (answerable, asked in other words) or not_yet (asked
    before the line that answers it)."""
    return str(question.get("type", "answerable"))


def says_not_known(answer: str, forbid: list[str]) -> bool:
    """Whether `answer` says that the answer is not known (`NOT_KNOWN`) and gives none of the words it may not know
    yet (`forbid`): a right answer to a question asked before its answer was said (here and in video-qa)."""
    return is_right(answer, [NOT_KNOWN]) and not any(is_right(answer, [[word]]) for word in forbid)


def scored(question: dict[str, Any], answer: str) -> bool:
    """Whether `answer` is right: it holds the expected words, or a not_yet question's `says_not_known`."""
    if question_type(question) == "not_yet":
        return says_not_known(answer, question["forbid"])
    return is_right(answer, question["expect"])


def by_type(results: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Right answers of each question type."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        tally = out.setdefault(r["type"], {"right": 0, "asked": 0})
        tally["right"] += r["right"]
        tally["asked"] += 1
    return out


def accuracy(results: list[dict[str, Any]]) -> float:
    """The share right of the answerable questions (the 25 that issue 51's targets count)."""
    answerable = [r["right"] for r in results if r["type"] == "answerable"]
    return round(sum(answerable) / len(answerable), 3) if answerable else 0.0


def transcript_context(lines: list[str]) -> str:
    """The context the pipeline's transcript memory renders for these lines, each a completed item."""
    memory = Conversation()
    for i, line in enumerate(lines):
        memory.apply(TranscriptUpdate(item_id=f"item_{i}", delta="", transcript=line, unstable="", start=i * LINE_S,
                                      end=(i + 1) * LINE_S, completed=True))
    return memory.context()


def ask_all(answerer: EngineAnswerer, items: list[dict[str, Any]], lines_of: Callable[[dict[str, Any]], list[str]],
            status: Status | None = None) -> list[dict[str, Any]]:
    """Each item's questions, asked on one stream per item as a session asks them: the lines land one by one and
    are prefilled, each question is answered after its `after_line` lines, and the answer is released (its tokens
    dropped, the prefilled transcript kept) before the next. Greedy answers are the ones a fresh stream per question
    would give; prefilling the same lines again for every question only cost time (4-5 questions an item). A
    question asked after fewer lines than the one before is answered on those lines: `start` sets the shorter
    context, which the stream rolls back to."""
    results = []
    for item in items:
        if status is not None:
            status(f"answers: {item['id']} ({len(item['questions'])} questions)")
        lines = lines_of(item)
        stream, landed = answerer.open_stream(), 0
        for q in item["questions"]:
            for k in range(landed + 1, q["after_line"] + 1):  # each line lands and is prefilled, as the pipeline does
                stream.set_context(transcript_context(lines[:k]))
                while stream.prefill_step():
                    pass
            landed = q["after_line"]
            start = time.perf_counter()
            state = answerer.start(transcript_context(lines[: q["after_line"]]), q["q"], stream=stream)
            while not state.step().done:
                pass
            answer = state.text.emitted.strip()  # what the user was shown (the stop rules applied)
            results.append({"id": item["id"], "kind": item["kind"], "type": question_type(q), "question": q["q"],
                            "answer": answer, "right": scored(q, answer),
                            "seconds": round(time.perf_counter() - start, 3)})
    return results


def spoken_lines(items: list[dict[str, Any]], profile_name: str, status: Status) -> dict[str, list[str]]:
    """Each item's lines said by espeak-ng (one American English voice) and transcribed by the profile's
    streaming ASR, line by line."""
    from runtime.bench.asr_quality import stream_transcript
    from runtime.models.asr.registry import load_asr
    from runtime.train.synthesizers import SAMPLE_RATE, Voice, resample, synthesize

    profile = load_profile(profile_name)
    asr = load_asr(profile.asr, device="cpu", dtype=profile.dtype, progress=status)
    voice = Voice("espeak", "en-us")
    rng = np.random.default_rng(0)
    heard: dict[str, list[str]] = {}
    for item in items:
        status(f"speech: {item['id']} through espeak-ng and {profile.asr.backend}")
        out = []
        for line in item["lines"]:
            audio, rate, _ = synthesize(voice, line, rng)
            out.append(stream_transcript(asr, resample(audio, rate, SAMPLE_RATE)) or "")
        heard[item["id"]] = out
    return heard


QUICK_ITEMS = 1  # --quick: the first item's questions (5 in the committed set), every variant, script and speech


def quick_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`--quick`'s items: the first `QUICK_ITEMS`, on which every prompt variant is still scored from the script and
    from speech. One item keeps the default profile's 1.5B within the quick budget (8 rows of 5 answers, each
    after its own prefill of the item's lines); the full run asks all 25 questions."""
    return items[:QUICK_ITEMS]


def run(args: argparse.Namespace, status: Status) -> dict[str, Any]:
    path = Path(args.data) if args.data else DEFAULT_SET
    if not path.is_file():
        raise UserError(f"no question set at {path}: pass --data FILE (the format of tests/data/answer_set.json "
                        "in the repository)")
    items = load_set(path)
    profile = load_profile(args.profile or "demo")
    # the threads a session of the profile decodes on (one per core but one): torch's default, every core, spins
    # against the other work on a small machine and took 5-6 s an answer of the 135M at load 8 on 2 cores
    threads = configure_threads(args.threads or profile.threads)
    base: LMConfig = replace(profile.lm, backend="engine")
    if args.model:
        base = replace(base, model=args.model)
    # without a refusal check in the profile, its unchecked variant is the profile's: not run twice
    variants = ([v for v in VARIANTS if base.not_known_reply or v != "profile-unchecked"] if not args.prompts
                else [v.strip() for v in args.prompts.split(",")])
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UserError(f"--prompts {','.join(unknown)}: unknown prompt variant (known: {', '.join(VARIANTS)})")
    if args.quick:
        items = quick_items(items)
    out: dict[str, Any] = {"bench": "answers", "quick": bool(args.quick), "set": str(path), "model": base.model,
                           "weights": base.weights, "threads": threads, "items": [i["id"] for i in items],
                           "questions": sum(len(i["questions"]) for i in items), "variants": {}}
    heard = spoken_lines(items, args.profile or "demo", status)
    # loaded once: the variants differ in their prompts only
    loaded = EngineAnswerer.load(base, device="cpu", dtype="float32", progress=status)
    for name in variants:
        cfg = replace(base, **VARIANTS[name])
        status(f"answers: prompt variant {name!r} on the script")
        answerer = EngineAnswerer.sharing(loaded.engine, cfg)
        row: dict[str, Any] = {"system_prompt": cfg.system_prompt, "max_new_tokens": cfg.max_new_tokens}
        text = ask_all(answerer, items, lambda item: item["lines"], status)
        row["text_accuracy"], row["text_by_type"] = accuracy(text), by_type(text)
        row["text"] = text
        status(f"answers: prompt variant {name!r} on what the ASR heard")
        speech = ask_all(answerer, items, lambda item: heard[item["id"]], status)
        row["speech_accuracy"], row["speech_by_type"] = accuracy(speech), by_type(speech)
        row["speech"] = speech
        if answerer.refusal_check is not None:  # answers that would have opened "Not known yet", on both inputs
            row["refusal_check"] = {"checked": answerer.refusal_check.checked,
                                    "answered": answerer.refusal_check.overturned}
        out["variants"][name] = row
    out["asr_transcripts"] = heard
    best = max(out["variants"], key=lambda v: out["variants"][v]["text_accuracy"])
    out["best_variant"] = best
    return out
