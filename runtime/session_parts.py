"""What a session is built from: the contract between `session_builder.open_session`, which makes the parts in
dependency order, and `session.Session`, which only runs them.

It stands apart from the session so that the builder (and a test of one part) reads what a session needs
without the code that runs it, and so that the session takes its parts whole instead of building any itself.
`FrameSampler` is here because it is one of those parts: the builder sizes it from the profile's `video.fps`,
and the session asks it about every pushed frame.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.channels import BlockingChannel, LatestChannel
from runtime.chunks import AudioChunk, VideoFrame
from runtime.events import Event
from runtime.memory.conversation import Conversation
from runtime.memory.video import VideoMemory
from runtime.pipeline import Emit
from runtime.pipeline.answers import QuestionProcessor
from runtime.pipeline.audio import AudioProcessor, BufferEnd
from runtime.pipeline.notes import NoteWriter
from runtime.pipeline.prefill import ContextPrefiller
from runtime.pipeline.prefix_warming import PrefixWarmer
from runtime.pipeline.questions import Question
from runtime.pipeline.response_requests import ResponseRequests
from runtime.pipeline.video import VideoProcessor
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock, SessionSettings, TransportStats


class FrameSampler:
    """Keeps frames at most `fps` per second of media time; the rest are counted, not queued."""

    def __init__(self, fps: float) -> None:
        self.period = 1.0 / fps
        self._next = 0.0
        self.kept = 0
        self.skipped = 0

    def keep(self, frame: VideoFrame) -> bool:
        if frame.time + 1e-9 < self._next:
            self.skipped += 1
            return False
        self._next = max(self._next + self.period, frame.time + self.period / 2)
        self.kept += 1
        return True


@dataclass(frozen=True)
class SessionParts:
    """Everything a session runs, built in dependency order by `session_builder.open_session`."""

    audio_in: BlockingChannel[AudioChunk | BufferEnd]
    video_in: LatestChannel[VideoFrame]
    questions: BlockingChannel[Question]
    events: BlockingChannel[Event]
    emit: Emit
    sampler: FrameSampler
    conversation: Conversation
    video_memory: VideoMemory | None
    heard: HeardClock
    changes: ContextChanges
    activity: AnswerActivity
    transport: TransportStats
    settings: SessionSettings
    requests: ResponseRequests
    audio: AudioProcessor
    video: VideoProcessor
    answers: QuestionProcessor
    prefiller: ContextPrefiller | None
    notes: NoteWriter | None
    describe: dict[str, object]  # what `session.created` says about the models and settings
    warmer: PrefixWarmer | None = None  # a remote answerer's prefix-cache warm-ups
