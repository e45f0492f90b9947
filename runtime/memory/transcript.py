"""The transcript so far, as the answerer's context.

Completed items are final; the open item has stable text and an unstable tail that the ASR may still
revise. The context shows all of it with media timestamps, so an answer asked mid-sentence sees the words
already heard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.models.asr.base import TranscriptUpdate


@dataclass
class TranscriptItem:
    item_id: str
    start: float
    end: float
    stable: str = ""
    unstable: str = ""
    completed: bool = False

    @property
    def text(self) -> str:
        return (self.stable + self.unstable).strip()


def _stamp(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes):02d}:{secs:04.1f}"


@dataclass
class TranscriptMemory:
    items: list[TranscriptItem] = field(default_factory=list)

    def apply(self, update: TranscriptUpdate) -> TranscriptItem:
        item = self.items[-1] if self.items and self.items[-1].item_id == update.item_id else None
        if item is None:
            item = TranscriptItem(update.item_id, update.start, update.end)
            self.items.append(item)
        item.end = update.end
        if update.completed:
            item.stable, item.unstable, item.completed = update.transcript, "", True
        else:
            item.stable += update.delta
            item.unstable = update.unstable
        return item

    def context(self) -> str:
        """One line per item: `[mm:ss.s] text`, oldest first; empty items are left out."""
        return "\n".join(f"[{_stamp(i.start)}] {i.text}" for i in self.items if i.text)

    def final_text(self) -> str:
        return " ".join(i.text for i in self.items if i.text)
