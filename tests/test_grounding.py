"""`lm.grounded` (`memory/grounding.py`, applied by the question processor): a question none of whose words was
heard, shown or written yet is answered "not known yet" without asking the model. One shared word (in any of its
common forms), an open question, declared tools, the runtime's own idle prompt or the setting off send it to the
model; the assistant's own answers, recorded questions and the question's own items never vouch for it; a screen
vouches with all it showed, even once the context holds only its title. And `lm.answers_in_context = false`: the
model reads the questions but not its answers."""

from __future__ import annotations

import asyncio

import pytest
from session_fakes import EchoAnswerer, WordASR, audio_chunks, collect, profile_for
from test_response_output import Scripted, spoken

from runtime.channels import BlockingChannel
from runtime.config import with_overrides
from runtime.errors import ConfigError
from runtime.function_tools import FunctionTool, ToolUse
from runtime.loaded_models import Models, load_models
from runtime.memory.conversation import Conversation, Item
from runtime.memory.grounding import Grounding, is_question, not_known_answer, stem, terms, unheard
from runtime.memory.screen_notes import LABEL, ScreenNotes
from runtime.models.lm.answering import Step
from runtime.models.lm.prompt import IDLE_QUESTION
from runtime.pipeline.answers import QuestionProcessor
from runtime.pipeline.questions import Question
from runtime.pipeline.response_requests import ResponseRequests
from runtime.session_builder import open_session
from runtime.session_config import SessionConfig
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock, SessionSettings


def screen(item_id: str, text: str, at: float = 0.0) -> Item:
    return Item(item_id, at, at, role="system", audio=False, stable=text, label=LABEL, in_api=False)


@pytest.mark.parametrize("forms", [
    ("hire", "hired", "hiring"), ("release", "released", "releasing", "releases"), ("approve", "approves", "approved"),
    ("city", "cities"), ("company", "companies"), ("apply", "applied"), ("plan", "planned", "plans"),
    ("cut", "cutting"), ("stop", "stopped"), ("early", "earlier"), ("engineer", "engineers"), ("class", "classes"),
    ("bus", "buses"), ("volcano", "volcanoes"), ("go", "goes"), ("setting", "settings"), ("4,200", "4200")])
def test_stem_meets_the_common_forms_of_a_word(forms):
    assert len({stem(form) for form in forms}) == 1


def test_stem_keeps_apart_what_differs_and_numbers_whole():
    assert stem("4.2") == "4.2" and stem("42") == "42" and stem("4.2") != stem("42")
    assert stem("status") == "status" and stem("analysis") == "analysis"  # not plurals
    assert stem("monday") != stem("month") and stem("apply") != stem("app")


def test_terms_leave_out_function_words_contractions_and_short_words():
    assert terms("What's the public release date? Does it? Who is the EU's CEO?") == [
        ("public", "public"), ("release", "releas"), ("date", "dat"), ("ceo", "ceo")]


def test_unheard_names_the_words_as_written_only_when_none_was_heard():
    said = "[00:08.0] On screen: Budget | Total budget: 4.2 million euros\n[00:09.0] The board approved it on Monday."
    assert unheard("When is the public release?", said) == ["public", "release"]
    assert unheard("Which companies are hiring?", said) == ["companies", "hiring"]  # as written, not stems
    assert unheard("What is the total budget?", said) == []
    assert unheard("Who approves the budgets?", said) == []
    assert unheard("Is it 4.2 million?", said) == []
    assert unheard("Is it 4,200 euros?", "the fee is 4200") == []
    assert unheard("When is the webinar?", "") == ["webinar"]
    # a "does" or a "'s" heard somewhere vouches for nothing
    assert unheard("What's the webinar's date? Does it?", "It does. Let's go.") == ["webinar"]
    # a word that names the kind of answer ("day") is answered by another word ("Thursday"): never abstained on
    assert unheard("What day is the meeting?", "Let me then move to Thursday at 10.") == []
    assert unheard("What day is the launch?", "Let me then move to Thursday at 10.") == ["launch"]


