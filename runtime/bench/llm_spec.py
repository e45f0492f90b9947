"""The speculative-decoding table of `runtime bench llm --model REF`, in Spec-Bench's conventions: per task and
drafter, the mean tokens per target forward (accepted drafts + the target's own token), the wall-clock speedup
over plain greedy decoding of the same prompts in the same run, and whether every output is token-identical to
plain greedy (it must be: the drafters are lossless).

Tasks: answering from a transcript (this runtime's own use: answers quote the transcript), summarising a
transcript, and open chat (no transcript). `swift` is self-speculation by layer skipping (`layer_skip.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from runtime.config import LMConfig
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_answerer import EngineAnswerer

DRAFTER_ROWS = ("none", "ngram", "recycling", "trigram", "swift", "auto")
MEETING = ("[00:03] Ana: Welcome back. Our first customer in Oslo signed the contract on Monday.\n"
           "[00:11] Ben: The contract is worth 120,000 dollars over two years, paid every quarter.\n"
           "[00:19] Ana: Kofi will lead the rollout, starting with the warehouse team on March 4th.\n"
           "[00:27] Ben: We still need a second engineer; the job ad goes out on Friday.\n")
RECIPE = ("[00:01] Chef: Today we bake a simple loaf. Mix 500 grams of flour with 10 grams of salt.\n"
          "[00:08] Chef: Add 7 grams of dry yeast and 350 millilitres of warm water, then knead for ten minutes.\n"
          "[00:16] Chef: Let the dough rise for one hour, shape it, and bake at 220 degrees for 35 minutes.\n")
TASKS: dict[str, list[tuple[str, str]]] = {
    "transcript_qa": [(MEETING, "Who will lead the rollout, and when does it start?"),
                      (MEETING, "How much is the contract worth?"),
                      (RECIPE, "How long does the dough rise, and how hot is the oven?")],
    "summarise": [(MEETING, "Summarise the transcript in three sentences."),
                  (RECIPE, "Summarise the recipe as a numbered list of steps.")],
    "open_chat": [("", "Write a short poem about the sea."),
                  ("", "Explain in a few sentences why the sky is blue.")],
}


def _run(answerer: EngineAnswerer, prompts: list[tuple[str, str]]) -> tuple[list[list[int]], float, int, int]:
    outputs, seconds, steps, emitted = [], 0.0, 0, 0
    for context, question in prompts:
        state = answerer.start(context, question, stream=answerer.open_stream())
        t = time.perf_counter()
        while not state.step().done:
            pass
        seconds += time.perf_counter() - t
        stats = state.decoder.stats
        steps, emitted = steps + stats.steps, emitted + stats.emitted
        outputs.append(list(state.generated))
    return outputs, seconds, steps, emitted


def spec_tokens(quick: bool) -> int:
    """The answer length of each prompt (`max_new_tokens`)."""
    return 40 if quick else 128


def spec_table(ref: str, weights: str, *, quick: bool, status: Callable[[str], None],
               loaded: LMEngine | None = None, draft_model: str | None = None) -> dict[str, Any]:
    """`loaded`: an engine of `ref` in `weights` whose weights every drafter's answerer shares (no load per row);
    `draft_model`: a smaller model of the same tokenizer, a row of its own (`draft-model`)."""
    n = spec_tokens(quick)
    table: dict[str, Any] = {}
    drafters = (*DRAFTER_ROWS[:-1], "draft-model", DRAFTER_ROWS[-1]) if draft_model else DRAFTER_ROWS
    status(f"speculative: {len(drafters)} drafters on {weights}" + (" (loading)" if loaded is None else ""))
    answerers = {}
    for d in drafters:
        cfg = LMConfig(backend="engine", model=ref, weights=weights, drafter=d, max_new_tokens=n,
                       draft_model=draft_model if d == "draft-model" else "")
        answerers[d] = (EngineAnswerer.load(cfg, device="cpu", dtype="float32") if loaded is None
                        else EngineAnswerer.sharing(loaded, cfg))
    for task, all_prompts in TASKS.items():
        prompts = all_prompts[:1] if quick else all_prompts  # quick: every task and drafter, on one prompt each
        rows: dict[str, Any] = {}
        plain, base_s, _, _ = (None, 0.0, 0, 0)
        for drafter in drafters:
            status(f"speculative: {task} with drafter {drafter}")
            outs, seconds, steps, emitted = _run(answerers[drafter], prompts)
            if drafter == "none":
                plain, base_s = outs, seconds
            rows[drafter] = {"tokens_per_step": round(emitted / max(1, steps), 3), "tokens": emitted,
                             "seconds": round(seconds, 3), "speedup": round(base_s / seconds, 3),
                             "identical": outs == plain}
        table[task] = rows
    table["weights"] = weights
    table["max_new_tokens"] = n
    table["prompts_per_task"] = {task: 1 if quick else len(prompts) for task, prompts in TASKS.items()}
    return table
