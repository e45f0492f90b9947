"""The conversation's items and context, and how an input buffer folds the ASR's own items into one user item,
worked out by hand."""

import pytest
from test_grounding import ask, screen, spoken

from runtime.memory.conversation import Conversation, Item
from runtime.models.asr.base import TranscriptUpdate as U
from runtime.pipeline.input_buffer import BufferTranscript
from runtime.pipeline.questions import Question


def test_a_buffer_folds_the_asrs_items_into_one_whose_deltas_add_up_to_its_text():
    buffer = BufferTranscript("item_b", 1.0)
    folded = [buffer.fold(u) for u in [
        U("a", "hello", " wor", 1.0, 1.5),
        U("a", "", "", 1.0, 1.6),  # nothing new: nothing to emit
        U("a", "", "", 1.0, 2.0, completed=True, transcript="hello world"),  # the final text adds " world"
        U("b", "", "how", 2.0, 2.3),  # the next item's first words: a space before them
        U("b", "how are", " you", 2.0, 2.6),
        U("b", "", "", 2.0, 3.0, completed=True, transcript="how are you"),
    ]]
    assert folded[1] is None
    assert [(f.delta, f.unstable) for f in folded if f is not None] == [
        ("hello", " wor"), (" world", ""), ("", " how"), (" how are", " you"), (" you", "")]
    assert {f.item_id for f in folded if f is not None} == {"item_b"} and folded[-1].start == 1.0
    assert "".join(f.delta for f in folded if f is not None) == "hello world how are you" == buffer.text
    done = buffer.complete(3.0)
    assert (done.completed, done.transcript, done.start, done.end) == (True, "hello world how are you", 1.0, 3.0)


def test_a_final_text_that_revises_the_streamed_one_wins():
    buffer = BufferTranscript("i", 0.0)
    buffer.fold(U("a", "helo", "", 0.0, 0.5))
    assert buffer.fold(U("a", "", "", 0.0, 1.0, completed=True, transcript="hello")).delta == ""
    assert buffer.complete(1.0).transcript == "hello"


def test_the_context_is_a_line_per_item_and_a_response_answers_the_latest_turn():
    talk = Conversation()
    talk.apply(U("item_1", "the red ball", "", 0.0, 2.0))
    talk.add(Item("item_2", 2.5, 2.5, role="user", audio=False, stable="what moved?"))
    assert talk.pending_user_text() == "the red ball what moved?"
    talk.add(Item("item_3", 3.0, 3.0, role="assistant", audio=False, stable="The ball."))
    assert talk.pending_user_text() == ""
    talk.apply(U("item_4", "and then", "", 4.0, 5.0))
    assert talk.context() == ("[00:00.0] the red ball\n[00:02.5] User: what moved?\n[00:03.0] Assistant: The ball.\n"
                              "[00:04.0] and then")
    assert talk.pending_user_text() == "and then"
    assert talk.final_text() == "the red ball and then"  # the spoken words alone
    assert talk.previous_id("item_3") == "item_2" and talk.previous_id("item_1") is None
    assert talk.add(Item("item_0", 0.0, 0.0, role="system", audio=False, stable="Be brief."), after="root") is None
    assert talk.items[0].line() == "[00:00.0] System: Be brief."
    assert talk.add(Item("x", 0.0, 0.0, audio=False, stable="x"), after="item_2") == "item_2"
    with pytest.raises(KeyError):
        talk.add(Item("y", 0.0, 0.0), after="nope")
    assert talk.delete("x") and not talk.delete("x")


def test_an_earlier_spoken_item_is_context_not_the_question():
    talk = Conversation()
    talk.apply(U("talk", "an hour of a talk", "", 0.0, 3600.0, completed=True, transcript="an hour of a talk"))
    talk.apply(U("turn", "what was the plan", "", 3600.0, 3602.0))
    talk.add(Item("typed", 3603.0, 3603.0, audio=False, stable="in short"))
    assert talk.pending_user_text() == "what was the plan in short"


