"""What one response says, as the Realtime API's items and events: a message, function calls, or both.

Why its own object: a response does not know what it will produce until the model says it (text, or a call's
arguments, from a remote server possibly several calls), so each output item is opened when its first piece
arrives (`output_item.added`, `conversation.item.added`, then the deltas) and all are closed together at the end
(`.done` events in order). The items go where the answer began, not where the conversation ends by the time the
first token comes: speech that started meanwhile is the next turn. A response that produced nothing still closes
with an empty message, as the API's does, so every response has an output item; except one that failed before
it said anything (`answers.py`), which adds nothing, so the user's turn stays the one to answer.

A spoken response (`speech`, the session's `audio.output`, with a `Speaker`) says its message aloud: the content
part is `audio` (the item's `output_audio`), the text goes out as `response.output_audio_transcript.delta` and into
the voice (`spoken_output.py`), whose audio deltas follow clause by clause. At the end the rest is spoken before
`response.output_audio.done`, unless the response was cut short (cancelled, failed): then the audio stops where it
is, and the transcript is still everything decoded, as the API's; a truncation cuts it to what was heard.
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
    ResponseAudioDone,
    ResponseAudioTranscriptDelta,
    ResponseAudioTranscriptDone,
    ResponseTextDelta,
    ResponseTextDone,
    new_id,
)
from runtime.memory.conversation import Conversation, Item
from runtime.models.lm.answering import CallDelta
from runtime.pipeline import Emit
from runtime.pipeline.spoken_output import Speaker, SpokenAudio
from runtime.session_config import OutputAudio


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
    speaker: Speaker | None = None  # with `speech`: the message is spoken
    speech: OutputAudio | None = None
    spoken: SpokenAudio | None = None  # the message's voice, once it opened

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def speaks(self) -> bool:
        return self.speaker is not None and self.speech is not None

    async def add_text(self, delta: str) -> None:
        if self.message is None:
            item = Item(new_id("item"), self.media_time, self.media_time, role="assistant", audio=False,
                        status="in_progress")
            if self.speaker is not None and self.speech is not None:
                self.spoken = self.speaker.open(self.response_id, item.item_id, len(self.items), self.speech,
                                                self.media_time)
                item.spoken = self.spoken.track
            self.message = await self._open(item)
            part = {"type": "audio", "transcript": ""} if self.spoken else {"type": "text", "text": ""}
            await self.emit(ContentPartAdded(response_id=self.response_id, item_id=self.message.item_id,
                                             output_index=self._index(self.message), part=part,
                                             media_time=self.media_time))
        if delta:
            self.parts.append(delta)
            kind = ResponseAudioTranscriptDelta if self.spoken else ResponseTextDelta
            await self.emit(kind(response_id=self.response_id, item_id=self.message.item_id,
                                 output_index=self._index(self.message), delta=delta, media_time=self.media_time))
            if self.spoken is not None:
                await self.spoken.push(delta)

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

    async def finish(self, completed: bool, cut_short: bool | None = None) -> list[Item]:
        """Close every output item (completed, or incomplete when the response was cut short or failed).
        `cut_short` (default: not `completed`): the voice stops where it is instead of speaking the rest."""
        if not self.items:
            await self.add_text("")
        for item in self.items:
            item.completed = True
            item.status = "completed" if completed else "incomplete"
            index = self._index(item)
            if item is self.message and self.spoken is not None:
                await (self.spoken.stop() if (not completed if cut_short is None else cut_short)
                       else self.spoken.finish())
                item.stable = self.text
                ids = {"response_id": self.response_id, "item_id": item.item_id, "output_index": index,
                       "media_time": self.media_time}
                await self.emit(ResponseAudioDone(**ids))
                await self.emit(ResponseAudioTranscriptDone(transcript=item.stable, **ids))
                await self.emit(ContentPartDone(part={"type": "audio", "transcript": item.stable}, **ids))
            elif item is self.message:
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

    def abort(self) -> None:
        """The answer's task is going away (the session stops): the voice stops with it, without waiting."""
        if self.spoken is not None:
            self.spoken.abort()

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
