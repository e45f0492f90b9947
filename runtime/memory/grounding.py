"""Whether a question is about something nothing heard, shown or written in the session mentions yet.

A text-only answerer knows the stream only through the conversation. Asked about what none of it mentions ("when
is the public release?" while the budget slide is up), a small model guesses; a live assistant should say the
answer is not known yet (StreamingBench's questions of that kind are scored right only then). With `lm.grounded`
on, the question is checked before the model is asked: when none of its words occurs in what the session has
heard, shown or been told, the answer says so and the model is not asked.

One-sided on purpose: a single shared word sends the question to the model, so the check abstains only on a
question with nothing in the stream to stand on, and a doubt always goes to the model. The words compared are
those left once function words, question words, words about the medium and words of one or two letters are
dropped, each cut to a crude stem so that "hired" meets "hiring" and "cities" meets "city". A question whose
words are all about the stream as a whole ("what is happening?", "summarize the talk", "what is written on
screen?") always goes to the model, but for one about the screen (`screen_questions.py`) before the screen reader
has read any text: that is not known yet either. What is shown counts whole: a screen the context keeps only as its
title still vouches with every line it showed. (A session that does not read the screen at all says so instead:
`pipeline/answers.py`.)

It cannot tell a question about the stream from a general one ("what is the capital of France?" abstains too),
see a word the ASR misheard or OCR misread, or see what a picture shows without text: it is a setting for
text-only answerers of talks and meetings (`load_models` refuses it beside a vision-language model).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence

from runtime.memory.conversation import Conversation, Item
from runtime.memory.screen_selection import RELATIONS, STOP

# words that ask about the stream as a whole: a question of these alone is open, never abstained on
_OPEN_WORDS = """
happen going talk speaker speak spoke presenter present presentation lecture meeting video call discuss
discussion topic subject summary summarize summarise overview recap gist conclusion question main point far
everyone someone anyone person people mean think know explain describe see seen saw hear heard said say
give please again repeat detail thing anything something everything stuff
write written wrote writing display displayed visible appear appears current
hello hey thank thanks okay bye goodbye good morning afternoon evening great nice cool sorry sure welcome
day date time hour year month week name number place
"""
# (the last line: words that name the kind of answer asked for, "what day is it?" answered by "Thursday")
# how a question starts: a statement ("let me show the next slide") is never answered "not known yet"
_FILLERS = frozenset(("so", "and", "but", "okay", "ok", "well", "um", "uh", "then", "also", "now", "oh", "right"))
_ASKING = frozenset(("what", "when", "where", "who", "whom", "whose", "which", "why", "how", "is", "are", "was",
                     "were", "do", "does", "did", "can", "could", "will", "would", "should", "has", "have", "had"))
_WORD = re.compile(r"[a-z0-9]+(?:[.,:][0-9]+)*")
_SUFFIXES = ("ing", "ed", "er", "ly")
_VOWELS = frozenset("aeiouy")


@functools.lru_cache(maxsize=65536)  # a talk repeats its words: each is stemmed once per process
def stem(word: str) -> str:
    """A crude stem, the same for a word's common forms: "release", "released", "releasing" -> "releas";
    "plan", "planned" -> "plan"; "city", "cities" -> "city"; "early", "earlier" -> "early"; "engineer",
    "engineers" -> "engin". Numbers lose their thousands commas ("4,200" -> "4200") and stay whole otherwise."""
    if not word.isalpha():
        return word.replace(",", "") if re.fullmatch(r"[0-9]+(?:,[0-9]{3})+", word) else word
    if len(word) > 4 and word.endswith(("ies", "ied")):
        return word[:-3] + "y"
    if word.endswith("s") and len(word) > 3 and not word.endswith(("ss", "us", "is")):  # a plural, "-s" of a verb
        word = word[:-1]
    for suffix in _SUFFIXES:  # then one ending: "engineers" -> "engineer" -> "engine"
        rest = len(word) - len(suffix)
        if word.endswith(suffix) and rest >= (4 if suffix == "ly" else 3):
            word = word[:rest]
            break
    if word.endswith("e") and len(word) > 2:  # "release", "classe"
        word = word[:-1]
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in _VOWELS:  # "plann", "cutt", "class"
        word = word[:-1]
    return word[:-1] + "y" if word.endswith("i") else word  # "earli"


_OPEN = frozenset(stem(w) for w in _OPEN_WORDS.split())


def terms(text: str) -> list[tuple[str, str]]:
    """(the word as written, lower-case; its stem) for each word that can point at something: function words,
    question words, words about the medium, time words and words of one or two letters are left out."""
    out = []
    for word in _WORD.findall(text.lower()):
        if word in STOP or word in RELATIONS or (word.isalpha() and len(word) <= 2):
            continue
        key = stem(word)
        if key in STOP or key in RELATIONS:  # "does" as well as "do"
            continue
        out.append((word, key))
    return out


def is_question(text: str) -> bool:
    """Whether `text` asks: a sentence of it ends with "?" or starts with a question word, after any fillers
    ("so when is ..."; speech is often transcribed without its question mark)."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]
    return any(s.endswith("?") or _first_word(s) in _ASKING for s in sentences)


def _first_word(sentence: str) -> str:
    said = [w for w in re.split(r"[^a-z']+", sentence.lower()) if w]
    first = next((w for w in said if w not in _FILLERS), "")
    return first.split("'")[0]  # "what's"


def unheard(question: str, evidence: str) -> list[str]:
    """The question's words as written, in its order, when it asks (`is_question`), none of its words occurs in
    `evidence` and at least one asks about something specific (not only the stream as a whole); otherwise []
    (ask the model)."""
    if not is_question(question):
        return []
    asked = dict(terms(question))  # word -> stem, first occurrence first
    if all(key in _OPEN for key in asked.values()):
        return []
    known = {key for _, key in terms(evidence)}
    if any(key in known for key in asked.values()):
        return []
    return [word for word, key in asked.items() if key not in _OPEN]


def not_known_answer(words: list[str]) -> str:
    """The answer to a question `unheard` caught: that it is not known yet, and which words nothing mentions."""
    return f"Not known yet: nothing heard or shown so far mentions {' or '.join(words)}."


class Grounding:
    """What a grounded answer checks a question against: the conversation, and the whole text of every screen shown
    (`screens`: the screen notes', whose context lines of older screens are only titles or an index)."""

    def __init__(self, conversation: Conversation, screens: Callable[[], Iterable[str]] | None = None) -> None:
        self.conversation, self.screens = conversation, screens

    def evidence(self, question_items: Sequence[Item] = (), instructions: str = "") -> str:
        """Everything heard, shown or told: every item but the assistant's own (an earlier guess must not vouch
        for a later question) and the questions, this one's items and those the runtime recorded; the whole
        screens; and the instructions given with the question."""
        skip = {id(it) for it in question_items}
        said = [it.text for it in self.conversation.items
                if it.role != "assistant" and not it.question and id(it) not in skip and it.text]
        shown = list(self.screens()) if self.screens is not None else []
        return "\n".join([*said, *shown, instructions])

    def not_heard(self, question: str, question_items: Sequence[Item] = (), instructions: str = "") -> list[str]:
        """`unheard` against this session's evidence."""
        return unheard(question, self.evidence(question_items, instructions))

    def nothing_read_on_screen(self) -> bool:
        """Whether the session reads the screen (`screens` given) and has read no text on it yet: a question about
        the screen then has nothing to stand on, though its words are all about the medium (an open question)."""
        return self.screens is not None and not any(text.strip() for text in self.screens())