@pytest.mark.parametrize("question", [
    "What is happening?", "What's going on?", "What is the speaker talking about?", "Summarize the talk so far.",
    "What did they say?", "What is on the slide now?", "And then?", "What is she presenting?", "What was explained?",
    "What are they discussing?", "Give me an overview", "Recap please", "What was the conclusion?", "Any questions?",
    "Tell me more"])
def test_an_open_question_always_goes_to_the_model(question):
    assert unheard(question, "") == []


@pytest.mark.parametrize(("text", "asks"), [
    ("When is the webinar?", True), ("when is the webinar", True), ("what's the plan", True),
    ("OK. And what about the webinar?", True), ("Is it Monday", True), ("Thanks. So when is the release", True),
    ("okay um where's the office", True), ("Let me show you the next slide.", False),
    ("Good morning everyone.", False), ("Tell me the budget.", False), ("Thanks!", False)])
def test_only_a_question_is_checked(text, asks):
    assert is_question(text) == asks
    if not asks:  # a statement, a greeting or a request goes to the model, whatever its words
        assert unheard(text, "") == []


@pytest.mark.parametrize("question", ["Hello, how are you?", "Hey, good morning?", "Okay, thanks?"])
def test_greetings_go_to_the_model(question):
    assert unheard(question, "") == []


def test_open_words_still_vouch_when_they_were_heard():
    assert unheard("Who gave the lecture?", "On screen: Lecture 4 | Professor Alan Reyes") == []
    assert unheard("Who gave the lecture?", "On screen: Mount Etna") == ["gave"]


def test_evidence_leaves_out_the_assistant_recorded_questions_and_the_question_itself():
    question = spoken("u2", "When is the webinar?")
    conversation = Conversation([
        spoken("u1", "Welcome to the launch."), screen("s1", "Pricing | Pro plan 29 euros"),
        Item("q1", 0.5, 0.5, audio=False, stable="Is the keynote recorded?", question=True),
        Item("a1", 1.0, 1.0, role="assistant", audio=False, stable="The webinar is in June."),
        Item("c1", 1.0, 1.0, role="assistant", audio=False, type="function_call", name="look_up",
             stable='{"q": "webinar date"}'),
        Item("o1", 1.0, 1.0, audio=False, type="function_call_output", stable="Northwind bank"), question])
    said = Grounding(conversation).evidence([question], instructions="Priya leads the team.")
    assert "launch" in said and "Pro plan" in said and "Northwind" in said and "Priya" in said
    assert "webinar" not in said and "keynote" not in said


def test_a_screen_the_context_holds_only_as_a_title_still_vouches_with_every_line():
    conversation = Conversation()
    notes = ScreenNotes(conversation, max_tokens=30, selected_tokens=100, count=lambda text: len(text.split()))
    notes.publish("s1", 0.0, 5.0, ["Costs", "Travel cut by 15 percent", "Designers hired: 3"])
    for i in range(2, 7):
        notes.publish(f"s{i}", 5.0 * i, 5.0 * i + 4, [f"Slide {i}", f"Topic number {i} of the quarter"])
    assert "Designers" not in conversation.context()  # consolidated away from what the model reads
    question = "How many designers were hired?"
    assert Grounding(conversation).not_heard(question) == ["designers", "hired"]
    assert Grounding(conversation, screens=notes.shown).not_heard(question) == []


async def answer(conversation: Conversation, question: Question, *, grounding: Grounding | None,
                 sees_screen: bool = True, reply: str = "June.") -> tuple[Scripted, dict]:
    """`question` through a QuestionProcessor whose model would answer `reply`: (the model, response.done's
    response)."""
    answering = Scripted([Step(text=reply, tokens=1), Step(done=True, finish_reason="stop")])
    events: list = []

    async def emit(event) -> None:
        events.append(event)

    channel: BlockingChannel[Question] = BlockingChannel(4, "questions")
    processor = QuestionProcessor(channel, answering, emit, conversation, HeardClock(), AnswerActivity(),
                                  ContextChanges(), grounding=grounding, sees_screen=sees_screen)
    task = asyncio.create_task(processor.run())
    await channel.put(question)
    await asyncio.wait_for(question.answered.wait(), 5)
    channel.close()
    await task
    return answering, next(e for e in events if e.type == "response.done").response


