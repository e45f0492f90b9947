"""The answer's text, cut into clauses a voice can speak while the model is still writing the rest.

Why clauses: a VITS voice speaks a whole utterance per call, with the prosody of that utterance, so it cannot
start on half a word; waiting for the whole answer would put the language model's entire decode time before the
first sound. A clause is the smallest piece that still sounds natural on its own. The first clause is cut early
(at any comma; else at the first word from the `first_min_words`-th (3) on that can end a phrase, not "the", "to",
"is"...; at the latest after `first_max_words` (6)) because the time until it is complete, and its synthesis, are
the latency a user hears: `runtime bench voice` measured voice-to-voice p50 at 1.58-1.79 s with a 6-word first
clause and 1.27-1.37 s with 3 words (SmolLM2-135M answering, 2 loaded cores; docs/model_card_piper_joe.md). Later
clauses are longer (a comma cuts only past `min_words` words) because by then
the voice is busy speaking and fewer, longer calls sound better.

Streaming equals offline: every rule decides a cut at a word's end from the text up to and including the
whitespace that follows that word, never from anything later. So `ClauseSplitter` fed the deltas however they
were cut gives exactly `split_clauses` of the whole text; the tests check this for many random cuttings.

The rules, from the start of the current clause:
- a word ending in `.`, `!`, `?` or `…` (closing quotes and brackets may follow) ends a sentence and the
  clause, unless it is a known abbreviation ("Dr.", "e.g."), holds an inner period ("U.S."), or is a number
  opening the clause (a list's "1.");
- a word ending in `,`, `;`, `:` or a dash cuts the first clause at once, a later one past `min_words` words;
- a line break cuts (list items, paragraphs);
- the first clause is cut after a word at or past `first_min_words` words that is not in `FUNCTION_WORDS`, so it
  breaks where a speaker might ("The train to Boston | leaves ...");
- past `max_words` words (`first_max_words` for the first clause) a clause is cut at the next word's end.
Each clause comes out with its whitespace collapsed, so `" ".join(clauses)` is the text's words in order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

SENTENCE_END = (".", "!", "?", "…")
CLAUSE_END = (",", ";", ":", "—", "–", "--")
CLOSERS = "\"')]}”’»"
ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "jr", "sr", "fig", "approx",
                           "inc", "ltd", "dept", "est", "min", "max", "cf"})


# Words a phrase does not end on (articles, prepositions, conjunctions, auxiliaries, pronouns, determiners): the
# first clause is not cut after one of them, so its prosody breaks where a speaker might pause ("The train to Boston
# | leaves ...", not "The train to | Boston ...").
_FUNCTION_WORDS_BY_KIND = (
    "a an the this that these those my your his her its our their some any no every each",  # determiners
    "to of in on at for from with by about into onto over after before under between through during as than like",
    "and or but nor so yet if because while when where which who whom whose what how",  # conjunctions, wh-words
    "i you he she it we they me him us them",  # pronouns
    "is are was were be been being am has have had do does did will would can could shall should may might must",
    "not very just also there here",
)
FUNCTION_WORDS = frozenset(word for kind in _FUNCTION_WORDS_BY_KIND for word in kind.split())


@dataclass(frozen=True)
class ClauseRules:
    first_min_words: int = 3  # the first clause ends at the first word from here on that ends a phrase...
    first_max_words: int = 6  # ...and here whatever the word: about 0.4 s of decode at 20 tokens/s
    min_words: int = 4  # a later clause is cut at a comma only past this many words
    max_words: int = 24  # a later clause without any punctuation

    def __post_init__(self) -> None:
        if min(self.first_min_words, self.first_max_words, self.min_words, self.max_words) < 1:
            raise ValueError(f"clause word counts must be >= 1, got {self}")


def _ends_sentence(word: str, words_before: int) -> bool:
    core = word.rstrip(CLOSERS)
    if not core.endswith(SENTENCE_END):
        return False
    if not core.endswith(".") or core.endswith(".."):
        return True  # ! ? … and an ellipsis always end a sentence
    stem = core[:-1]
    if stem.lower() in ABBREVIATIONS or "." in stem:  # "Dr.", "e.g.", "U.S."
        return False
    return not (stem.isdigit() and words_before == 0)  # "1." opening a list item


def _ends_clause(word: str) -> bool:
    return word.rstrip(CLOSERS).endswith(CLAUSE_END)


def _next_cut(text: str, first: bool, rules: ClauseRules) -> int | None:
    """The end (exclusive) of the clause `text` starts with, if the text so far decides it: a position where a
    word ends and whitespace follows. None: the clause may still go on."""
    words = 0
    start = None  # the current word's start
    for i, ch in enumerate(text):
        if not ch.isspace():
            if start is None:
                start = i
            continue
        if start is None:  # whitespace after whitespace: only a line break matters
            if ch == "\n" and words:
                return i
            continue
        word = text[start:i]
        start = None
        if _ends_sentence(word, words):
            return i
        words += 1
        if ch == "\n":
            return i
        if _ends_clause(word) and (first or words >= rules.min_words):
            return i
        if words >= (rules.first_max_words if first else rules.max_words):
            return i
        if first and words >= rules.first_min_words and _ends_phrase(word):
            return i
    return None


def _ends_phrase(word: str) -> bool:
    return word.strip(CLOSERS + "\"'(").lower() not in FUNCTION_WORDS


def _tidy(text: str) -> str:
    return " ".join(text.split())


class ClauseSplitter:
    """Feed it the answer's text deltas as they arrive; it yields each clause as soon as the text decides it.

    `push(delta)` returns the clauses that delta completed (often none); `finish()` returns the rest at the end
    of the answer. Pure string work, microseconds a delta: it runs on the event loop.
    """

    def __init__(self, rules: ClauseRules | None = None) -> None:
        self.rules = rules or ClauseRules()
        self._pending = ""  # text not yet cut: at most one clause's worth, rescanned per delta
        self.clauses_out = 0

    def push(self, delta: str) -> list[str]:
        self._pending += delta
        return list(self._cuts())

    def finish(self) -> list[str]:
        """The clauses still held, the last one ended by the end of the text."""
        out = list(self._cuts())
        rest = _tidy(self._pending)
        self._pending = ""
        if rest:
            self.clauses_out += 1
            out.append(rest)
        return out

    def _cuts(self) -> Iterator[str]:
        while True:
            cut = _next_cut(self._pending, self.clauses_out == 0, self.rules)
            if cut is None:
                return
            clause = _tidy(self._pending[:cut])
            self._pending = self._pending[cut:].lstrip()
            if clause:
                self.clauses_out += 1
                yield clause


def split_clauses(text: str, rules: ClauseRules | None = None) -> list[str]:
    """The offline split of a whole text: what `ClauseSplitter` yields fed all of it at once."""
    splitter = ClauseSplitter(rules)
    return [*splitter.push(text), *splitter.finish()]


_EMPHASIS = re.compile(r"(\*{1,3}|_{2,3}|`+)(\S(?:.*?\S)?)\1")  # a pair of marks around words
_HEADING = re.compile(r"^\s*#{1,6}\s+")
_BULLET = re.compile(r"^\s*[-*+•]\s+")


def speakable(text: str) -> str:
    """`text` without the markdown marks a voice would read aloud ("asterisk", "hash"): pairs of emphasis marks
    and code ticks, a heading's hashes, a list's bullet. Words, punctuation and a lone `*` (3 * 4) stay."""
    text = _BULLET.sub("", _HEADING.sub("", text))
    return _tidy(_EMPHASIS.sub(r"\2", text))
