"""Several conversations' decode steps in one forward: `Transformer.forward_many` against each session's own
forward (bitwise on the runtime's int4/int8 kernels), `EngineAnswerer.step_together` against each answer decoded
alone (token for token, every drafter), steps decoded ahead, and the worker's jobs that run together."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch
from lm_common import PROMPTS, N

from runtime.config import LMConfig
from runtime.models.lm import cpu_kernels, load_answerer
from runtime.models.lm.drafters import Draft
from runtime.models.lm.engine_answerer import EngineAnswer, EngineAnswerer
from runtime.models.lm.engine_session import score_together
from runtime.worker import DeviceWorker, Priority


def needs_kernels() -> None:
    """Asked inside the tests, not at collection: the first asker builds the kernels (about a minute in a fresh
    cache), and a collection that built them would hold back every test of its worker."""
    if not cpu_kernels.available():
        pytest.skip("the runtime's CPU kernels do not build here")


def make(drafter: str = "none", **cfg: object) -> EngineAnswerer:
    lm = LMConfig(backend="engine", max_new_tokens=N, prefill_chunk_tokens=16, drafter=drafter, compile="off", **cfg)
    answerer = load_answerer(lm, device="cpu", dtype="float32")
    assert isinstance(answerer, EngineAnswerer)
    return answerer


def alone(answerer: EngineAnswerer, context: str, question: str) -> list[int]:
    answer = answerer.start(context, question)
    while not answer.step().done:
        pass
    return answer.generated


def together(answerer: EngineAnswerer, prompts: list[tuple[str, str]]) -> list[EngineAnswer]:
    """Every answer asks each round (as `step_together` sees a server's conversations), until all are done."""
    answers = [answerer.start(c, q) for c, q in prompts]
    live = list(answers)
    while live:
        results = answerer.step_together(live)
        for result in results:
            assert not isinstance(result, Exception), result
        live = [a for a, r in zip(live, results, strict=True) if not r.done]  # type: ignore[union-attr]
    return answers


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_trees_of_several_sessions_in_one_forward_are_bitwise_their_own(weights: str) -> None:
    needs_kernels()
    answerer = make(weights=weights, kernels="runtime")
    sessions = [answerer.open_stream().session for _ in range(3)]
    trees = [([11, 12, 13, 14], [-1, 0, 0, 1]), ([21], [-1]), ([31, 32, 33], [-1, 0, 1])]
    for session, (context, question) in zip(sessions, PROMPTS[1:], strict=True):
        session.set_context(context)
        session.begin_answer(question)
    own = []
    for session, (tokens, parents) in zip(sessions, trees, strict=True):
        own.append(session.score(tokens, parents).clone())
        session.commit([])  # the tree dropped: the cache as it was
    shared = score_together([(s, t, p) for s, (t, p) in zip(sessions, trees, strict=True)])
    for mine, ours in zip(own, shared, strict=True):
        assert torch.equal(mine, ours)
    for session, (tokens, _) in zip(sessions, trees, strict=True):  # each commits its own path as after score
        path = [0, 1] if len(tokens) > 1 else [0]
        session.commit(path)
        assert session.committed_tokens() == len(session.answer_ids())


def test_score_together_refuses_two_engines_and_two_trees_of_one_session() -> None:
    answerer = make()
    session = answerer.open_stream().session
    session.set_context("a b c")
    session.begin_answer("Why?")
    with pytest.raises(ValueError, match="one tree per session"):
        score_together([(session, [1], [-1]), (session, [2], [-1])])
    other = make().open_stream().session  # another engine
    other.set_context("a b c")
    other.begin_answer("Why?")
    with pytest.raises(ValueError, match="one engine"):
        score_together([(session, [1], [-1]), (other, [2], [-1])])
    assert session.committed_tokens() == len(session.answer_ids())  # refused before any cache changed


@pytest.mark.parametrize("drafter", ["none", "auto", "trigram"])
@pytest.mark.parametrize("weights", ["int4", "float"])
def test_answers_stepped_together_are_the_tokens_each_decodes_alone(drafter: str, weights: str) -> None:
    if weights == "int4":
        needs_kernels()
    cfg = {"weights": "int4", "kernels": "runtime"} if weights == "int4" else {}
    answerer = make(drafter, **cfg)
    prompts = PROMPTS[1:]
    expected = [alone(answerer, c, q) for c, q in prompts]
    answers = together(answerer, prompts)
    assert [a.generated for a in answers] == expected
    assert all(a.released for a in answers) and answerer._open == []


def test_an_answer_that_did_not_ask_is_stepped_ahead_and_gets_that_step_when_it_asks() -> None:
    answerer = make()
    (c1, q1), (c2, q2) = PROMPTS[1], PROMPTS[3]
    expected = alone(answerer, c2, q2)
    first, second = answerer.start(c1, q1), answerer.start(c2, q2)
    assert [s.done for s in answerer.step_together([first, second])] == [False, False]  # the chosen first tokens
    answerer.step_together([first])  # a forward for `first`: `second` is decoded beside it
    assert second.ahead is not None
    ahead = second.ahead
    assert answerer.step_together([second]) == [ahead] and second.ahead is None  # no forward: the step kept
    while not second.step().done:  # alone from here, and ahead of nothing
        pass
    assert second.generated == expected
    first.release()
    assert answerer._open == []


def test_a_failing_step_is_that_answers_error_and_the_others_go_on() -> None:
    answerer = make()
    good, bad = answerer.start(*PROMPTS[1]), answerer.start(*PROMPTS[2])
    answerer.step_together([good, bad])

    def broken(max_tokens: int | None = None, max_depth: int | None = None) -> list[int]:
        raise RuntimeError("broken drafter")

    bad.decoder.plan = broken  # type: ignore[method-assign]
    results = answerer.step_together([good, bad])
    assert isinstance(results[1], RuntimeError) and not isinstance(results[0], Exception)
    expected = alone(answerer, *PROMPTS[1])
    while not good.step().done:
        pass
    assert good.generated == expected


def test_jobs_of_one_function_run_together_and_each_gets_its_result() -> None:
    calls: list[list[int]] = []
    gate = threading.Event()

    def double(items: list[int]) -> list[int | Exception]:
        calls.append(list(items))
        return [ValueError("odd") if i % 2 else 2 * i for i in items]

    with DeviceWorker() as worker:
        worker.submit(Priority.CONTROL, gate.wait)  # holds the worker while the others queue
        futures: list[Future[int]] = [worker.submit_together(Priority.DECODE, double, i) for i in (2, 3, 4)]
        futures[2].cancel()  # cancelled before it ran: left out
        gate.set()
        assert futures[0].result(5) == 4
        with pytest.raises(ValueError, match="odd"):
            futures[1].result(5)
        assert worker.submit_together(Priority.DECODE, double, 6).result(5) == 12  # a new batch once one started
    assert calls == [[2, 3], [6]]
    assert worker.stats()["together_items"] == {"DECODE": 3}


def test_run_together_awaits_on_the_loop() -> None:
    async def main() -> list[int]:
        with DeviceWorker() as worker:
            return list(await asyncio.gather(*(worker.run_together(Priority.DECODE, lambda xs: [x + 1 for x in xs], i)
                                               for i in range(4))))

    assert asyncio.run(main()) == [1, 2, 3, 4]


def asked_depths(answer: EngineAnswer) -> list[int]:
    """The depths `answer`'s drafter is asked for from now on (a spy around its `propose`)."""
    drafter, asked = answer.decoder.drafter, []
    assert drafter is not None
    propose = drafter.propose

    def spy(context: Sequence[int], pending: int, budget: int) -> Draft:
        asked.append(budget)
        return propose(context, pending, budget)

    drafter.propose = spy  # type: ignore[method-assign]
    return asked


def test_trees_that_share_a_forward_share_its_size() -> None:
    """Two answers stepped together draft at most half the depth each: the forward stays about one deep tree's rows.
    (The copy is a free drafter: asked for the deepest tree a step may score, then cut where it pays.)"""
    answerer = make("ngram")
    prompt = ("one two three four five six seven eight nine ten " * 6, "Count on.")
    first, second = answerer.start(*prompt), answerer.start(*prompt)
    answerer.step_together([first, second])  # the chosen first tokens
    together_asked = [asked_depths(first), asked_depths(second)]
    for _ in range(4):
        answerer.step_together([first, second])
        assert max(first.decoder.stats.k, second.decoder.stats.k) <= answerer.cfg.max_draft_tokens // 2
    depths = together_asked[0] + together_asked[1]
    assert depths and max(depths) == answerer.cfg.max_draft_tokens // 2
    alone = make("ngram").start(*prompt)  # alone, it is asked for the whole depth
    asked = asked_depths(alone)
    alone.step()
    alone.step()
    assert asked and max(asked) == answerer.cfg.max_draft_tokens