def test_items_read_as_the_api_writes_them():
    spoken = Item("a", 0.0, 1.0, status="in_progress")
    assert spoken.to_api() == {"id": "a", "object": "realtime.item", "type": "message", "role": "user",
                               "status": "in_progress", "content": [{"type": "input_audio", "transcript": None}]}
    answer = Item("b", 1.0, 1.0, role="assistant", audio=False, stable="Yes.")
    assert answer.to_api()["content"] == [{"type": "output_text", "text": "Yes."}]
    typed = Item("c", 1.0, 1.0, audio=False, stable="hi")
    assert typed.to_api()["content"] == [{"type": "input_text", "text": "hi"}]


def test_the_runtimes_own_items_are_not_the_apis_previous_item() -> None:
    from runtime.memory.conversation import Conversation, Item

    c = Conversation()
    c.add(Item("item_a", 0.0, 1.0, audio=False, stable="hello"))
    before = c.add(Item("screen_0", 1.0, 2.0, role="system", audio=False, stable="Budget", label="On screen",
                        in_api=False))
    assert before == "item_a"
    assert c.add(Item("item_b", 2.0, 3.0, audio=False, stable="next")) == "item_a"
    assert c.previous_id("item_b") == "item_a" and c.previous_id("item_a") is None
    assert "[00:01.0] On screen: Budget" in c.context()  # the answerer still reads it


def _typed(item_id: str, text: str, role: str = "user", **kw) -> Item:
    return Item(item_id, 1.0, 1.0, role=role, audio=False, stable=text, completed=True, **kw)


def _call(item_id: str, call_id: str, arguments: str, status: str = "completed") -> Item:
    return _typed(item_id, arguments, "assistant", type="function_call", call_id=call_id, name="get_weather",
                  status=status)


def _output(item_id: str, call_id: str, output: str) -> Item:
    return _typed(item_id, output, type="function_call_output", call_id=call_id, name="get_weather")


def test_a_call_continued_after_text_the_calling_response_said_still_answers_the_users_question():
    c = Conversation([_typed("u1", "Weather in Paris?"), _typed("a1", "Let me check.", "assistant"),
                      _call("f1", "call_1", '{"city":"Paris"}'), _output("o1", "call_1", "18 C")])
    assert c.pending_user_text() == "Weather in Paris?"
    assert [it.item_id for it in c.calls_since_user()] == ["f1", "o1"]
    # a finished answer after the exchange ends it: nothing is pending
    c.items.append(_typed("a2", "It is 18 C.", "assistant"))
    assert c.pending_user_text() == ""


def test_an_output_that_landed_after_a_screen_or_was_multi_line_is_still_its_calls():
    screen = _typed("s1", "Quarterly budget", "system", label="On screen", in_api=False)
    c = Conversation([_typed("u1", "Weather in Paris?"), _call("f1", "call_1", '{"city":"Paris"}'), screen,
                      _output("o1", "call_1", '{\n  "temp": 18\n}')])
    assert [it.item_id for it in c.calls_since_user()] == ["f1", "o1"]
    without = c.context(without=frozenset({"f1", "o1"}))
    assert "returned" not in without and "called" not in without and "Quarterly budget" in without
    assert "Weather in Paris?" in without


def test_a_call_cut_short_is_not_continued_and_hidden_items_are_not_addressable():
    c = Conversation([_typed("u1", "Weather?"), _call("f1", "call_1", '{"ci', status="incomplete"),
                      _typed("s1", "Slide", "system", label="On screen", in_api=False)])
    assert c.calls_since_user() == []
    assert c.api_item("s1") is None and c.get("s1") is not None and c.api_item("u1") is not None


def test_without_answers_in_context_the_assistants_messages_leave_the_context_and_its_calls_stay():
    items = [Item("u1", 0.0, 1.0, stable="Weather in Paris?"),
             Item("a1", 1.0, 1.0, role="assistant", audio=False, stable="Checking."),
             Item("c1", 1.0, 1.0, role="assistant", audio=False, type="function_call", name="get_weather",
                  call_id="call_a", stable='{"city": "Paris"}'),
             Item("o1", 1.5, 1.5, audio=False, type="function_call_output", name="get_weather", call_id="call_a",
                  stable="sunny"),
             Item("a2", 2.0, 2.0, role="assistant", audio=False, stable="It is sunny in Paris.")]
    full = Conversation(list(items)).context()
    assert "Assistant: Checking." in full and "Assistant: It is sunny" in full
    lean = Conversation(list(items), answers_in_context=False).context()
    assert lean.splitlines() == [line for line in full.splitlines() if "Assistant: " not in line]
    assert "Assistant called get_weather" in lean and "returned: sunny" in lean
    assert Conversation(list(items), answers_in_context=False).pending_user_text() == ""  # answered: nothing pends


