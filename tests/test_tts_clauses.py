"""The clause splitter (runtime/models/tts/clauses.py): streamed deltas, however cut, give the offline split of the
whole text; the first clause is short; no word is lost, reordered or spoken as markdown."""

from __future__ import annotations

import random
import zlib

import pytest

from runtime.models.tts.clauses import ClauseRules, ClauseSplitter, speakable, split_clauses

ANSWERS = [
    "Yes, the meeting moved to Thursday at three o'clock. Please bring the slides, and the budget numbers for the "
    "second quarter.",
    "The answer is 42 and it was computed by a very large machine over many years without stopping once, which "
    "is longer than anyone expected it to take at the time.",
    'Dr. Smith said "stop." Then he left, e.g. at 3.5 pm in the U.S. today! Really? Well... maybe not.',
    "Here is the plan:\n1. First item\n2. Second item\n\n- a bullet\n- another one\nDone.",
    "No.",
    "   spaces   everywhere ,  and\ttabs\n\n\n too ",
    "Short answer (in brackets.) And a quote: \u201cthat is all.\u201d The end",
    "word " * 80,
    "",
]


def _stream(text: str, cuts: list[int], rules: ClauseRules | None = None) -> list[str]:
    splitter = ClauseSplitter(rules)
    out: list[str] = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        out += splitter.push(text[start:end])
    return out + splitter.finish()


@pytest.mark.parametrize("text", ANSWERS)
def test_streamed_deltas_give_the_offline_split(text: str) -> None:
    offline = split_clauses(text)
    rng = random.Random(zlib.crc32(text.encode()))
    assert _stream(text, list(range(1, len(text)))) == offline  # one character at a time
    for _ in range(30):  # token-like deltas of 1-12 characters, cut anywhere (inside words, inside "...")
        cuts, at = [], 0
        while (at := at + rng.randint(1, 12)) < len(text):
            cuts.append(at)
        assert _stream(text, cuts) == offline
    assert _stream(text, []) == offline


@pytest.mark.parametrize("text", ANSWERS)
def test_no_word_is_lost_or_reordered(text: str) -> None:
    clauses = split_clauses(text)
    assert " ".join(clauses) == " ".join(text.split())
    assert all(c and c == c.strip() and "\n" not in c for c in clauses)


def test_where_it_cuts() -> None:
    assert split_clauses(ANSWERS[0]) == [
        "Yes,", "the meeting moved to Thursday at three o'clock.", "Please bring the slides,",
        "and the budget numbers for the second quarter."]
    # abbreviations, inner periods and decimals do not end a sentence; ! ? and an ellipsis do
    assert split_clauses(ANSWERS[2]) == [
        "Dr. Smith said", '"stop."', "Then he left, e.g. at 3.5 pm in the U.S. today!", "Really?", "Well...",
        "maybe not."]
    # a list's numbers stay with their item; line breaks cut
    assert split_clauses(ANSWERS[3]) == ["Here is the plan:", "1. First item", "2. Second item", "- a bullet",
                                         "- another one", "Done."]


def test_the_first_clause_is_short_and_later_ones_longer() -> None:
    rules = ClauseRules()
    clauses = split_clauses(ANSWERS[7], rules)  # no punctuation at all
    assert len(clauses[0].split()) == rules.first_min_words  # "word" can end a phrase
    assert all(len(c.split()) == rules.max_words for c in clauses[1:-1])
    # past first_min_words the first clause waits for a word that ends a phrase, at most first_max_words
    assert split_clauses("The train to Boston leaves from platform four.") == [
        "The train to Boston", "leaves from platform four."]
    assert split_clauses("It is in the blue folder.")[0] == "It is in the blue"
    assert split_clauses("And then it is in the middle of it")[0] == "And then it is in the"  # the cap
    # a comma cuts the first clause at once, a later one only past min_words words
    assert split_clauses("Well, I think, maybe, we could go, later on today, if you want.") == [
        "Well,", "I think, maybe, we could go,", "later on today, if you want."]


def test_the_first_clause_arrives_before_the_answer_is_written() -> None:
    splitter = ClauseSplitter()
    assert splitter.push("Sure") == [] and splitter.push(", here") == ["Sure,"]  # the comma decided by the space
    assert splitter.push(" it is: the report") == []
    assert splitter.push(" is on the shared drive. It") == ["here it is: the report is on the shared drive."]
    assert splitter.finish() == ["It"]


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        ClauseRules(first_max_words=0)
    with pytest.raises(ValueError, match=">= 1"):
        ClauseRules(first_min_words=0)


def test_markdown_is_not_read_aloud() -> None:
    assert speakable("**Bold** and _quiet_ and `code` and ***very***") == "Bold and _quiet_ and code and very"
    assert speakable("## A heading") == "A heading"
    assert speakable("- a bullet point") == "a bullet point"
    assert speakable("3 * 4 - 2 is ten, isn't it?") == "3 * 4 - 2 is ten, isn't it?"
