"""A refusal only when the model, asked directly, says the context does not hold the answer.

Why: a profile's system prompt can name a reply for what the transcript and the screen do not say yet (`demo`'s:
"Not known yet"). Greedy decoding then refuses whenever that reply's first token is the single likeliest first
token, although an answer's probability is split over its many possible openings. On `runtime bench video-qa` the
1.5B refused "How much does the pro plan cost?" with "Not" at 0.37 against 0.33 for "The", 0.15 for "2" and 0.06
for "$", the slide's "Pro plan: 29 dollars a month" in its context. A yes/no question has one opening each way, so
its probability is not split: asked whether the transcript and the screen text say the answer, the model said yes
at 0.80 there, and no to each of the bench's three questions asked before their answer was said (yes at most 0.13).

So when an answer would open with the refusal, the model is asked that yes/no question on the same prefilled
context (a second prompt tail, then the question's own again: two short prefills, on refusals only), and on "yes"
the answer opens with its likeliest other token. The check never turns an answer into a refusal, and after the
first token decoding is untouched (plain or speculative, greedy or sampled). It reads the model's probabilities of
"yes" and "no" against each other, nothing tuned to a question set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from runtime.errors import PromptTooLong
from runtime.models.lm.prompt import Messages

YES, NO = ("Yes", "yes"), ("No", "no")


class AnsweringSession(Protocol):
    """What the check needs of an engine session: one answer open at a time, its first token's logits."""

    def begin_answer(self, question: str, after: Messages = ()) -> list[int]: ...

    def next_logits(self) -> torch.Tensor: ...

    def end_answer(self) -> None: ...


def first_token(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """The token an answer starting with `text` starts with (no leading space: it opens the assistant's turn)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"{text!r} encodes to no tokens")
    return int(ids[0])


def says_yes(logits: torch.Tensor, yes: Sequence[int], no: Sequence[int]) -> bool:
    """Whether the answer's first token is likelier yes than no (each summed over its spellings)."""
    probs = logits.float().reshape(-1).softmax(-1)
    return bool(probs[list(yes)].sum() > probs[list(no)].sum())


def without(logits: torch.Tensor, token: int) -> torch.Tensor:
    """`logits` with `token` made impossible (a copy)."""
    out = logits.clone()
    out.reshape(-1)[token] = float("-inf")
    return out


@dataclass
class RefusalCheck:
    """`reply`'s first token (the refusal's opening) and `question` (a yes/no question about the context, with
    `{question}` where the user's question goes), ready to run on a session's open answer."""

    refusal: int
    question: str
    yes: tuple[int, ...]
    no: tuple[int, ...]
    checked: int = 0  # answers that would have opened with the refusal
    overturned: int = 0  # of those, answered because the model said the context holds the answer

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, reply: str, question: str) -> RefusalCheck:
        if "{question}" not in question:
            raise ValueError(f"lm.not_known_check must hold {{question}} where the user's question goes: {question!r}")
        return cls(first_token(tokenizer, reply), question, tuple(first_token(tokenizer, w) for w in YES),
                   tuple(first_token(tokenizer, w) for w in NO))

    def first_logits(self, session: AnsweringSession, question: str, after: Messages = ()) -> torch.Tensor:
        """The open answer's first-token logits, without the refusal's opening when the model says the context
        answers `question`. The session's answer is open on `question` (and `after`) before and after."""
        logits = session.next_logits()
        if int(logits.reshape(-1).argmax()) != self.refusal:
            return logits
        self.checked += 1
        session.end_answer()
        try:  # other braces in the check stay as written
            session.begin_answer(self.question.replace("{question}", question))
        except PromptTooLong:  # a question near the engine's limit leaves no room for the check's words: refuse
            answerable = False
        else:
            answerable = says_yes(session.next_logits(), self.yes, self.no)
            session.end_answer()
        session.begin_answer(question, after)  # the same tail on the same cache: the same logits again
        if not answerable:
            return session.next_logits()
        self.overturned += 1
        return without(session.next_logits(), self.refusal)