@pytest.mark.parametrize("speech_first", [True, False])
def test_the_context_is_in_media_time_order_whichever_of_the_asr_and_the_screen_reader_was_behind(speech_first):
    # unpaced, the screen reader reads the slide at 9 s before the ASR has published the speech from 8 s; live,
    # the other way round: both orders of arrival give the same context
    talk = Conversation()
    talk.apply(U("a1", "hello", "", 0.0, 2.0, completed=True, transcript="hello"))
    speech, slide = U("a2", "the budget", "", 8.0, 9.5), screen("s1", "Budget", 9.0)
    if speech_first:
        talk.apply(speech)
        talk.add_in_time(slide)
    else:
        talk.add_in_time(slide)
        talk.apply(speech)
    # while the turn is spoken its growing line comes after the slide read meanwhile (each new word an append,
    # not a cut before the slide's line); completed, it takes its media-time place
    assert talk.context() == "[00:00.0] hello\n[00:09.0] On screen: Budget\n[00:08.0] the budget"
    talk.apply(U("a2", " was approved", "", 8.0, 10.0))
    assert talk.context().endswith("On screen: Budget\n[00:08.0] the budget was approved")
    talk.apply(U("a2", "", "", 8.0, 10.0, completed=True, transcript="The budget was approved."))
    assert talk.context() == "[00:00.0] hello\n[00:08.0] The budget was approved.\n[00:09.0] On screen: Budget"
    assert talk.previous_id("a2") == "a1"


def test_an_open_turn_is_held_only_past_the_runtimes_own_lines():
    talk = Conversation()
    talk.apply(U("a1", "the board", " approve", 8.0, 9.0))
    talk.add(Item("q1", 9.2, 9.2, audio=False, stable="When?", question=True))  # a client's line after it
    talk.add_in_time(screen("s1", "Budget", 9.5))
    assert talk.context() == "[00:08.0] the board approve\n[00:09.2] User: When?\n[00:09.5] On screen: Budget"


def test_only_the_runtimes_own_items_move_for_a_new_spoken_one_and_the_api_order_stays():
    talk = Conversation()
    talk.add(Item("typed", 5.0, 5.0, audio=False, stable="what now?"))  # a client's item: never reordered
    talk.add_in_time(screen("s1", "Roadmap", 6.0))
    talk.apply(U("a1", "we ship", "", 4.0, 7.0))  # said from 4 s, published after both
    assert [it.item_id for it in talk.items] == ["typed", "a1", "s1"]
    assert talk.previous_id("a1") == "typed"
    talk.add_in_time(screen("s0", "Intro", 4.5))  # a screen read late goes back to its time, past API items too
    assert [it.item_id for it in talk.items] == ["typed", "a1", "s0", "s1"]
    talk.add_in_time(screen("s2", "Title", 2.0))
    assert [it.item_id for it in talk.items] == ["s2", "typed", "a1", "s0", "s1"]
    assert talk.line_before("a1") == "typed" and talk.line_before("s2") == "root" and talk.line_before("x") is None


@pytest.mark.asyncio
async def test_a_recorded_question_goes_right_before_its_answer_after_a_screen_read_since_the_last_turn():
    conversation = Conversation([spoken("u1", "Here is the budget."), screen("s1", "Budget | 4.2 million euros")])
    await ask(conversation, Question("What is the budget?", 14.0, 0.0, record_question=True), grounded=False)
    assert [it.text for it in conversation.items] == ["Here is the budget.", "Budget | 4.2 million euros",
                                                      "What is the budget?", "June."]
