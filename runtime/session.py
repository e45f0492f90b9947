"""A session: one stream of live media, its processors, and the events it emits.

Sources push into it (`push_audio` waits when the audio channel is full; `push_video` never waits and keeps
the newest frames at the configured fps), questions go in with `ask`, and everything that happens comes
out of `events` in order. `finish()` ends the input and drains (final transcript, pending answers);
`stop()` ends it now. Either way every task is gone and the per-session model state is released after.

The models themselves (`Models`) are loaded once per process on the device worker and shared by sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.channels import BlockingChannel, ChannelClosed, LatestChannel
from runtime.chunks import AudioChunk, VideoFrame
from runtime.config import Profile, check_memory_fits, memory_sizes
from runtime.events import Event, Metrics, SessionCreated, error_event, new_id
from runtime.memory.transcript import TranscriptMemory
from runtime.memory.video import VideoMemory
from runtime.metrics import LoopLagMonitor
from runtime.models.asr.base import StreamingASR, load_asr
from runtime.models.lm import AnswerBackend, NoAnswerer, load_answerer
from runtime.models.lm.weights import is_vlm
from runtime.models.loading import configure_threads, resolve_checkpoint
from runtime.models.vlm.llava_onevision import VisionEncoder
from runtime.pipeline import AudioProcessor, ContextPrefiller, Question, QuestionProcessor
from runtime.video_processor import NoteWriter, VideoProcessor
from runtime.worker import DeviceWorker, Priority

log = logging.getLogger(__name__)


@dataclass
class Models:
    asr: StreamingASR
    answerer: AnswerBackend
    vision: VisionEncoder | None = None  # the VLM's vision half, when the language model can see


def load_models(profile: Profile, worker: DeviceWorker, progress: Callable[[str], None] | None = None, *,
                answers: bool = True) -> Models:
    """Load the profile's models on the worker thread (the thread that will run them). `answers=False` loads
    the ASR alone (`runtime transcribe`: no question comes, so neither the language model nor its vision)."""
    opts: dict[str, Any] = {"device": profile.device, "dtype": profile.dtype, "progress": progress}
    worker.call(Priority.CONTROL, configure_threads, profile.threads)
    asr = worker.call(Priority.CONTROL, load_asr, profile.asr, **opts)
    if not answers:
        return Models(asr=asr, answerer=NoAnswerer())
    answerer = worker.call(Priority.CONTROL, load_answerer, profile.lm, seed=profile.seed, **opts)
    vision = None
    if profile.video.memory:
        path = resolve_checkpoint(profile.lm.model, role="lm")
        if not is_vlm(path):
            if progress:
                progress(f"lm {profile.lm.model} is text-only: video frames are counted, not remembered")
        elif profile.lm.backend != "engine":
            if progress:
                progress("video memory needs lm.backend = engine: video frames are counted, not remembered")
        else:
            check_memory_fits(profile)
            vision = worker.call(Priority.CONTROL, VisionEncoder.load, profile.lm.model, grid=profile.video.grid,
                                 **opts)
    return Models(asr=asr, answerer=answerer, vision=vision)


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


class Session:
    def __init__(self, profile: Profile, models: Models, worker: DeviceWorker) -> None:
        self.id = new_id("sess")
        self.profile = profile
        self.worker = worker
        pipe = profile.pipeline
        self.audio_in: BlockingChannel[AudioChunk] = BlockingChannel(pipe.audio_queue_chunks, "audio")
        self.video_in: LatestChannel[VideoFrame] = LatestChannel(pipe.video_queue_frames, "video")
        self.questions: BlockingChannel[Question] = BlockingChannel(pipe.question_queue, "questions")
        self.events: BlockingChannel[Event] = BlockingChannel(pipe.event_queue, "events")
        self.sampler = FrameSampler(profile.video.fps)
        self.rate_limited: dict[str, int] = {}  # messages a transport's rate bounds dropped, by kind (web/limits.py)
        self.memory = TranscriptMemory()
        self._asr_stream = models.asr.open_stream()
        self.prefiller: ContextPrefiller | None = None
        self.audio = AudioProcessor(self.audio_in, self._asr_stream, worker, self.emit, self.memory,
                                    on_transcript=self._transcript_changed)
        self.video_memory: VideoMemory | None = None
        self.notes: NoteWriter | None = None
        if models.vision is not None:
            self.video_memory = VideoMemory(memory_sizes(profile), models.vision.dim, device=profile.device,
                                            dtype=models.vision.dtype)
        self.video = VideoProcessor(self.video_in, worker, models.vision, self.video_memory, self.emit,
                                    on_memory=self._transcript_changed, on_segments=self._segments_closed)
        self.answers = QuestionProcessor(self.questions, models.answerer, worker, self.emit, self.memory,
                                         self.audio)
        self.lag = LoopLagMonitor()
        self.pushed_until = 0.0  # media seconds of audio pushed so far
        self.received_until = 0.0  # the same, counting a chunk still waiting for room in the audio queue
        # A transport that buffers a live peer's audio before push_audio (WebRTC) says here how much it holds
        # and how much it had to drop because the models fell that far behind.
        self.audio_upstream_s = 0.0
        self.audio_dropped_s = 0.0
        self.media_time = 0.0  # newest media time seen on any input
        self._expected_sample = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_task: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self._models = models

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> Session:
        if self._started:
            return self
        self._started = True
        self.lag.start()
        lm_stream = await self.worker.run(Priority.CONTROL, self._models.answerer.open_stream)
        if lm_stream is not None:  # the answerer keeps per-stream KV: prefill the transcript as it lands
            self.prefiller = ContextPrefiller(lm_stream, self.worker, self.memory, video=self.video_memory,
                                              answerer=self._models.answerer)
            self.answers.lm_stream, self.answers.prefiller = lm_stream, self.prefiller
            if self.video_memory is not None and self.profile.video.notes:
                self.notes = NoteWriter(self._models.answerer, self.worker, self.video_memory, self.emit,
                                        busy=lambda: self.answers.current is not None or len(self.questions) > 0,
                                        max_tokens=self.profile.video.note_tokens)
        self._tasks = [
            asyncio.create_task(self.audio.run(), name=f"{self.id}:audio"),
            asyncio.create_task(self.video.run(), name=f"{self.id}:video"),
            asyncio.create_task(self.answers.run(), name=f"{self.id}:answers"),
        ]
        if self.prefiller is not None:
            self._tasks.append(asyncio.create_task(self.prefiller.run(), name=f"{self.id}:prefill"))
        if self.notes is not None:
            self._tasks.append(asyncio.create_task(self.notes.run(), name=f"{self.id}:notes"))
        if self.profile.pipeline.metrics_interval_s > 0:
            self._metrics_task = asyncio.create_task(self._report_metrics(), name=f"{self.id}:metrics")
        await self.emit(SessionCreated(session=self.describe()))
        return self

    async def __aenter__(self) -> Session:
        return await self.start()

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            await self.finish()
        else:
            await self.stop()

    async def finish(self) -> None:
        """End of input: transcribe what is left, answer pending questions, emit final metrics, close."""
        if self._closed:
            return
        self.audio_in.close()
        self.video_in.close()
        await asyncio.gather(self._tasks[0], self._tasks[1], return_exceptions=True)
        self.questions.close()
        await asyncio.gather(self._tasks[2], return_exceptions=True)
        for task in self._tasks[3:]:  # prefiller and notes wait for changes forever: nothing more will change
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close()

    async def stop(self) -> None:
        """Stop now: cancel every task (an answer in progress ends at its current step), then close."""
        if self._closed:
            return
        for channel in (self.audio_in, self.video_in, self.questions):
            channel.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close()

    async def _close(self) -> None:
        self._closed = True
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            await asyncio.gather(self._metrics_task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.worker.run(Priority.CONTROL, self._asr_stream.close)
        await self.emit(Metrics(metrics=self.metrics(), media_time=self.media_time))
        await self.lag.stop()
        self.events.close()

    # -- input -----------------------------------------------------------------------------------------------
    async def push_audio(self, chunk: AudioChunk) -> None:
        """Waits while the audio channel is full: audio is never dropped, the caller is slowed."""
        if chunk.start_sample != self._expected_sample:
            raise ValueError(f"audio chunk starts at sample {chunk.start_sample}, expected "
                             f"{self._expected_sample}: chunks must be contiguous")
        self._expected_sample = chunk.end_sample
        self.received_until = chunk.end
        await self.audio_in.put(chunk)
        self.pushed_until = chunk.end
        self.media_time = max(self.media_time, chunk.end)

    def push_video(self, frame: VideoFrame) -> bool:
        """Never waits. Returns False when the frame was skipped by the fps sampler."""
        self.media_time = max(self.media_time, frame.time)
        if not self.sampler.keep(frame):
            return False
        self.video_in.put_nowait(frame)
        return True

    async def video_settled(self) -> None:
        """Wait until every frame pushed so far is in the video memory (or dropped, or failed)."""
        await self.video.settled_to(self.sampler.kept - self.video_in.stats.dropped)

    async def ask(
        self, text: str, *, media_time: float | None = None, client_event_id: str | None = None,
        wait: bool = False,
    ) -> str | None:
        """Queue a question; returns its response id, or None after emitting an `error` event. `wait`: return
        only once the answer has ended (a file played unpaced asks this way, so that no audio after the
        question's media time reaches the context its answer reads)."""
        at = self.media_time if media_time is None else media_time
        if not text.strip():
            await self.emit(error_event("the question is empty", code="empty_question", param="text",
                                        client_event_id=client_event_id, media_time=at))
            return None
        if len(self.questions) >= self.questions.capacity or self.questions.closed:
            why = "closed" if self.questions.closed else f"full ({self.questions.capacity} waiting)"
            await self.emit(error_event(f"question queue is {why}; ask again after the current answer",
                                        code="question_queue_full", client_event_id=client_event_id,
                                        media_time=at))
            return None
        question = Question(text.strip(), at, min(at, self.pushed_until), client_event_id)
        try:
            await self.questions.put(question)
        except ChannelClosed:
            return None
        if wait:
            await question.answered.wait()
        return question.response_id

    def _transcript_changed(self) -> None:
        """The transcript or the video memory changed: the prefiller picks up the newest state."""
        if self.prefiller is not None:
            self.prefiller.mark_dirty()

    def _segments_closed(self, segments: list[Any]) -> None:
        if self.notes is not None:
            self.notes.add(segments)

    def cancel_response(self, response_id: str | None = None) -> bool:
        return self.answers.cancel(response_id)

    async def emit(self, event: Event) -> None:
        """Waits while the event channel is full: events are never dropped, the processors are slowed."""
        if not self.events.closed:
            await self.events.put(event)

    # -- reporting -------------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        p = self.profile
        return {
            "id": self.id,
            "object": "realtime.session",
            "profile": p.name,
            "device": p.device,
            "dtype": p.dtype,
            "random_weights": p.random_weights,
            "asr": {"backend": p.asr.backend, "model": p.asr.model, "language": p.asr.language},
            "lm": {"backend": p.lm.backend, "model": p.lm.model, "max_new_tokens": p.lm.max_new_tokens}
            if not isinstance(self._models.answerer, NoAnswerer) else {"backend": "none"},  # transcribe: no LM
            "video": {"fps": p.video.fps, "max_side": p.video.max_side,
                      "memory_tokens": self.video_memory.sizes.budget() if self.video_memory else 0},
        }

    def metrics(self) -> dict[str, Any]:
        return {
            "loop_lag": self.lag.report(),
            "channels": {c.name: c.stats.to_dict() for c in (self.audio_in, self.video_in, self.questions,
                                                             self.events)},
            "video": self._video_metrics(),
            "asr": {"pushed_until": round(self.pushed_until, 3), "heard_until": round(self.audio.heard_until, 3),
                    "lag_s": round(self.received_until + self.audio_upstream_s - self.audio.heard_until, 3),
                    "dropped_s": round(self.audio_dropped_s, 3)},
            "answers": {"answered": self.answers.answered,
                        "prefilled_tokens": self.prefiller.prefilled_tokens if self.prefiller else 0},
            "worker": self.worker.stats(),
            "rate_limited": dict(self.rate_limited),
        }

    def _video_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"frames_in": self.sampler.kept + self.sampler.skipped,
                               "fps_skipped": self.sampler.skipped, "dropped_full": self.video_in.stats.dropped,
                               "processed": self.video.frames, "encoded": self.video.encoded,
                               "batches": self.video.batches}
        if self.video_memory is not None:
            snap = self.video_memory.snapshot()
            out.update(memory_tokens=snap.tokens, memory_budget=self.video_memory.sizes.budget(),
                       segments=len(snap.segments), notes=self.notes.written if self.notes else 0)
        return out

    async def _report_metrics(self) -> None:
        while True:
            await asyncio.sleep(self.profile.pipeline.metrics_interval_s)
            await self.emit(Metrics(metrics=self.metrics(), media_time=self.media_time))
