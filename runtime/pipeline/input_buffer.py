"""One input audio buffer as one user item, whatever the ASR does inside it.

The Realtime API's unit of speech is the input audio buffer: everything between two commits (the client's, or
turn detection's) is one user message. An ASR backend may cut that audio into several items of its own at its
pauses; `BufferTranscript` folds them into the buffer's one item, so every transcript event carries the item id
that `input_audio_buffer.committed` names, the deltas still add up to the text, and the completed transcript
is the backend's final text of each of its items, joined.

Its updates' `start` is where its words begin: the buffer's first sample, until turn detection hears speech in it
(`speech_from`). With turn detection a buffer opens where the previous turn was committed, a pause before the
next words, and a transcript stamped there would put every turn seconds early beside what was on screen.
"""

from __future__ import annotations

from runtime.models.asr.base import TranscriptUpdate


class BufferTranscript:
    def __init__(self, item_id: str, start: float) -> None:
        self.item_id, self.start = item_id, start
        self.end = start
        self.language = ""  # the language the backend last said it heard
        self._done: list[str] = []  # final text of the backend's completed items
        self._item: str | None = None  # the backend's open item
        self._item_text = ""  # stable text the open item has streamed
        self._streamed = ""  # everything streamed as deltas for this buffer
        self._fresh = False  # the open backend item has streamed nothing yet: its first words need a space

    def speech_from(self, at: float) -> None:
        """Turn detection heard the buffer's speech begin at `at` (media seconds): later updates start there."""
        self.start = max(self.start, at)

    @property
    def text(self) -> str:
        return " ".join([*self._done, self._item_text.strip()]).strip()

    def fold(self, update: TranscriptUpdate) -> TranscriptUpdate | None:
        """The buffer-level update for one of the backend's, or None when it changes nothing visible."""
        self.end = max(self.end, update.end)
        self.language = update.language or self.language
        if update.item_id != self._item:
            self._item, self._item_text, self._fresh = update.item_id, "", True
        if update.completed:
            final = update.transcript.strip()
            delta = final[len(self._item_text.strip()):] if final.startswith(self._item_text.strip()) else ""
            if final:
                self._done.append(final)
            self._item, self._item_text, unstable = None, "", ""
        else:
            delta, unstable = update.delta, update.unstable
            self._item_text += delta
        if self._fresh:
            unstable = self._separated(unstable) if not delta else unstable
            if delta:
                delta, self._fresh = self._separated(delta), False
        self._streamed += delta
        if not delta and not unstable and not update.completed:
            return None
        return TranscriptUpdate(self.item_id, delta, unstable, self.start, self.end, language=self.language)

    def _separated(self, text: str) -> str:
        """A space between the backend's items: an item's first words follow the previous item's last."""
        if text and self._streamed and not self._streamed.endswith(" ") and not text.startswith(" "):
            return " " + text
        return text

    def text_if_final(self, final: str) -> str:
        """The buffer's completed transcript were the backend's open item to end with `final` as its text."""
        return " ".join([*self._done, final.strip()]).strip()

    def complete(self, end: float) -> TranscriptUpdate:
        """The buffer's item, completed at `end` (where its audio ended): call after the backend's `finish()`
        updates were folded."""
        self.end = max(self.end, end)
        return TranscriptUpdate(self.item_id, "", "", self.start, self.end, completed=True, transcript=self.text,
                                language=self.language)
