"""An answer that would open with the profile's not-known reply asks the model first whether the context holds the
answer (`runtime/models/lm/refusal_check.py`): on yes it opens with its next likeliest token, on no it refuses, and
either way the answer after its first token is plain decoding's."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from weights_common import ON_QWEN_CODER

from runtime.config import LMConfig
from runtime.errors import CheckpointNotFound, PromptTooLong
from runtime.models.lm.engine_answerer import EngineAnswerer
from runtime.models.lm.refusal_check import RefusalCheck, says_yes, without
from runtime.models.loading import resolve_checkpoint
from runtime.profile_files import load_profile

REFUSAL, YES, NO, OTHER = 5, 7, 8, 3


class Session:
    """Answers with set logits per prompt tail; records what was opened and closed. A tail it has no logits for
    is too long for it (as the engine refuses a tail past its question budget, before opening anything)."""

    def __init__(self, logits: dict[str, torch.Tensor]) -> None:
        self.logits, self.calls, self.open = logits, [], None

    def begin_answer(self, question: str, after=()) -> list[int]:
        assert self.open is None
        if question not in self.logits:
            raise PromptTooLong(f"{question!r} is too long")
        self.open = question
        self.calls.append(question)
        return []

    def next_logits(self) -> torch.Tensor:
        return self.logits[self.open].clone()

    def end_answer(self) -> None:
        self.open = None


def logits(**probs: float) -> torch.Tensor:
    out = torch.full((10,), -20.0)
    for name, p in probs.items():
        out[{"refusal": REFUSAL, "yes": YES, "no": NO, "other": OTHER}[name]] = torch.tensor(p).log()
    return out


def check() -> RefusalCheck:
    return RefusalCheck(REFUSAL, "Is it said: {question}?", (YES,), (NO,))


def test_an_answer_that_does_not_open_with_the_refusal_is_not_checked() -> None:
    session = Session({"q": logits(refusal=0.3, other=0.7)})
    session.begin_answer("q")
    c = check()
    out = c.first_logits(session, "q")
    assert torch.equal(out, session.logits["q"]) and session.calls == ["q"] and c.checked == 0


@pytest.mark.parametrize(("yes", "answered"), [(0.8, True), (0.2, False)])
def test_a_refusal_is_given_only_when_the_model_says_the_context_does_not_answer(yes: float, answered: bool) -> None:
    session = Session({"q": logits(refusal=0.4, other=0.35), "Is it said: q?": logits(yes=yes, no=1 - yes)})
    session.begin_answer("q")
    c = check()
    out = c.first_logits(session, "q")
    # the check asked on the same session, then the question's answer opened again for decoding to go on from
    assert session.calls == ["q", "Is it said: q?", "q"] and session.open == "q"
    assert int(out.argmax()) == (OTHER if answered else REFUSAL)
    assert (c.checked, c.overturned) == (1, int(answered))
    # nothing else moved: the other tokens keep their logits
    keep = torch.ones(10, dtype=torch.bool)
    keep[REFUSAL] = False
    assert torch.equal(out[keep], session.logits["q"][keep])


def test_a_question_too_long_for_the_check_keeps_its_refusal() -> None:
    session = Session({"q": logits(refusal=0.4, other=0.35)})  # the check's tail does not fit
    session.begin_answer("q")
    c = check()
    out = c.first_logits(session, "q")
    assert int(out.argmax()) == REFUSAL and session.open == "q" and (c.checked, c.overturned) == (1, 0)


def test_yes_and_no_are_summed_over_their_spellings_and_the_refusal_masked() -> None:
    probs = torch.tensor([0.3, 0.25, 0.25, 0.2]).log()
    assert says_yes(probs, yes=(0,), no=(3,))
    assert not says_yes(probs, yes=(0,), no=(1, 2))  # 0.3 against 0.25 + 0.25
    assert not says_yes(probs, yes=(0, 3), no=(1, 2))  # a tie is not yes: the refusal stands
    masked = without(probs, 0)
    assert masked[0] == float("-inf") and torch.equal(masked[1:], probs[1:]) and probs[0] != float("-inf")


def test_a_profile_whose_check_lacks_the_question_slot_is_a_config_error() -> None:
    from runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"lm.not_known_check must hold \{question\}"):
        load_profile("demo", overrides=["lm.not_known_check=Is it said?"])
    assert load_profile("small", overrides=["lm.not_known_check=Is it said?"]).lm.not_known_reply == ""  # no check


def test_a_check_without_the_question_slot_is_refused(tiny_path) -> None:
    answerer = EngineAnswerer.load(LMConfig(backend="engine", model="tiny:qwen2", max_new_tokens=4, window_tokens=64),
                                   device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"\{question\}"):
        RefusalCheck.build(answerer.tokenizer, "Not known yet", "Is it said?")


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_on_the_engine_the_answer_after_its_first_token_is_plain_decodings(tiny_path, drafter: str) -> None:
    """On a tiny random model: make the plain answer's own first token the "refusal", so the check runs; the answer
    then opens with that token (no) or the next likeliest (yes), and goes on exactly as plain greedy decoding from
    that opening (checked by decoding the prompt with the opening forced)."""
    cfg = LMConfig(backend="engine", model="tiny:qwen2", max_new_tokens=10, window_tokens=128, drafter=drafter)
    plain = EngineAnswerer.load(cfg, device="cpu", dtype="float32")
    context, question = "[00:01.0] The meeting is on Monday at nine in room 4B.", "When is the meeting?"
    plain_answer = plain.start(context, question)
    first_logits = plain_answer.stream.session.next_logits().clone()
    while not plain_answer.step().done:
        pass
    opening = plain_answer.generated[0]
    reply = plain.tokenizer.decode([opening])
    checked = EngineAnswerer.sharing(plain.engine, replace(cfg, not_known_reply=reply,
                                                           not_known_check="Is it said: {question}"))
    assert checked.refusal_check is not None and checked.refusal_check.refusal == opening
    answer = checked.start(context, question)
    while not answer.step().done:
        pass
    assert checked.refusal_check.checked == 1
    overturned = checked.refusal_check.overturned == 1
    expect_first = int(without(first_logits, opening).argmax()) if overturned else opening
    assert answer.generated[0] == expect_first
    if not overturned:
        assert answer.generated == plain_answer.generated
    # plain greedy from the same opening: the prompt, the opening, then one token at a time
    session = plain.engine.open_session()
    session.set_context(context)
    session.begin_answer(question)
    assert torch.equal(session.next_logits(), first_logits)  # the check left the stream as a fresh one
    tokens = [expect_first]
    while len(tokens) < len(answer.generated):
        logits = session.score([tokens[-1]], [-1])
        session.commit([0])  # the one node scored
        tokens.append(int(logits[-1].argmax()))
    assert tokens == answer.generated


LAUNCH = """[00:00.1] Thanks for joining the Falcon launch.
[00:01.0] On screen: Project Falcon | - Product launch | - Team lead: Priya Nair
[00:08.1] Student's getting a pro plan for free.
[00:09.0] On screen: Pricing | - Basic plan: 9 dollars a month | - Pro plan: 29 dollars a month
[00:14.0] User: How much does the basic plan cost?
[00:14.0] User: When is the webinar?
[00:18.0] Watch this short demo video.
[00:21.0] User: Who gets the pro plan for free?
[00:24.0] A third part will be a house in January.
[00:25.0] On screen: Partners | - Acme Logistics | - Northwind Bank
[00:32.0] User: Which bank is a partner?
[00:34.1] Questions can go to the support team.
[00:35.0] On screen: Next steps | - Sign up at falcon dot io | - Webinar on June 3
[00:42.0] User: Who is the team lead of Project Falcon?"""
LECTURE = """[00:00.1] Today we talk about volcanoes.
[00:01.0] On screen: Introduction to volcanoes | - Lecture 4 | - Professor Alan Reyes
[00:08.0] And to get to the again last spring which is hot on the slide.
[00:09.0] On screen: Mount Etna | - Height: 3357 metres | - Located in Sicily
[00:14.0] User: How tall is Mount Etna?"""


@pytest.mark.slow
@ON_QWEN_CODER
def test_the_default_answers_what_a_slide_says_and_refuses_what_nothing_said_yet() -> None:
    """The default profile's 1.5B on two contexts `runtime bench video-qa` played (2026-11-30): the pro plan's price,
    which the slide shows and which plain greedy decoding refused ("Not" 0.37 against the answer's openings), and a
    question asked before anything said its answer, which must still be refused, through the check."""
    try:
        resolve_checkpoint("builtin:qwen2.5-coder-1.5b-instruct", role="lm")
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))
    cfg = replace(load_profile("demo").lm, compile="off")
    answerer = EngineAnswerer.load(cfg, device="cpu", dtype="float32")
    check = answerer.refusal_check
    assert check is not None

    def answer(context: str, question: str) -> str:
        state = answerer.start(context, question)
        while not state.step().done:
            pass
        return state.text.emitted.strip()

    assert "29" in answer(LAUNCH, "How much does the pro plan cost?")
    before = check.checked, check.overturned
    assert answer(LECTURE, "Which chapter is the homework reading?").startswith("Not known yet")
    assert (check.checked, check.overturned) == (before[0] + 1, before[1])  # every refusal is checked; this one held
