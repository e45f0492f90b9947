"""The speculative-decoding table of `runtime bench llm --model REF`, in Spec-Bench's conventions: per task and
drafter, the mean tokens per target forward (accepted drafts + the target's own token), the wall-clock speedup
over plain greedy decoding of the same prompts in the same run, and whether every output is token-identical to
plain greedy (it must be: the drafters are lossless).

Tasks: answering from a transcript (this runtime's own use: answers quote the transcript), summarising a
transcript, and open chat (no transcript). `swift` is self-speculation by layer skipping (`layer_skip.py`);
`dyspec` grows the draft model's tree where it is sure (`dynamic_tree.py`).

The peer, when the target is a GGUF file and llama-cpp-python is installed: llama.cpp's own speculative decoding on
the same file, prompts and thread count (its prompt lookup, `LlamaPromptLookupDecoding`: the binding's only
built-in drafter; it takes no second model), against llama.cpp decoding plainly, in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.config import LMConfig
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_answerer import EngineAnswerer

if TYPE_CHECKING:
    from llama_cpp import Llama

DRAFTER_ROWS = ("none", "ngram", "recycling", "trigram", "swift", "auto")
MODEL_ROWS = ("draft-model", "dyspec")  # rows of a second model, with `draft_model`
# In the full table, on the tasks of the 1.6x target, the rows `auto` is judged by (it against its candidates on a
# CPU, and all of them against plain decoding) answer each prompt ROUNDS times, the rows in turns prompt by prompt
# (one answer each, a second or two apart, the order rotated every prompt and reversed every other round, so that
# a drift of the machine's speed weighs on all alike), and count each prompt's fastest answer: on a shared 2-core
# machine one answer varies by 10-15 %, as much as the differences between them. The other rows, far slower, and
# open chat answer once, and `--quick` runs every row once (its 12-token answers decide nothing). Six rounds: each
# half of `held_out` then counts the fastest of three answers a prompt (of two, with four rounds, the two halves of
# one run differed by up to 12 % once the copy and `auto` drafted alike; the six cost about 25 s more than four).
REPEATED = ("none", "ngram", "trigram", "auto")
REPEATED_TASKS = ("transcript_qa", "summarise")
AUTO_CANDIDATES = ("ngram", "trigram")  # what `auto` chooses among on a CPU (`drafter_choice.AutoDrafter`)
ROUNDS = 6
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


# the output's first n tokens, seconds, target forwards, tokens, rows scored (each forward's tree, root included)
Answer = tuple[list[int], float, int, int, int]


def _answer(answerer: EngineAnswerer, context: str, question: str, n: int) -> Answer:
    """One prompt answered to its end or its first `n` tokens (a drafted step may pass n: its tokens count in the
    time, and outputs compare on the first n)."""
    state = answerer.start(context, question, stream=answerer.open_stream())
    t = time.perf_counter()
    while not state.step().done and len(state.generated) < n:
        pass
    seconds = time.perf_counter() - t
    stats = state.decoder.stats
    return list(state.generated)[:n], seconds, stats.steps, stats.emitted, stats.steps + stats.drafted


def _turns(rows: list[str], round_: int, prompt: int, prompts: int) -> list[str]:
    """The order the repeated rows answer one prompt in: rotated every prompt, reversed every other round."""
    k = (round_ * prompts + prompt) % len(rows)
    order = rows[k:] + rows[:k]
    return order[::-1] if round_ % 2 else order


def spec_tokens(quick: bool) -> int:
    """The answer length of each prompt (`max_new_tokens`) in the small model's bench."""
    return 24 if quick else 128


