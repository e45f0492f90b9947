"""What an assistant message said aloud, as the client received it: the audio's length and where each spoken
clause ends in it, so that a truncation (`conversation.item.truncate`'s `audio_end_ms`, or the server's own cut
at a barge-in) can keep the words that were heard and drop the rest.

Why clauses: the voice speaks a clause per call (`runtime/models/tts/clauses.py`), so the one thing known exactly is
where each clause's audio begins and ends; within a clause no word timing is known. The rule: a clause whose audio
ended at or before the cut was heard whole; of the clause the cut falls in, the share of its words that the played
share of its audio holds, rounded down (words taken as evenly spaced); nothing after. Text that was decoded but
never spoken (a response cancelled before its last clauses were synthesised) is past any cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpokenTrack:
    """One assistant message's audio: `rate` samples a second (the output format's), `samples` sent to the client,
    and each clause as (the sample its audio starts at, the sample it ends at, its text), in order. A clause is
    planned whole when its audio is made; `samples` grows as the audio goes out, so a clause cut off mid-way keeps
    its full length here (the share of it played is what the rule needs)."""

    rate: int
    samples: int = 0
    clauses: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def duration_ms(self) -> int:
        return self.samples * 1000 // self.rate

    def plan(self, text: str, samples: int) -> None:
        """The next clause, `text`, is spoken in the next `samples` samples of audio."""
        start = self.clauses[-1][1] if self.clauses else 0
        self.clauses.append((start, start + samples, text))

    def extend_last(self, samples: int) -> None:
        """The resampler's tail at the end of the answer: it belongs to the last clause."""
        if self.clauses:
            start, end, text = self.clauses[-1]
            self.clauses[-1] = (start, end + samples, text)

    def sent(self, samples: int) -> None:
        self.samples += samples

    def heard(self, audio_end_ms: int) -> str:
        """The words heard when playback stopped at `audio_end_ms` (the module's rule)."""
        end = min(self.samples, audio_end_ms * self.rate // 1000)
        words: list[str] = []
        for start, stop, text in self.clauses:
            said = text.split()
            if stop <= end:
                words.extend(said)
                continue
            if end > start:
                words.extend(said[: len(said) * (end - start) // (stop - start)])
            break
        return " ".join(words)

    def cut(self, audio_end_ms: int) -> str:
        """Keep the audio up to `audio_end_ms` (at most what was sent) and the clauses heard by then; returns the
        text heard."""
        end = min(self.samples, audio_end_ms * self.rate // 1000)
        heard = self.heard(audio_end_ms)
        kept = [c for c in self.clauses if c[1] <= end]
        whole = sum(len(c[2].split()) for c in kept)
        rest = " ".join(heard.split()[whole:])
        if rest or (len(kept) < len(self.clauses) and self.clauses[len(kept)][0] < end):
            kept.append((kept[-1][1] if kept else 0, end, rest))
        self.samples, self.clauses = end, kept
        return heard
