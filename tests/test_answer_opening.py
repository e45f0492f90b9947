"""An answer's opening (its steps until a first clause is written) queues at `Priority.OPENING`, ahead of other
conversations' question prefills; the rest of it at DECODE. At two conversations a turn's first clause otherwise
waited behind the other conversation's question prefill."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.models.lm.backend import AnswerStep
from runtime.pipeline.local_answers import WorkerAnswer
from runtime.worker import Priority


class Steps:
    """An answer that streams fixed deltas, one a step."""

    prompt_ids = [1, 2, 3]

    def __init__(self, deltas: list[str]) -> None:
        self.deltas = deltas

    def step(self) -> AnswerStep:
        delta = self.deltas.pop(0)
        return AnswerStep(delta, not self.deltas, "stop" if not self.deltas else None)


class Recording:
    """A worker that runs each job at once and records the priority it was queued at."""

    def __init__(self) -> None:
        self.priorities: list[Priority] = []

    async def run(self, priority: Priority, fn: Callable[[], AnswerStep]) -> AnswerStep:
        self.priorities.append(priority)
        return fn()

    async def run_together(self, priority: Priority, fn: Callable[[list[Steps]], list[AnswerStep]],
                           item: Steps) -> AnswerStep:
        self.priorities.append(priority)
        return fn([item])[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("together", [False, True])
async def test_the_steps_until_the_first_clause_run_at_opening_priority(together: bool) -> None:
    deltas = ["The", " meeting", " is", " on", " Thursday", " at", " three", ".", " Bring", " the", " notes", "."]
    worker = Recording()
    answer = WorkerAnswer(Steps(list(deltas)), worker,  # type: ignore[arg-type]
                          together=(lambda answers: [a.step() for a in answers]) if together else None)
    text = ""
    while not (step := await answer.step()).done:
        text += step.text
    # the first clause ("The meeting is on Thursday": the first word from the third on that ends a phrase) is known
    # complete at the space after it, which " at" brings: six steps
    assert worker.priorities == [Priority.OPENING] * 6 + [Priority.DECODE] * 6
    assert text + step.text == "".join(deltas)


@pytest.mark.asyncio
async def test_an_answer_of_one_short_clause_opens_to_its_end() -> None:
    worker = Recording()
    answer = WorkerAnswer(Steps(["Yes", "."]), worker)  # type: ignore[arg-type]
    while not (await answer.step()).done:
        pass
    assert worker.priorities == [Priority.OPENING, Priority.OPENING]
