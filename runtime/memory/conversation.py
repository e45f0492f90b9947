"""The conversation so far: what every answer reads, in the order it happened.

A session's conversation is the OpenAI Realtime API's: an ordered list of items. User audio items are the
transcript (one item per input audio buffer: a commit, by hand or by turn detection, ends one), user and system
text items come from `conversation.item.create`, and assistant items are the answers. The open audio item has
stable text and an unstable tail that the ASR may still revise; the context shows all of it, so an answer
asked mid-sentence sees the words already heard.

The context is one line per item with its media time: spoken words as they were heard, everything else
labelled with its role, in media-time order. New items land at the end, or before the last lines when the ASR
or the screen reader was behind (`_in_time`), so the context grows near its end and the language model's KV
(prefilled as it streams) stays valid up to there. The open audio item's line is shown after the screen lines read
while it is spoken, so its new words append; its completion (the final pass's words, in its media-time place) or a
line landing before it cuts the KV back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from runtime.memory.spoken import SpokenTrack
from runtime.models.asr.base import TranscriptUpdate

Role = Literal["user", "assistant", "system"]
ItemType = Literal["message", "function_call", "function_call_output"]
_LABEL = {"user": "User", "assistant": "Assistant", "system": "System"}


@dataclass
class Item:
    item_id: str
    start: float  # media seconds
    end: float
    role: Role = "user"
    audio: bool = True  # spoken (transcribed) rather than typed
    stable: str = ""
    unstable: str = ""
    completed: bool = False  # audio: the transcript is final; assistant: the answer ended
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    label: str = ""  # the context's label instead of the role's ("On screen": text read off the video)
    in_api: bool = True  # False: the runtime's own (a screen's text), in the context but not the API's conversation
    # function calling: a `function_call` (the model's; `stable` holds its JSON arguments) or a
    # `function_call_output` (the client's; `stable` holds the output), tied by `call_id`
    type: ItemType = "message"
    call_id: str = ""
    name: str = ""  # the function a call calls (an output's too: the call it answers names it)
    question: bool = False  # a question the runtime recorded (a script's, the terminal's): asks, tells nothing
    spoken: SpokenTrack | None = None  # an answer given aloud (`output_audio`): its audio, for truncation

    @property
    def text(self) -> str:
        return (self.stable + self.unstable).strip()

    @property
    def open_audio(self) -> bool:
        """A spoken item still being transcribed."""
        return self.audio and not self.completed and self.role == "user"

    @property
    def is_call(self) -> bool:
        return self.type != "message"

    def line(self) -> str:
        if self.type == "function_call":
            return f"[{_stamp(self.start)}] Assistant called {self.name}({self.text})"
        if self.type == "function_call_output":
            return f"[{_stamp(self.start)}] Function {self.name or self.call_id} returned: {self.text}"
        label = "" if self.audio else f"{self.label or _LABEL[self.role]}: "
        return f"[{_stamp(self.start)}] {label}{self.text}"

    def to_api(self) -> dict[str, Any]:
        """The item as the Realtime API's `conversation.item.*` events carry it (no audio bytes)."""
        common = {"id": self.item_id, "object": "realtime.item", "type": self.type, "status": self.status,
                  "call_id": self.call_id}
        if self.type == "function_call":
            return {**common, "name": self.name, "arguments": self.stable}
        if self.type == "function_call_output":
            return {**common, "output": self.stable}
        if self.audio:
            part: dict[str, Any] = {"type": "input_audio", "transcript": self.text if self.completed else None}
        elif self.role == "assistant" and self.spoken is not None:
            part = {"type": "output_audio", "transcript": self.text}
        elif self.role == "assistant":
            part = {"type": "output_text", "text": self.text}
        else:
            part = {"type": "input_text", "text": self.text}
        return {"id": self.item_id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": [part]}


def _stamp(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes):02d}:{secs:04.1f}"