async def ask(conversation: Conversation, question: Question, grounded: bool = True) -> tuple[Scripted, dict]:
    return await answer(conversation, question, grounding=Grounding(conversation) if grounded else None)


def answer_text(done: dict) -> str:
    return done["output"][0]["content"][0]["text"]


@pytest.mark.asyncio
async def test_a_question_nothing_mentions_is_not_known_yet_and_the_model_is_not_asked():
    conversation = Conversation([spoken("u1", "Welcome to the launch."), screen("s1", "Pricing | Pro plan 29 euros")])
    answering, done = await ask(conversation, Question("When is the webinar?", 14.0, 0.0, record_question=True))
    assert answering.requests == []
    assert answer_text(done) == not_known_answer(["webinar"])
    assert done["status"] == "completed" and done["grounding"] == {"not_heard": ["webinar"]}
    assert done["usage"]["output_tokens"] == done["usage"]["decode_steps"] == 0  # nothing was decoded
    # the question and its answer join the conversation as any other's; neither vouches for the question again
    texts = [it.text for it in conversation.items]
    assert texts.index("When is the webinar?") < texts.index(not_known_answer(["webinar"]))
    again, done = await ask(conversation, Question("When is the webinar?", 15.0, 0.0))
    assert again.requests == [] and done["grounding"] == {"not_heard": ["webinar"]}


@pytest.mark.asyncio
async def test_an_answer_outside_the_conversation_is_not_known_yet_too_and_leaves_it_as_it_was():
    conversation = Conversation([spoken("u1", "Welcome to the launch.")])
    answering, done = await ask(conversation, Question("When is the webinar?", 14.0, 0.0, in_conversation=False))
    assert answering.requests == [] and answer_text(done) == not_known_answer(["webinar"])
    assert [it.item_id for it in conversation.items] == ["u1"]


@pytest.mark.asyncio
async def test_one_shared_word_the_setting_off_declared_tools_or_the_runtimes_own_prompt_ask_the_model():
    conversation = Conversation([spoken("u1", "Welcome to the launch."), screen("s1", "Pricing | Pro plan 29 euros")])
    calendar = (FunctionTool("calendar", "", {}),)
    for question, grounded in [(Question("What does the pro plan cost?", 14.0, 0.0), True),
                               (Question("When is the webinar?", 14.0, 0.0), False),
                               (Question("When is the webinar?", 14.0, 0.0, asks_about_stream=False), True),
                               (Question("When is the webinar?", 14.0, 0.0, tools=ToolUse(calendar)), True)]:
        answering, done = await ask(conversation, question, grounded)
        assert len(answering.requests) == 1 and answer_text(done) == "June." and "grounding" not in done
    # tools declared but not to be called (`tool_choice: none`): the check applies
    answering, done = await ask(conversation, Question("When is the webinar?", 14.0, 0.0,
                                                       tools=ToolUse(calendar, "none")))
    assert answering.requests == [] and done["grounding"] == {"not_heard": ["webinar"]}


@pytest.mark.asyncio
async def test_an_answer_that_continues_function_calls_asks_the_model():
    """After a call and its output, the response answering the user's turn reads the output: what the stream never
    mentioned ("the weather in Paris"), the function said, so the check does not apply (tools or not)."""
    conversation = Conversation([
        spoken("u1", "What's the weather in Paris?"),
        Item("c1", 1.0, 1.0, role="assistant", audio=False, type="function_call", name="get_weather", call_id="call_1",
             stable='{"city": "Paris"}'),
        Item("o1", 1.0, 1.0, audio=False, type="function_call_output", call_id="call_1", stable="21 degrees, sunny")])
    weather = (FunctionTool("get_weather", "", {}),)
    answering, done = await ask(conversation, Question(None, 2.0, 0.0, tools=ToolUse(weather, "none")))
    assert len(answering.requests) == 1 and "grounding" not in done


