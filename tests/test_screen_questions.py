"""Questions about the screen (`memory/screen_questions.py`, applied by the question processor): a session without a
screen reader or a video model answers one that it cannot see the screen, never "Not known yet" and never the
model's guess; with the reader, the same question is answered by the model from the screens read (and, grounded,
"not known yet" only while no text on screen has been read)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from cli_common import run_cli
from session_fakes import EchoAnswerer, WordASR, audio_chunks, collect, profile_for
from test_grounding import answer, answer_text, screen, spoken
from test_response_output import Scripted

from runtime.chunks import VideoFrame
from runtime.config import with_overrides
from runtime.function_tools import FunctionTool, ToolUse
from runtime.loaded_models import Models
from runtime.memory.conversation import Conversation
from runtime.memory.grounding import Grounding, unheard
from runtime.memory.screen_notes import ScreenNotes
from runtime.memory.screen_questions import CANNOT_SEE_SCREEN, NOTHING_READ_YET, asks_about_screen
from runtime.models.ocr.reader import TextLine
from runtime.pipeline.questions import Question
from runtime.session_builder import open_session

SCREEN_QUESTIONS = [
    "What is on the slide?", "what does the screen show?", "What's written on screen?", "What is shown now?",
    "what is on the presentation slide", "Tell me what the slide says.", "Read the slide.",
    "Can you describe what is on the screen?", "What do you see?", "What is currently displayed?",
    "Is anything visible on the whiteboard?", "What does the slide say about the budget?",
    "So what's on the on-screen menu?", "Which number is written there?"]
NOT_SCREEN_QUESTIONS = [
    "What did the red ball do?", "What is the presentation about?", "What did the speaker say about the slide?",
    "What was mentioned on the slide?", "Who has written the report?", "Was it written by Ann?",
    "The study has shown what?", "Let me show you the next slide.", "When is the screening?", "What did they show?",
    "When is the webinar?", "What is happening?", ""]


@pytest.mark.parametrize("question", SCREEN_QUESTIONS)
def test_a_question_about_the_screen_is_one(question):
    assert asks_about_screen(question)


@pytest.mark.parametrize("question", NOT_SCREEN_QUESTIONS)
def test_a_question_about_the_talk_a_statement_or_an_author_is_not(question):
    assert not asks_about_screen(question)


@pytest.mark.parametrize("question", ["What's written on screen?", "What is currently displayed?",
                                      "Is anything visible?"])
def test_grounding_takes_the_words_about_the_screen_for_the_medium(question):
    """With the reader on, "written", "displayed" and "visible" are about the medium: heard nowhere, they still do
    not make the question "not known yet" (the screens answer it)."""
    assert unheard(question, "On screen: Budget | 4.2 million euros") == []


async def ask(conversation: Conversation, question: Question, *, sees_screen: bool,
              grounding: Grounding | None = None) -> tuple[Scripted, dict]:
    return await answer(conversation, question, grounding=grounding, sees_screen=sees_screen, reply="Lisbon.")


@pytest.mark.asyncio
@pytest.mark.parametrize("grounded", [False, True])
@pytest.mark.parametrize("question", ["What is on the slide?", "What's written on screen?", "What is shown now?",
                                      "What does the screen show?"])
async def test_a_session_that_cannot_see_says_so_and_the_model_is_not_asked(question, grounded):
    conversation = Conversation([spoken("u1", "Welcome to the launch.")])
    grounding = Grounding(conversation) if grounded else None
    answering, done = await ask(conversation, Question(question, 5.0, 0.0), sees_screen=False, grounding=grounding)
    assert answering.requests == []
    assert answer_text(done) == CANNOT_SEE_SCREEN and "Not known yet" not in CANNOT_SEE_SCREEN
    assert done["status"] == "completed" and done["screen"] == "unseen" and "grounding" not in done
    assert done["usage"]["output_tokens"] == done["usage"]["decode_steps"] == 0


@pytest.mark.asyncio
async def test_a_session_that_cannot_see_still_asks_the_model_the_rest():
    conversation = Conversation([spoken("u1", "The red ball rolls to the right.")])
    for question in (Question("What did the red ball do?", 5.0, 0.0),  # not about the screen
                     Question("What is on the slide?", 5.0, 0.0, asks_about_stream=False),  # the runtime's own
                     Question("What is on the slide?", 5.0, 0.0, tools=ToolUse((FunctionTool("look", "", {}),)))):
        answering, done = await ask(conversation, question, sees_screen=False)
        assert len(answering.requests) == 1 and answer_text(done) == "Lisbon." and "screen" not in done


@pytest.mark.asyncio
@pytest.mark.parametrize("question", ["What is on the slide?", "What's written on screen?", "What is shown now?",
                                      "What does the screen show?"])
async def test_with_the_screen_reader_the_same_question_is_answered_from_the_screen(question):
    conversation = Conversation([spoken("u1", "Welcome to the launch.")])
    notes = ScreenNotes(conversation, max_tokens=256, selected_tokens=128, count=lambda text: len(text.split()))
    notes.publish("s1", 1.0, 4.0, ["Budget review 2027", "Office opens in Lisbon"])
    answering, done = await ask(conversation, Question(question, 5.0, 0.0), sees_screen=True,
                                grounding=Grounding(conversation, screens=notes.shown))
    assert len(answering.requests) == 1 and answer_text(done) == "Lisbon."
    assert "Office opens in Lisbon" in answering.requests[0].context  # the model reads the screen
    assert "grounding" not in done and "screen" not in done


@pytest.mark.asyncio
async def test_grounded_with_the_reader_a_screen_question_before_any_text_was_read_is_not_known_yet():
    conversation = Conversation([spoken("u1", "Welcome to the launch.")])
    notes = ScreenNotes(conversation, max_tokens=256, selected_tokens=128, count=lambda text: len(text.split()))
    grounding = Grounding(conversation, screens=notes.shown)
    answering, done = await ask(conversation, Question("What is on the slide?", 5.0, 0.0), sees_screen=True,
                                grounding=grounding)
    assert answering.requests == [] and answer_text(done) == NOTHING_READ_YET
    assert done["grounding"] == {"not_heard": [], "screen": "unread"} and "screen" not in done
    # a screen in the conversation itself (a client's, or one read before) is text read on screen too
    answering, done = await ask(Conversation([screen("s1", "Budget | 4.2 million euros")]),
                                Question("What is on the slide?", 5.0, 0.0), sees_screen=True,
                                grounding=Grounding(Conversation(), screens=lambda: ["Budget | 4.2 million euros"]))
    assert len(answering.requests) == 1


class SlideReader:
    """Reads the same slide off every frame."""

    def read(self, image: np.ndarray) -> list[TextLine]:
        return [TextLine("Budget review 2027", (0.1, 0.1, 0.9, 0.2), 0.99),
                TextLine("Office opens in Lisbon", (0.1, 0.3, 0.9, 0.4), 0.99)]


async def ask_session(worker, models: Models, question: str, frames: int = 0, **lm) -> tuple[dict, EchoAnswerer]:
    profile = with_overrides(profile_for(), lm=lm) if lm else profile_for()
    session = await (await open_session(profile, models, worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(6):
        await session.push_audio(chunk)
    for t in range(frames):
        assert session.push_video(VideoFrame(np.full((48, 64, 3), 200, np.uint8), float(t)))
        await session.video_settled()  # read (or not) before the next frame
    await session.ask(question, wait=True)
    await session.finish()
    return next(e for e in await events if e.type == "response.done").response, models.answerer  # type: ignore[return-value]


@pytest.mark.asyncio
@pytest.mark.parametrize("grounded", [False, True])
async def test_a_session_built_without_reader_or_video_model_cannot_see(worker, grounded):
    done, answerer = await ask_session(worker, Models(WordASR(), EchoAnswerer()), "what is on the slide?", frames=3,
                                       grounded=grounded)
    assert done["output"][0]["content"][0]["text"] == CANNOT_SEE_SCREEN and answerer.contexts == []


@pytest.mark.asyncio
async def test_a_session_built_with_the_reader_answers_from_the_screen(worker):
    done, answerer = await ask_session(worker, Models(WordASR(), EchoAnswerer(), reader=SlideReader()),
                                       "what is on the slide?", frames=4, grounded=True)
    assert "screen" not in done and "grounding" not in done
    assert len(answerer.contexts) == 1 and "Office opens in Lisbon" in answerer.contexts[0]


def test_ask_without_the_screen_reader_says_it_cannot_see(capsys, demo_file):
    """End to end through `runtime ask`: a profile with neither the reader nor a video model (tiny-fastconformer)
    says it cannot see, in the text and in `response.done`."""
    code, out, err = run_cli(capsys, "ask", str(demo_file), "What is on the slide?", "--at", "2", "--json", "-q",
                             "--profile", "tiny-fastconformer")
    assert code == 0, err
    done = next(json.loads(line) for line in out.splitlines() if json.loads(line)["type"] == "response.done")
    assert done["response"]["screen"] == "unseen"
    assert done["response"]["output"][0]["content"][0]["text"] == CANNOT_SEE_SCREEN


def test_a_screen_question_that_points_at_no_screen_is_given_the_latest_one():
    """The current screen goes with "what does the slide say?" even while the context holds it whole (a 135M model
    answered from the context alone with an older slide's lines); a question naming a screen gets that one as before,
    and one about the talk gets none."""
    conversation = Conversation()
    notes = ScreenNotes(conversation, max_tokens=256, selected_tokens=128, count=lambda text: len(text.split()))
    notes.publish("s1", 0.0, 5.0, ["Budget review 2027", "Office opens in Lisbon"])
    notes.publish("s2", 5.0, 9.0, ["Roadmap", "Launch in May"])
    given = notes.with_question("What does the slide say?")
    assert given.endswith("\n\nWhat does the slide say?") and "Roadmap" in given and "Lisbon" not in given
    assert notes.with_question("What did the budget slide say?") == "What did the budget slide say?"  # whole already
    assert notes.with_question("What did the speaker say?") == "What did the speaker say?"