@dataclass
class Conversation:
    items: list[Item] = field(default_factory=list)
    # whether the context shows the assistant's own answers (`lm.answers_in_context`): a small model reading them
    # copies them into answers to other questions; without them, a follow-up about an answer ("why?") loses it
    answers_in_context: bool = True

    def apply(self, update: TranscriptUpdate) -> Item:
        """A transcript update of a user audio item (the open one, or a new one, placed by its start)."""
        item = self.get(update.item_id)
        if item is None:
            item = Item(update.item_id, update.start, update.end, status="in_progress")
            self.add_spoken(item)
        item.end = update.end
        if update.completed:
            item.stable, item.unstable, item.completed, item.status = update.transcript, "", True, "completed"
        else:
            item.stable += update.delta
            item.unstable = update.unstable
        return item

    def as_if_completed(self, item_id: str, transcript: str) -> Conversation:
        """This conversation were spoken item `item_id` completed now with `transcript`: a copy that shares every
        other item (read it, never change it); unchanged when there is no such open item."""
        items = [replace(it, stable=transcript, unstable="", completed=True, status="completed")
                 if it.item_id == item_id and it.open_audio else it for it in self.items]
        return Conversation(items, answers_in_context=self.answers_in_context)

    def add(self, item: Item, *, after: str | None = None) -> str | None:
        """Insert `item` after the item `after` (None: at the end; "root": first, as the API says); returns the
        id of the item before it. Raises KeyError for an unknown `after`."""
        if after is None:
            index = len(self.items)
        elif after == "root":
            index = 0
        else:
            index = next((i + 1 for i, it in enumerate(self.items) if it.item_id == after), None)
            if index is None:
                raise KeyError(after)
        self.items.insert(index, item)
        return self._api_before(index)

    def add_spoken(self, item: Item) -> None:
        """Add a new user audio item where its start puts it: before the runtime's own lines at the end that
        started after it (client-visible items keep their order)."""
        self.items.insert(self._in_time(item.start, movable=lambda it: not it.in_api), item)

    def restamp(self, item: Item, start: float) -> None:
        """Its words began at `start`, later than it was stamped: it moves past the runtime's own lines right after
        it that started before that (client-visible items keep their order)."""
        assert start >= item.start, "a restamp only moves an item later"
        item.start = start
        at = self.items.index(item)
        while at + 1 < len(self.items) and not self.items[at + 1].in_api and self.items[at + 1].start < start:
            self.items[at], self.items[at + 1] = self.items[at + 1], item
            at += 1

    def add_in_time(self, item: Item) -> None:
        """Add the runtime's own `item` (a screen's text) where its media time puts it: before the items at the end
        that started after it. Clients never see it, so no API order changes."""
        self.items.insert(self._in_time(item.start, movable=lambda it: True), item)

    def _in_time(self, start: float, movable: Callable[[Item], bool]) -> int:
        """Where an item that started at `start` goes: before the run of `movable` items at the end that started
        after it. The context is then in media-time order whichever of the ASR and the screen reader was behind
        (a file played unpaced runs ahead of one; a live stream keeps both near the present). Only lines since
        the lagging one's time move, so the prefilled KV is cut back by about that lag's lines (bounded: the audio
        channel blocks its producer when full, and the screen reader reads one frame at a time)."""
        index = len(self.items)
        while index > 0 and movable(self.items[index - 1]) and self.items[index - 1].start > start:
            index -= 1
        return index

    def get(self, item_id: str) -> Item | None:
        return next((it for it in reversed(self.items) if it.item_id == item_id), None)

    def api_item(self, item_id: str) -> Item | None:
        """An item a client may address (the runtime's own, such as a screen's text, are not among them)."""
        item = self.get(item_id)
        return item if item is not None and item.in_api else None

    def previous_id(self, item_id: str) -> str | None:
        """The id of the API item before `item_id` (the runtime's own items are skipped: clients never saw them)."""
        ids = [it.item_id for it in self.items]
        return self._api_before(ids.index(item_id) if item_id in ids else 0)

    def line_before(self, item_id: str) -> str | None:
        """What `add(..., after=)` takes to put an item right before `item_id` in the context: the id of the item
        just before it, the runtime's own included ("root": it is the first; None, the end: no such item)."""
        ids = [it.item_id for it in self.items]
        if item_id not in ids:
            return None
        at = ids.index(item_id)
        return ids[at - 1] if at > 0 else "root"

    def _api_before(self, index: int) -> str | None:
        return next((it.item_id for it in reversed(self.items[:index]) if it.in_api), None)

    def delete(self, item_id: str) -> bool:
        item = self.get(item_id)
        if item is None:
            return False
        self.items.remove(item)
        return True

    def pending_user_text(self) -> str:
        """What a response answers by default: the user's typed items since the last answer, back to and
        including the latest spoken one (earlier speech, say an hour of captioned talk, is context, not the
        question)."""
        return " ".join(it.text for it in self.pending_user_items())

    def pending_user_items(self) -> list[Item]:
        """The items `pending_user_text` reads, in order."""
        pending: list[Item] = []
        calls = False
        for item in reversed(self.items):
            if item.is_call:  # a call and its output belong to the exchange the user's message opened
                calls = True
                continue
            if item.role == "assistant":
                if calls and not pending:  # what the calling response said beside its calls: the same exchange
                    continue
                break
            if item.role == "user" and item.text:
                pending.append(item)
                if item.audio:
                    break
        return pending[::-1]

    def calls_since_user(self) -> list[Item]:
        """The exchange a response continues: the function calls made since the user's latest message (a
        complete one: a call cut short has no arguments to show), each followed by the outputs the client sent
        for it, wherever they landed (speech or a screen may come between a call and its output)."""
        user = max((i for i, it in enumerate(self.items) if it.role == "user" and not it.is_call and it.in_api
                    and it.text), default=-1)
        calls = [it for it in self.items[user + 1:] if it.type == "function_call" and it.status == "completed"]
        ids = {c.call_id for c in calls}
        outputs = [it for it in self.items if it.type == "function_call_output" and it.call_id in ids]
        return [it for c in calls for it in [c, *(o for o in outputs if o.call_id == c.call_id)]]

    def call_name(self, call_id: str) -> str | None:
        """The function a `call_id` called, or None when no call of this conversation has that id."""
        return next((it.name for it in self.items if it.type == "function_call" and it.call_id == call_id), None)

    def context(self, without: frozenset[str] = frozenset()) -> str:
        """One line per item: `[mm:ss.s] text` (spoken) or `[mm:ss.s] Role: text`, in order; empty items and the
        items named in `without` left out, and the assistant's messages unless `answers_in_context` (its function
        calls stay: their outputs need them).

        An open audio item is shown after the screen lines that follow it (up to the next client-visible item):
        while a turn is spoken its line grows, and a slide read meanwhile would otherwise be prefilled again after
        every word (2.5x the context's tokens on the video-qa talk). When the turn completes it takes its media-time
        place."""
        lines: list[str] = []
        being_said: list[Item] = []  # open audio items, held after the runtime's own lines that follow them
        for it in self.items:
            if it.item_id in without or not self.shows(it):
                continue
            if it.open_audio:
                being_said.append(it)
                continue
            if it.in_api:
                lines.extend(held.line() for held in being_said)
                being_said.clear()
            lines.append(it.line())
        lines.extend(held.line() for held in being_said)
        return "\n".join(lines)

    def shows(self, item: Item) -> bool:
        """Whether the context has a line for `item`."""
        return bool(item.text) and (self.answers_in_context or item.role != "assistant" or item.is_call)

    def final_text(self) -> str:
        """The spoken words alone, as a transcript."""
        return " ".join(it.text for it in self.items if it.audio and it.text)