@pytest.mark.asyncio
async def test_a_question_does_not_vouch_for_itself_spoken_or_referenced():
    conversation = Conversation([screen("s1", "Budget | 4.2 million euros"),
                                 spoken("u1", "When is the public release?")])
    answering, done = await ask(conversation, Question(None, 5.0, 0.0))  # the user's spoken turn
    assert answering.requests == [] and done["grounding"] == {"not_heard": ["public", "release"]}
    conversation = Conversation([screen("s1", "Budget | 4.2 million euros"),
                                 Item("t1", 1.0, 1.0, audio=False, stable="When is the public release?")])
    # `response.input` naming the item: its text is the question's
    answering, done = await ask(conversation, Question("When is the public release?", 5.0, 0.0, input_items=("t1",)))
    assert answering.requests == [] and done["grounding"] == {"not_heard": ["public", "release"]}
    conversation = Conversation([screen("s1", "Budget | 4.2 million euros"),
                                 spoken("u0", "The public release is in September."),
                                 spoken("u1", "When is the public release?")])
    answering, done = await ask(conversation, Question(None, 6.0, 0.0))
    assert len(answering.requests) == 1


@pytest.mark.asyncio
async def test_the_idle_request_says_it_does_not_ask_about_the_stream():
    channel: BlockingChannel[Question] = BlockingChannel(4, "questions")
    requests = ResponseRequests(channel, None, AnswerActivity(), HeardClock(), SessionSettings(SessionConfig()),
                                emit=None)
    await requests.idle_timeout("item_1", 3.0)
    asked = await channel.get()
    assert asked.text == IDLE_QUESTION and not asked.asks_about_stream


@pytest.mark.asyncio
async def test_a_session_built_grounded_and_without_its_answers_in_context(worker):
    profile = with_overrides(profile_for(), lm={"grounded": True, "answers_in_context": False})
    answerer = EchoAnswerer()
    session = await (await open_session(profile, Models(WordASR(), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(6):
        await session.push_audio(chunk)
    await session.ask("when is the webinar?")
    await session.ask("what about w3?")
    await session.ask("and w4?")
    await session.finish()
    done = [e.response for e in await events if e.type == "response.done"]
    assert [d.get("grounding") for d in done] == [{"not_heard": ["webinar"]}, None, None]
    assert len(answerer.contexts) == 2  # the model was asked the two questions about what was heard
    # the questions are in what the model reads; the answers (its own and the "not known yet") are not
    assert "User: when is the webinar?" in answerer.contexts[1] and "User: what about w3?" in answerer.contexts[1]
    assert "Not known yet" not in answerer.contexts[1]
    assert "what about w3?->" not in answerer.contexts[1]


def test_grounded_is_refused_beside_a_vision_language_models_video_memory(worker):
    profile = with_overrides(profile_for(), lm={"grounded": True})  # tiny: a random LLaVA-OneVision with memory
    with pytest.raises(ConfigError, match="lm.grounded"):
        load_models(profile, worker)


@pytest.mark.asyncio
async def test_a_turns_earlier_item_vouches_for_its_question():
    """Two typed messages before one `response.create`: both are the pending turn, and the first is what the question
    stands on, so the model is asked. The question's own item still vouches for nothing."""

    def typed(item_id: str, text: str) -> Item:
        return Item(item_id, 0.0, 0.0, audio=False, stable=text, completed=True, status="completed")

    conversation = Conversation([typed("u1", "The launch moved to Thursday."), typed("u2", "When is the launch?")])
    answering, done = await ask(conversation, Question(None, 14.0, 0.0))
    assert len(answering.requests) == 1 and answer_text(done) == "June." and "grounding" not in done
    alone = Conversation([typed("u1", "When is the launch?")])
    answering, done = await ask(alone, Question(None, 14.0, 0.0))
    assert answering.requests == [] and done["grounding"] == {"not_heard": ["launch"]}
