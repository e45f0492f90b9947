"""Drive a session from a source: push its chunks in media-time order, ask scripted questions when the
media reaches their time, and report progress. Used by `demo`, `transcribe`, `ask` and `serve --source`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.chunks import AudioChunk
from runtime.io.source import Source

if TYPE_CHECKING:  # the session (and torch with it) loads when a command runs one, not with the parser's imports
    from runtime.session import Session


@dataclass(frozen=True)
class ScheduledQuestion:
    text: str
    at: float | None = None  # media seconds; None = at the end of the input


async def feed(
    source: Source,
    session: Session,
    questions: Sequence[ScheduledQuestion] = (),
    progress: Callable[[float], None] | None = None,
) -> float:
    """Push all of `source` into `session`; returns the media time reached. Does not finish the session.

    Paced (a live-like stream), media keeps flowing while a question is answered, as it would from a camera,
    and video keeps only the newest frames when encoding falls behind. Unpaced (`speed` 0), the result must
    not depend on the machine: nothing more is pushed until an answer ends (else the ASR would race past the
    question's media time and the answer would read words spoken after it), and each frame waits until the
    one before it is in the video memory (else frames would be dropped, and batched, as timing falls)."""
    wait = getattr(source, "speed", 1.0) == 0
    timed = sorted((q for q in questions if q.at is not None), key=lambda q: q.at or 0.0)
    at_end = [q for q in questions if q.at is None]
    reached = 0.0
    async for item in source:
        if isinstance(item, AudioChunk):
            await session.push_audio(item)
            reached = max(reached, item.end)
        else:
            if session.push_video(item) and wait:
                await session.video_settled()
            reached = max(reached, item.time)
        while timed and (timed[0].at or 0.0) <= reached:
            q = timed.pop(0)
            await session.ask(q.text, media_time=q.at, wait=wait)
        if progress is not None:
            progress(reached)
    for q in [*timed, *at_end]:  # asked past the end of the media: ask at the end
        await session.ask(q.text, media_time=reached)
    return reached