def spec_table(ref: str, weights: str, *, quick: bool, status: Callable[[str], None],
               loaded: LMEngine | None = None, draft_model: str | None = None, tokens: int | None = None,
               prompts_per_task: int | None = None, compile_mode: str = "auto",
               llama_file: Path | None = None, skip: dict[str, str] | None = None) -> dict[str, Any]:
    """`loaded`: an engine of `ref` in `weights` whose weights every drafter's answerer shares (no load per row);
    `draft_model`: a smaller model of the same tokenizer, rows of their own (`draft-model`: chains, `dyspec`: dynamic
    trees); `tokens` and
    `prompts_per_task`: the answer length and prompts per task (by default `spec_tokens(quick)`, and one prompt per
    task when quick, all otherwise); `compile_mode`: the rows' `lm.compile` (the plain row's step);
    `llama_file`: the GGUF file llama.cpp's speculative row runs (the peer); `skip`: drafters left out, each with
    the reason the table reports in their place."""
    n = tokens or spec_tokens(quick)
    per_task = prompts_per_task or (1 if quick else max(len(p) for p in TASKS.values()))
    table: dict[str, Any] = {}
    skip = skip or {}
    drafters = tuple(d for d in ((*DRAFTER_ROWS[:-1], *MODEL_ROWS, DRAFTER_ROWS[-1]) if draft_model else DRAFTER_ROWS)
                     if d not in skip)
    status(f"speculative: {len(drafters)} drafters on {weights}" + (" (loading)" if loaded is None else ""))
    answerers = {}
    for d in drafters:
        cfg = LMConfig(backend="engine", model=ref, weights=weights, drafter=d, max_new_tokens=n,
                       draft_model=draft_model if d in MODEL_ROWS else "", compile=compile_mode)
        if loaded is not None:  # the loaded engine's cache geometry, so that its compiled steps serve every row
            cfg = replace(loaded.cfg, drafter=d, draft_model=cfg.draft_model, compile=compile_mode,
                          max_new_tokens=max(n, loaded.cfg.max_new_tokens))
        # one load of the draft, shared by DySpec's rows
        shared_draft = answerers["draft-model"].draft_engine if d == "dyspec" and "draft-model" in answerers else None
        answerers[d] = (EngineAnswerer.load(cfg, device="cpu", dtype="float32") if loaded is None
                        else EngineAnswerer.sharing(loaded, cfg, draft_engine=shared_draft))
    prompt_ids: dict[str, list[list[int]]] = {}
    repeated = [d for d in drafters if d in REPEATED]
    for task, all_prompts in TASKS.items():
        prompts = all_prompts[:per_task]  # quick: every task and drafter, on fewer prompts
        rounds = 1 if quick or task not in REPEATED_TASKS else ROUNDS
        runs: dict[str, list[list[Answer]]] = {d: [[] for _ in prompts] for d in drafters}
        for drafter in drafters if rounds == 1 else [d for d in drafters if d not in REPEATED]:
            status(f"speculative: {task} with drafter {drafter}")
            for p, (context, question) in enumerate(prompts):
                runs[drafter][p].append(_answer(answerers[drafter], context, question, n))
        for round_ in range(rounds if rounds > 1 else 0):
            status(f"speculative: {task}, {', '.join(repeated)} in turns (round {round_ + 1} of {rounds})")
            for p, (context, question) in enumerate(prompts):
                for drafter in _turns(repeated, round_, p, len(prompts)):
                    runs[drafter][p].append(_answer(answerers[drafter], context, question, n))
        plain = [answers[0][0] for answers in runs["none"]]
        base_s = sum(min(a[1] for a in answers) for answers in runs["none"])
        rows: dict[str, Any] = {d: {"skipped": why} for d, why in skip.items()}
        for drafter in drafters:
            fastest = [min(answers, key=lambda a: a[1]) for answers in runs[drafter]]
            seconds, steps, emitted, scored = (sum(a[i] for a in fastest) for i in (1, 2, 3, 4))
            # rows a forward: on a CPU each further row costs its arithmetic (about a seventh of a 1.5B step at 2
            # threads), so two drafters of one tokens_per_step may differ in speed by the rows they scored for it
            rows[drafter] = {"tokens_per_step": round(emitted / max(1, steps), 3), "tokens": emitted,
                             "rows_per_step": round(scored / max(1, steps), 3),
                             "seconds": round(seconds, 3), "speedup": round(base_s / seconds, 3),
                             "identical": all(a[0] == plain[p] for p, answers in enumerate(runs[drafter])
                                              for a in answers),
                             "rounds": len(runs[drafter][0])}
        table[task] = rows
        if rounds > 1 and {"auto", *AUTO_CANDIDATES} <= set(repeated):
            table.setdefault("auto_vs_best_held_out", {})[task] = held_out(runs, rounds)
        plain_answerer = answerers["none"]
        prompt_ids[task] = [list(plain_answerer.start(c, q, stream=plain_answerer.open_stream()).prompt_ids)
                            for c, q in prompts]
    table["weights"] = weights
    table["max_new_tokens"] = n
    table["prompts_per_task"] = {task: len(prompts[:per_task]) for task, prompts in TASKS.items()}
    if llama_file is not None:
        eos = frozenset(answerers["none"].eos_ids)
        table["llama_cpp"] = llama_cpp_speculative(llama_file, prompt_ids, n, eos, status)
        for task in prompt_ids:
            peer = table["llama_cpp"].get(task)
            if peer and "tokens" in peer:  # our best drafter's tokens/s against llama.cpp's prompt lookup's
                best = min((r for d, r in table[task].items() if d != "none" and "seconds" in r),
                           key=lambda r: r["seconds"])
                ours = best["tokens"] / best["seconds"]
                peer["ours_best_vs_prompt_lookup"] = round(ours / (peer["tokens"] / peer["prompt_lookup_seconds"]), 3)
    return table


