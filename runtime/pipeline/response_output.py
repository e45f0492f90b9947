"""What one response says, as the Realtime API's items and events: a message, function calls, or both.

Why its own object: a response does not know what it will produce until the model says it (text, or a call's
arguments, from a remote server possibly several calls), so each output item is opened when its first piece
arrives (`output_item.added`, `conversation.item.added`, then the deltas) and all are closed together at the end
(`.done` events in order). The items go where the answer began, not where the conversation ends by the time the
first token comes: speech that started meanwhile is the next turn. A response that produced nothing still closes
with an empty message, as the API's does, so every response has an output item; except one that failed before
it said anything (`answers.py`), which adds nothing, so the user's turn stays the one to answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.events import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    ItemAdded,
    ItemDone,
    OutputItemAdded,
    OutputItemDone,
    ResponseTextDelta,
    ResponseTextDone,
    new_id,
)
from runtime.memory.conversation import Conversation, Item
from runtime.models.lm.answering import CallDelta
from runtime.pipeline import Emit


@dataclass(eq=False)
class ResponseOutput:
    response_id: str
    media_time: float
    in_conversation: bool
    conversation: Conversation
    emit: Emit
    # where the output goes: after the item that was last when the answer began (None: first). Items opened later
    # still land there, so a user turn that started while the model thought stays after the answer to the one before.
    anchor: str | None = None
    fallback: str | None = None  # the last API item when the answer began: where it goes if the anchor is gone
    items: list[Item] = field(default_factory=list)  # in output order
    message: Item | None = None
    calls: dict[int, Item] = field(default_factory=dict)  # by the model's call index
    parts: list[str] = field(default_factory=list)  # the message's text deltas

    @property
    def text(self) -> str:
        return "".join(self.parts)

    async def add_text(self, delta: str) -> None:
        if self.message is None:
            self.message = await self._open(Item(new_id("item"), self.media_time, self.media_time, role="assistant",
                                                 audio=False, status="in_progress"))
            await self.emit(ContentPartAdded(response_id=self.response_id, item_id=self.message.item_id,
                                             output_index=self._index(self.message),
                                             part={"type": "text", "text": ""}, media_time=self.media_time))
        if delta:
            self.parts.append(delta)
            await self.emit(ResponseTextDelta(response_id=self.response_id, item_id=self.message.item_id,
                                              output_index=self._index(self.message), delta=delta,
                                              media_time=self.media_time))

    async def add_call(self, piece: CallDelta) -> None:
        item = self.calls.get(piece.index)
        if item is None:
            item = await self._open(Item(new_id("item"), self.media_time, self.media_time, role="assistant",
                                         audio=False, status="in_progress", type="function_call",
                                         call_id=piece.call_id or new_id("call"), name=piece.name))
            self.calls[piece.index] = item
        item.name = item.name or piece.name
        if piece.arguments:
            item.stable += piece.arguments
            await self.emit(FunctionCallArgumentsDelta(response_id=self.response_id, item_id=item.item_id,
                                                       output_index=self._index(item), call_id=item.call_id,
                                                       delta=piece.arguments, media_time=self.media_time))

    async def finish(self, completed: bool) -> list[Item]:
        """Close every output item (completed, or incomplete when the response was cut short or failed)."""
        if not self.items:
            await self.add_text("")
        for item in self.items:
            item.completed = True
            item.status = "completed" if completed else "incomplete"
            index = self._index(item)
            if item is self.message:
                item.stable = self.text
                await self.emit(ResponseTextDone(response_id=self.response_id, item_id=item.item_id,
                                                 output_index=index, text=item.stable, media_time=self.media_time))
                await self.emit(ContentPartDone(response_id=self.response_id, item_id=item.item_id,
                                                output_index=index, part={"type": "text", "text": item.stable},
                                                media_time=self.media_time))
            else:
                await self.emit(FunctionCallArgumentsDone(
                    response_id=self.response_id, item_id=item.item_id, output_index=index, call_id=item.call_id,
                    name=item.name, arguments=item.stable, media_time=self.media_time))
            await self.emit(OutputItemDone(response_id=self.response_id, output_index=index, item=item.to_api(),
                                           media_time=self.media_time))
            if self.in_conversation:
                await self.emit(ItemDone(item=item.to_api(), previous_item_id=self.conversation.previous_id(
                    item.item_id), media_time=self.media_time))
        return self.items

    async def _open(self, item: Item) -> Item:
        after = self.items[-1].item_id if self.items else (self.anchor or "root")
        self.items.append(item)
        previous = None
        if self.in_conversation:
            try:
                self.conversation.add(item, after=after)
            except KeyError:  # the anchor was deleted meanwhile (a screen consolidated, a client's delete)
                try:
                    self.conversation.add(item, after=self.fallback or "root")
                except KeyError:
                    self.conversation.add(item)
            previous = self.conversation.previous_id(item.item_id)
        await self.emit(OutputItemAdded(response_id=self.response_id, output_index=self._index(item),
                                        item=item.to_api(), media_time=self.media_time))
        if self.in_conversation:
            await self.emit(ItemAdded(item=item.to_api(), previous_item_id=previous, media_time=self.media_time))
        return item

    def _index(self, item: Item) -> int:
        return self.items.index(item)
