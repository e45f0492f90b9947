"""A request for a response (`Question`) and what the model is asked for it (`answer_request`).

Apart from the processor that answers it (`answers.py`) because every way of asking builds one
(`response_requests.py`, the session, scripts, tests) and needs none of the answering machinery; and the request is
built here alone because an answer started ahead of its turn's end (`QuestionProcessor.prepare`) is used only when
the request after the commit is the very same, so both must build it one way.

A client's `response.create` with no new user message answers from the conversation as it stands (`continues`):
the model is asked to open the conversation, when nothing was said yet (an agent that greets first), or to go on
from it. A turn that turn detection ended with nothing heard in it is not answered that way: it is an error, as
before, so noise never makes the agent talk.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from runtime.events import new_id
from runtime.function_tools import ToolUse
from runtime.memory.conversation import Conversation, Item
from runtime.models.lm.answering import AnswerRequest, PastCall
from runtime.session_config import OutputAudio

# what a response.create with no new user message asks the model (`Question.continues`)
OPENING_QUESTION = "(The conversation is starting: the user has said nothing yet.) Greet the user in one sentence."
CONTINUE_QUESTION = "(The user has said nothing new.) Go on from the conversation so far in one short sentence."


@dataclass
class Question:
    """One request for a response: `response.create`, a scripted or typed question, or the end of a turn."""

    text: str | None  # None: what the user said or typed since the last answer, read when the answer starts
    media_time: float  # media seconds at which it was asked
    hear_until: float  # audio pushed when it was asked: the answer waits for the ASR to reach it
    client_event_id: str | None = None
    commits: int = 0  # commits asked for before it: the answer waits for their transcripts to complete
    instructions: str = ""  # the session's and the request's, given with the question
    max_tokens: int | None = None
    in_conversation: bool = True  # False (`conversation: "none"`): the answer is not added to the conversation
    record_question: bool = False  # a question from a script or the terminal joins the conversation with its answer
    metadata: dict[str, object] | None = None
    tools: ToolUse = field(default_factory=ToolUse)  # the functions it may call (the session's or the request's)
    asks_about_stream: bool = True  # False: the runtime's own prompt (the idle nudge), never checked by `grounding`
    input_items: tuple[str, ...] = ()  # conversation items whose text `text` holds (`response.input` references)
    speech: OutputAudio | None = None  # spoken (`output_modalities: ["audio"]`), in this format, voice and speed
    continues: bool = False  # a client's response.create: with no new user message, answer from the conversation
    response_id: str = field(default_factory=lambda: new_id("resp"))
    asked_wall: float = field(default_factory=time.perf_counter)
    answered: asyncio.Event = field(default_factory=asyncio.Event, compare=False)  # set once its answer ended

    def prompt(self, text: str) -> str:
        return f"{text}\n\nInstructions: {self.instructions}" if self.instructions else text


def answer_request(q: Question, question: str, calls: list[Item], conversation: Conversation) -> AnswerRequest:
    """What the model is asked for `q`: `question` about `conversation`, continuing `calls`."""
    return AnswerRequest(conversation.context(), q.prompt(question), q.max_tokens, q.tools,
                         context_before_calls=conversation.context(without=frozenset(it.item_id for it in calls)),
                         calls=past_calls(calls))


def past_calls(items: list[Item]) -> tuple[PastCall, ...]:
    """The calls since the user's last message, each with the output the client sent for it."""
    outputs = {it.call_id: it.stable for it in items if it.type == "function_call_output"}
    return tuple(PastCall(it.call_id, it.name, it.stable, outputs.get(it.call_id))
                 for it in items if it.type == "function_call")
