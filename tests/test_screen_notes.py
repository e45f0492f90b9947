"""Screen notes within a token budget: a long scripted talk keeps its screens' lines in the context within the
budget (not growing), the newest screens whole, the context append-only between consolidation batches, and a
question about an old slide gets that slide's full text with it; a short talk under budget is left as it was."""

from __future__ import annotations

import asyncio

from runtime.memory.conversation import Conversation, Item
from runtime.memory.screen_notes import LOW_WATER, ScreenNotes, note_line, token_counter
from runtime.memory.screen_selection import pick, relation
from runtime.models.lm.answering import AnswerRequest
from runtime.pipeline.questions import Question
from runtime.pipeline.screen import NotesWithQuestion

TOPICS = ["Quarterly update", "Budget", "Hiring", "Roadmap", "Pricing", "Partners", "Volcanoes", "Lava types",
          "Homework", "Project Falcon", "Lisbon office", "Risks", "Marketing", "Support", "Security", "Training",
          "Suppliers", "Timeline", "Customers", "Wrap up"]
BUDGET = 120
count = token_counter(None)  # words * 1.3: the count a remote answerer (no tokenizer) gets


def slide(i: int) -> list[str]:
    return [TOPICS[i], f"Fact {i}: {100 + i * 7} units", f"Owner: {['Maria', 'Alan', 'Priya', 'Chen'][i % 4]} {i}"]


def screen_lines(conversation: Conversation) -> list[str]:
    return [line for line in conversation.context().splitlines() if "] On screen: " in line]


def screen_tokens(conversation: Conversation) -> int:
    """Counted from the context itself, not from the notes' own bookkeeping."""
    return sum(count(line) + 1 for line in screen_lines(conversation))


def talk(n: int, *, budget: int = BUDGET) -> tuple[Conversation, ScreenNotes, list[int], list[bool]]:
    """`n` slides, each with a sentence said while it was up; per slide: the screen tokens in the context after
    it, and whether the context before it is a prefix of the context after it (append-only)."""
    conversation = Conversation()
    notes = ScreenNotes(conversation, max_tokens=budget, selected_tokens=60, count=count)
    tokens, appended = [], []
    for i in range(n):
        before = conversation.context()
        conversation.add(Item(f"said_{i}", i * 10.0, i * 10.0 + 4, stable=f"now about {TOPICS[i].lower()}",
                              completed=True))
        notes.publish(f"screen_{i}", i * 10.0 + 1, i * 10.0 + 9, slide(i))
        tokens.append(screen_tokens(conversation))
        appended.append(conversation.context().startswith(before))
    return conversation, notes, tokens, appended