def held_out(runs: dict[str, list[list[Answer]]], rounds: int) -> dict[str, Any]:
    """`auto` against its best candidate, that candidate chosen on other rounds than those it is timed on.

    Why: the best of two rows, each timed with noise, is faster than either row truly is (the winner's curse), so
    `auto` reads below "its best candidate" even where it matches it. Here the even rounds choose the candidate and
    the odd ones time it against `auto`, then the other way round; the ratio is the two halves' mean."""
    halves = (range(0, rounds, 2), range(1, rounds, 2))

    def seconds(drafter: str, chosen: range) -> float:
        return sum(min(answers[r][1] for r in chosen) for answers in runs[drafter])

    ratios, picks = [], []
    for choose, time_on in (halves, halves[::-1]):
        best = min(AUTO_CANDIDATES, key=lambda d: seconds(d, choose))
        picks.append(best)
        ratios.append(seconds(best, time_on) / seconds("auto", time_on))
    return {"ratio": round(sum(ratios) / len(ratios), 3), "halves": [round(r, 3) for r in ratios],
            "candidates_chosen": picks}


def llama_cpp_speculative(file: Path, prompts: dict[str, list[list[int]]], n: int, eos: frozenset[int],
                          status: Callable[[str], None]) -> dict[str, Any]:
    """llama.cpp on `file` answering each task's prompts greedily, plainly and with its prompt lookup (10 tokens
    drafted from the longest match of the last 1-2 tokens, the binding's defaults but 10 drafts), at the thread
    count the table runs at: seconds (prompt and up to `n` tokens, ending at an `eos` id, as our rows time them),
    its speedup, and whether the outputs are identical. With a drafter the binding computes logits at every
    prompt position (`logits_all`), which its plain row does not: that is part of its speculative cost."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed: make peers"}
    import torch

    threads = torch.get_num_threads()
    out: dict[str, Any] = {"threads": threads, "drafter": "LlamaPromptLookupDecoding(max_ngram_size=2, "
                           "num_pred_tokens=10)"}
    try:
        plain = Llama(str(file), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
        lookup = Llama(str(file), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False,
                       draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
        for task, task_prompts in prompts.items():
            status(f"speculative: {task} on llama.cpp, plain and with prompt lookup")
            (plain_s, plain_out), (look_s, look_out) = (_llama_answers(llm, task_prompts, n, eos)
                                                        for llm in (plain, lookup))
            out[task] = {"tokens": sum(map(len, look_out)), "plain_seconds": round(plain_s, 3),
                         "prompt_lookup_seconds": round(look_s, 3),
                         "speedup": round(plain_s / look_s, 3), "identical": plain_out == look_out}
        plain.close()
        lookup.close()
    except Exception as err:  # the peer's failure is its row, never the bench's end
        out["skipped"] = f"llama.cpp failed: {type(err).__name__}: {err}"
    return out


def _llama_answers(llm: Llama, prompts: list[list[int]], n: int, eos: frozenset[int]) -> tuple[float, list[list[int]]]:
    seconds, outputs = 0.0, []
    for ids in prompts:
        llm.reset()
        t = time.perf_counter()
        got: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if int(token) in eos or len(got) == n:
                break
            got.append(int(token))
        seconds += time.perf_counter() - t
        outputs.append(got)
    return seconds, outputs
