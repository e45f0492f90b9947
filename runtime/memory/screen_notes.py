"""Screen notes: what was on screen, kept in the conversation within a token budget that stays constant however
long the stream, with the full text of older screens given back to the question that points at them.

Each screen is one "On screen" item in the conversation (the context the language model prefills as it
streams). While the screens' lines fit `max_tokens`, every screen stays whole. Once over, older screens are
consolidated in one batch, oldest first, until they fill at most half the budget:

    whole  ->  title (its first line, "…")  ->  index (one line for all dropped screens: how many, since when)

The newest screen stays whole (cut to the budget only if it alone is larger). A batch frees half the budget, so
consolidation runs at most once per half-budget of new screen text rather than on every screen: each batch
rewrites older lines, which cuts the prefilled KV back to the first rewritten line and re-prefills what follows
(`recut_tokens` estimates those tokens; the engine re-prefills at most its window of them).

At question time `with_question` picks the screens the question points at (`screen_selection.pick`: shared
words, "before"/"after"/"first"/"last"), and gives those not already whole in the context with the question,
as the context writes them, within `selected_tokens`; a question about the screen that points at none ("what is
on the slide?", `screen_questions.py`) gets the latest screen, even whole in the context. The question is the one
part of the prompt prefilled per answer, so the context and its prefilled KV stay as they are. A talk under budget
changes nothing else.

Everything here runs on the event loop (publishing and answering both do), on strings copied from the screen
reader's screens, which the worker may be merging meanwhile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from runtime.events import new_id
from runtime.memory.conversation import Conversation, Item
from runtime.memory.screen_questions import asks_about_screen
from runtime.memory.screen_selection import pick

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokenCount = Callable[[str], int]
Level = Literal["whole", "cut", "title", "index"]
LOW_WATER = 0.5  # a consolidation brings the screens down to this share of the budget
INSTRUCTIONS = "\n\nInstructions: "  # how `Question.prompt` (pipeline/questions.py) appends instructions
INDEX_ID = "screen_index"
LABEL = "On screen"


def token_counter(tokenizer: PreTrainedTokenizerBase | None) -> TokenCount:
    """Tokens of a text as the answerer counts them; without a tokenizer (a remote server's), words * 1.3."""
    if tokenizer is None:
        return lambda text: math.ceil(len(text.split()) * 1.3)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Note:
    """One screen's text (copied at publishing), its level in the context, and its item there (None: indexed)."""

    screen_id: str
    start: float
    end: float
    lines: list[str]
    item: Item | None
    level: Level = "whole"
    tokens: int = 0  # of its line in the context (0 once indexed)

    @property
    def full(self) -> str:
        return " | ".join(self.lines)

    @property
    def whole_in_context(self) -> bool:
        return self.level == "whole"


@dataclass
class NotesStats:
    consolidations: int = 0  # batches that rewrote older lines
    recut_tokens: int = 0  # context tokens from each batch's first rewritten line to the end, summed
    selected: int = 0  # screens given with questions
    selected_tokens: int = 0
    last_selected: list[str] = field(default_factory=list)  # screen ids the latest question was given


class ScreenNotes:
    def __init__(self, conversation: Conversation, *, max_tokens: int, selected_tokens: int, count: TokenCount,
                 keep: int = 64) -> None:
        """`max_tokens`: the screens' budget in the context (0: no budget, every screen whole); `keep`: screens
        remembered for selection (their text only, a few hundred bytes each)."""
        self.conversation, self.max_tokens, self.selected_budget = conversation, max_tokens, selected_tokens
        self.count, self.keep = count, keep
        self.notes: list[Note] = []
        # the runtime's own items get ids no client can guess, so no client item collides with them
        self.index = Item(new_id(INDEX_ID), 0.0, 0.0, role="system", audio=False, label=LABEL, in_api=False)
        self.indexed = 0  # screens dropped into the index, ever
        self.indexed_since = 0.0
        self._indexing = False  # the index line is in the conversation
        self.stats = NotesStats()

    # -- the context ----------------------------------------------------------------------------------------

    @property
    def context_tokens(self) -> int:
        """Tokens of the screens' lines in the context now (the index line included)."""
        return sum(n.tokens for n in self.notes) + (self._tokens(self.index) if self._indexing else 0)

    def publish(self, screen_id: str, start: float, end: float, lines: list[str]) -> None:
        """A screen opened or changed: its item in the context is written (whole), then the budget is kept."""
        note = next((n for n in reversed(self.notes) if n.screen_id == screen_id), None)
        if note is None:
            item = Item(new_id(screen_id), start, end, role="system", audio=False, label=LABEL, in_api=False)
            self.conversation.add_in_time(item)
            note = Note(screen_id, start, end, list(lines), item)
            self.notes.append(note)
        note.end, note.lines = end, list(lines)
        if note.item is not None:
            note.item.end = end
            self._write(note, "whole")
        self._keep_budget()
        self._forget()

    def _keep_budget(self) -> None:
        if not self.max_tokens or self.context_tokens <= self.max_tokens:
            return
        goal = self.max_tokens * LOW_WATER
        live = [n for n in self.notes if n.item is not None]
        if not live:  # (a client deleted the items)
            return
        older, newest = live[:-1], live[-1]
        where = {id(it): i for i, it in enumerate(self.conversation.items)}
        changed: list[Item] = []  # the items rewritten or taken out
        for note in older:  # whole -> title, oldest first
            if self.context_tokens <= goal:
                break
            if note.level in ("whole", "cut") and len(note.lines) > 1 and note.item is not None:
                changed.append(note.item)
                self._write(note, "title")
        dropped = []
        for note in older:  # title -> index, oldest first
            if self.context_tokens - sum(n.tokens for n in dropped) <= goal:
                break
            dropped.append(note)
        if dropped:
            changed += [n.item for n in dropped if n.item is not None]
            if self._indexing:
                changed.append(self.index)
            self._drop(dropped)
        if self.context_tokens > self.max_tokens and newest.item is not None:  # the newest alone is too long
            self._write(newest, "cut")
        if changed:  # older lines were rewritten: the KV is cut back to the first of them
            self.stats.consolidations += 1
            self.stats.recut_tokens += self._tokens_from(min(where.get(id(it), len(where)) for it in changed))

    def _write(self, note: Note, level: Level) -> None:
        """Set the note's item text for `level` and count it."""
        assert note.item is not None
        if level == "title":
            text = f"{note.lines[0]} …" if len(note.lines) > 1 else note.full
        elif level == "cut":
            text = self._cut(note)
        else:
            text = note.full
        note.level, note.item.stable = level, text
        note.tokens = self._tokens(note.item)

    def _cut(self, note: Note) -> str:
        """The newest screen's first lines, as many as fit the budget beside the rest (at least its title)."""
        assert note.item is not None
        room = self.max_tokens - (self.context_tokens - note.tokens)
        lines = note.lines[:1]
        for line in note.lines[1:]:
            note.item.stable = " | ".join([*lines, line]) + " …"
            if self._tokens(note.item) > room:
                break
            lines.append(line)
        return " | ".join(lines) + " …"

    def _drop(self, dropped: list[Note]) -> None:
        """Take the dropped screens' items out; the index line stands where the newest of them stood."""
        items = self.conversation.items
        leaving = {id(n.item) for n in dropped} | {id(self.index)}
        at = next((i for i, it in enumerate(items) if it is dropped[-1].item), len(items))
        before = next((it.item_id for it in reversed(items[:at]) if id(it) not in leaving), "root")
        if self._indexing:
            self.conversation.delete(self.index.item_id)
        for note in dropped:
            assert note.item is not None
            self.conversation.delete(note.item.item_id)  # (False if a client deleted it already)
            note.item, note.level, note.tokens = None, "index", 0
        if not self.indexed:
            self.indexed_since = dropped[0].start
        self.indexed += len(dropped)
        last = dropped[-1]
        self.index.start, self.index.end = last.start, last.end
        self.index.stable = (f"{self.indexed} earlier screen{'s' if self.indexed > 1 else ''} "
                             f"({_stamp(self.indexed_since)} to {_stamp(last.end)}) left out")
        self.conversation.add(self.index, after=before)
        self._indexing = True

    def _forget(self) -> None:
        """Notes past `keep` are forgotten, indexed ones (the index still counts them); without a budget any
        (their items stay in the context)."""
        while len(self.notes) > self.keep and (self.notes[0].item is None or not self.max_tokens):
            self.notes.pop(0)

    def _tokens(self, item: Item) -> int:
        return self.count(item.line()) + 1  # + its newline

    def _tokens_from(self, position: int) -> int:
        """Context tokens from the item at `position` (where the first change was) to the end, estimated (words
        * 1.3): only a metric, and tokenizing a long talk's tail at every batch would hold the event loop."""
        return sum(math.ceil(len(it.line().split()) * 1.3) + 1 for it in self.conversation.items[position:]
                   if self.conversation.shows(it))

    # -- the question ---------------------------------------------------------------------------------------

    def shown(self) -> list[str]:
        """Every screen kept, whole, however the context holds it now (what `lm.grounded` checks against)."""
        return [note.full for note in self.notes]

    def select(self, question: str) -> list[Note]:
        """The screens `question` points at that the context does not hold whole, in time order, as many as fit
        `selected_tokens`. A question about the screen that points at none ("what does the slide say?") gets the
        latest screen, whole in the context or not: asked 4 s into the next slide of a two-slide talk, SmolLM2-135M
        read the first slide's lines back from the context alone, and the current slide's given it here."""
        chosen: list[Note] = []
        room = self.selected_budget
        picked = pick(question, self.notes)
        current = not picked and bool(self.notes) and asks_about_screen(question)
        for i in [len(self.notes) - 1] if current else picked:
            note = self.notes[i]
            if note.whole_in_context and not current:
                continue
            need = self.count(note_line(note)) + 1
            if need <= room:
                chosen.append(note)
                room -= need
        return sorted(chosen, key=lambda n: n.start)

    def with_question(self, prompt: str) -> str:
        """The question's text with the screens it points at before it (their lines as the context writes
        them); the instructions `Question.prompt` appends are not searched."""
        chosen = self.select(prompt.split(INSTRUCTIONS, 1)[0])
        self.stats.last_selected = [n.screen_id for n in chosen]
        if not chosen:
            return prompt
        lines = [note_line(n) for n in chosen]
        self.stats.selected += len(chosen)
        self.stats.selected_tokens += sum(self.count(line) + 1 for line in lines)
        return "\n".join(lines) + "\n\n" + prompt

    def metrics(self) -> dict[str, Any]:
        """`runtime.metrics.screen`'s notes part: the budget and what fills it, consolidation's cost, and what
        questions were given."""
        levels = [n.level for n in self.notes]
        return {"context_tokens": self.context_tokens, "budget_tokens": self.max_tokens,
                "whole": levels.count("whole"), "titles": levels.count("title") + levels.count("cut"),
                "indexed": self.indexed, "consolidations": self.stats.consolidations,
                "recut_tokens": self.stats.recut_tokens, "selected": self.stats.selected,
                "selected_tokens": self.stats.selected_tokens, "last_selected": list(self.stats.last_selected)}


def note_line(note: Note) -> str:
    """A screen's whole text as the context writes an "On screen" line."""
    return Item(note.screen_id, note.start, note.end, role="system", audio=False, label=LABEL,
                stable=note.full, in_api=False).line()


def _stamp(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes):02d}:{secs:02.0f}"