def test_a_long_talk_keeps_its_screens_within_the_budget() -> None:
    conversation, notes, tokens, _ = talk(len(TOPICS))
    assert max(tokens) <= BUDGET  # after every slide, not only at the end
    assert tokens[-1] == notes.context_tokens  # the notes count what the context holds
    assert sum(count(" | ".join(slide(i))) for i in range(len(TOPICS))) > 2 * BUDGET  # the talk is well over
    assert max(tokens[len(TOPICS) // 2 :]) <= BUDGET and len(screen_lines(conversation)) < len(TOPICS) // 2
    # the newest screens are whole, the ones before them their title, the oldest one index line
    lines = screen_lines(conversation)
    assert lines[-1].endswith("On screen: " + " | ".join(slide(len(TOPICS) - 1)))
    assert any(line.endswith(f"On screen: {TOPICS[i]} …") for line in lines for i in range(len(TOPICS)))
    assert "earlier screens" in lines[0] and sum("earlier screens" in line for line in lines) == 1
    metrics = notes.metrics()
    assert metrics["indexed"] > 0 and metrics["whole"] >= 1
    # what was said is never touched, and stays in order
    said = [line for line in conversation.context().splitlines() if "On screen" not in line]
    assert said == [f"[{i // 6:02d}:{i * 10 % 60:04.1f}] now about {t.lower()}" for i, t in enumerate(TOPICS)]


def test_consolidation_comes_in_batches_and_appends_otherwise() -> None:
    _, notes, tokens, appended = talk(len(TOPICS))
    batches = notes.stats.consolidations
    assert 0 < batches <= len(TOPICS) // 3  # half the budget freed each time, not a rewrite per slide
    assert appended.count(False) == batches  # between batches the context only grows at its end
    assert notes.stats.recut_tokens > 0  # what the batches cost in re-prefill is reported
    after_batch = [t for t, ok in zip(tokens, appended, strict=True) if not ok]
    # a batch brings the screens to about half the budget (the newest slide's line lands on top)
    assert all(t <= BUDGET * LOW_WATER + count(" | ".join(slide(0))) + 10 for t in after_batch)


def test_a_short_talk_under_budget_is_unchanged() -> None:
    conversation, notes, tokens, appended = talk(3)
    assert all(appended) and notes.stats.consolidations == 0
    assert [line.split("On screen: ")[1] for line in screen_lines(conversation)] == [" | ".join(slide(i))
                                                                                     for i in range(3)]
    assert notes.with_question("What did the Budget slide say?") == "What did the Budget slide say?"
    assert notes.metrics()["selected"] == 0


def test_no_budget_keeps_every_screen_whole() -> None:
    conversation, notes, _, appended = talk(len(TOPICS), budget=0)
    assert all(appended) and len(screen_lines(conversation)) == len(TOPICS)


def test_a_question_naming_an_old_slide_gets_its_full_text() -> None:
    _, notes, _, _ = talk(len(TOPICS))
    hiring = notes.notes[2]
    assert not hiring.whole_in_context  # consolidated long ago
    asked = "How many units were on the hiring slide?"
    prompt = notes.with_question(asked)
    assert prompt == note_line(hiring) + "\n\n" + asked
    assert "Fact 2: 114 units" in prompt and notes.metrics()["last_selected"] == ["screen_2"]
    # a slide the context still holds whole is not repeated
    newest = TOPICS[-1]
    assert notes.with_question(f"What was on the {newest} slide?") == f"What was on the {newest} slide?"


def test_a_question_about_the_slide_before_another_gets_that_one() -> None:
    _, notes, _, _ = talk(len(TOPICS))
    prompt = notes.with_question("What was on the slide before the budget?")  # shares no word with it
    assert prompt.startswith(note_line(notes.notes[0]) + "\n\n")
    assert "Budget" not in prompt.split("\n\n")[0]  # the anchor itself is not what was asked about
    after = notes.with_question("And the one after the roadmap?")
    assert after.startswith(note_line(notes.notes[4]))
    assert notes.with_question("What did the first slide say?").startswith(note_line(notes.notes[0]))


def test_the_instructions_are_not_searched_and_the_selection_is_bounded() -> None:
    _, notes, _, _ = talk(len(TOPICS))
    question = Question("What was said about pricing?", 0.0, 0.0, instructions="Mind the hiring and budget slides.")
    prompt = notes.with_question(question.prompt(question.text or ""))
    assert notes.metrics()["last_selected"] == ["screen_4"]  # Pricing only, not what the instructions name
    assert prompt.endswith("Instructions: Mind the hiring and budget slides.")
    many = notes.with_question(" ".join(f"Owner {i}" for i in range(len(TOPICS))) + "?")
    given = many.split("\n\n")[0].splitlines()
    assert len(given) > 1 and sum(count(line) + 1 for line in given) <= 60  # selected_tokens


def test_a_newest_screen_larger_than_the_budget_is_cut_and_still_selectable() -> None:
    conversation = Conversation()
    notes = ScreenNotes(conversation, max_tokens=40, selected_tokens=200, count=count)
    long = ["Glossary"] + [f"term{i} means thing{i}" for i in range(20)]
    notes.publish("screen_0", 1.0, 9.0, long)
    assert screen_tokens(conversation) <= 40 and notes.notes[0].level == "cut"
    assert screen_lines(conversation)[0].split("On screen: ")[1].startswith("Glossary | term0 means thing0")
    assert "term19 means thing19" in notes.with_question("What does term19 mean?")


def test_selection_rules() -> None:
    class S:
        def __init__(self, text: str) -> None:
            self.full = text

    screens = [S("Welcome | Maria Chen"), S("Budget | 4.2 million"), S("Hiring | Lisbon office"),
               S("Roadmap | plan for May"), S("Pricing | plan for 9 dollars")]
    assert relation("What was on the slide before the chart?") == ("before", ["chart"])
    assert relation("what came after the hiring slide") == ("after", ["hiring"])
    assert pick("Who presented?", screens) == []  # no shared word: nothing
    assert pick("Which city has the new office?", screens) == [2]
    assert pick("What was on the slide before the chart?", screens) == []  # no screen holds the anchor
    assert pick("What was the previous slide?", screens) == [3]  # before the newest
    assert pick("What came after the budget?", screens) == [2]
    assert pick("What was the plan?", screens) == [4, 3]  # shared equally: the newer first
    assert pick("What was the total budget, 4.2 million?", screens)[:1] == [1]


def test_the_answerer_gets_the_selected_screens_with_the_question() -> None:
    conversation, notes, _, _ = talk(len(TOPICS))

    class Recorder:
        def __init__(self) -> None:
            self.requests: list[AnswerRequest] = []

        async def start(self, request: AnswerRequest) -> object:
            self.requests.append(request)
            return object()

    inner = Recorder()
    request = AnswerRequest(conversation.context(), "Who owns the hiring slide?")
    asyncio.run(NotesWithQuestion(inner, notes).start(request))  # type: ignore[arg-type]
    sent = inner.requests[0]
    assert sent.context == request.context  # the prefilled context is what it was
    assert sent.question == note_line(notes.notes[2]) + "\n\nWho owns the hiring slide?"


def test_token_count_uses_the_tokenizer_when_there_is_one() -> None:
    class Tokenizer:
        def __call__(self, text: str, *, add_special_tokens: bool) -> dict[str, list[int]]:
            assert not add_special_tokens
            return {"input_ids": list(range(len(text)))}  # a token a character

    assert token_counter(Tokenizer())("abc de") == 6  # type: ignore[arg-type]
    assert token_counter(None)("one two three") == 4  # ceil(3 * 1.3)
