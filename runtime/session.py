"""A session: one stream of live media, its processors, and the events it emits.

Sources push into it (`push_audio` waits when the audio channel is full; `push_video` never waits and keeps
the newest frames at the configured fps), questions go in with `ask`, and everything that happens comes
out of `events` in order. `finish()` ends the input and drains (final transcript, pending answers);
`stop()` ends it now. Either way every task is gone and the per-session model state is released after.

A session is assembled whole by `session_builder.open_session`; its parts, and what each is, are in
`session_parts.py`. This module only runs it: lifecycle, input, reporting.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.config import Profile
from runtime.errors import ConfigError
from runtime.events import (
    ItemAdded,
    ItemDeleted,
    ItemDone,
    ItemRetrieved,
    ItemTruncated,
    Metrics,
    SessionCreated,
    SessionUpdated,
    TranscriptionCompleted,
    error_event,
    new_id,
)
from runtime.function_tools import ToolUse
from runtime.memory.conversation import Item, ItemType, Role
from runtime.metrics import LoopLagMonitor
from runtime.pipeline.audio import MIN_COMMIT_S, BufferEnd
from runtime.pipeline.questions import Question
from runtime.pipeline.whole_utterance import transcribe_whole
from runtime.session_config import OutputAudio, SessionConfig
from runtime.session_parts import SessionParts
from runtime.worker import DeviceWorker, Priority


class BufferTooSmall(ValueError):
    """A commit of less audio than the API allows; the buffer is kept."""


class Session:
    def __init__(self, profile: Profile, worker: DeviceWorker, parts: SessionParts) -> None:
        self.id = new_id("sess")
        self.profile, self.worker = profile, worker
        self.audio_in, self.video_in = parts.audio_in, parts.video_in
        self.questions, self.events, self.emit = parts.questions, parts.events, parts.emit
        self.sampler, self.conversation, self.video_memory = parts.sampler, parts.conversation, parts.video_memory
        self.audio, self.video, self.answers = parts.audio, parts.video, parts.answers
        self.prefiller, self.notes, self.warmer = parts.prefiller, parts.notes, parts.warmer
        self.heard, self.activity, self.transport = parts.heard, parts.activity, parts.transport
        self.settings, self.requests, self.changes = parts.settings, parts.requests, parts.changes
        self.commits = 0  # commits asked for: a response waits for the transcripts of those before it
        self._describe = parts.describe
        self.lag = LoopLagMonitor()
        self.pushed_until = 0.0  # media seconds of audio pushed so far
        self.received_until = 0.0  # the same, counting a chunk still waiting for room in the audio queue
        self.media_time = 0.0  # newest media time seen on any input
        self._expected_sample = 0
        self._buffer_from = 0  # the sample the input buffer starts at (after the last commit or clear)
        self._inputs: list[asyncio.Task[None]] = []  # end when their channels drain: audio, video
        self._answers: asyncio.Task[None] | None = None  # ends when the question channel drains
        self._background: list[asyncio.Task[None]] = []  # wait for changes forever: prefiller, notes, metrics
        self._started = False
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> Session:
        if self._started:
            return self
        self._started = True
        self.lag.start()
        self._inputs = [asyncio.create_task(self.audio.run(), name=f"{self.id}:audio"),
                        asyncio.create_task(self.video.run(), name=f"{self.id}:video")]
        self._answers = asyncio.create_task(self.answers.run(), name=f"{self.id}:answers")
        if self.prefiller is not None:
            self._background.append(asyncio.create_task(self.prefiller.run(), name=f"{self.id}:prefill"))
        if self.notes is not None:
            self._background.append(asyncio.create_task(self.notes.run(), name=f"{self.id}:notes"))
        if self.warmer is not None:
            self._background.append(asyncio.create_task(self.warmer.run(), name=f"{self.id}:warm"))
        if self.profile.pipeline.metrics_interval_s > 0:
            self._background.append(asyncio.create_task(self._report_metrics(), name=f"{self.id}:metrics"))
        await self.emit(SessionCreated(session=self.describe()))
        return self

    async def __aenter__(self) -> Session:
        return await self.start()

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            await self.finish()
        else:
            await self.stop()

    def _tasks(self) -> list[asyncio.Task[None]]:
        return [*self._inputs, *([self._answers] if self._answers else []), *self._background]

    async def finish(self) -> None:
        """End of input: transcribe what is left, answer pending questions, emit final metrics, close."""
        if self._closed:
            return
        self.audio_in.close()
        self.video_in.close()
        await asyncio.gather(*self._inputs, return_exceptions=True)
        self.questions.close()
        if self._answers is not None:
            await asyncio.gather(self._answers, return_exceptions=True)
        await self._close()

    async def stop(self) -> None:
        """Stop now: cancel every task (an answer in progress ends at its current step), then close."""
        if self._closed:
            return
        for channel in (self.audio_in, self.video_in, self.questions):
            channel.close()
        for task in self._tasks():
            task.cancel()
        await self._close()

    async def _close(self) -> None:
        self._closed = True
        for task in self._background:  # nothing more will change: the prefiller and notes have no more to do
            task.cancel()
        await asyncio.gather(*self._tasks(), return_exceptions=True)
        await self.audio.release()  # the audio task closed its ASR streams, unless it never ran
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
        """Queue a question (a script's, the terminal's): it joins the conversation with its answer. Returns its
        response id, or None after emitting an `error` event. `wait`: return only once the answer has ended (a
        file played unpaced asks this way, so that no audio after the question's media time reaches the context
        its answer reads)."""
        at = self.media_time if media_time is None else media_time
        if not text.strip():
            await self.emit(error_event("the question is empty", code="empty_question", param="text",
                                        client_event_id=client_event_id, media_time=at))
            return None
        config = self.settings.config
        question = Question(text.strip(), at, min(at, self.pushed_until), client_event_id, commits=self.commits,
                            instructions=config.instructions, max_tokens=config.max_output_tokens,
                            record_question=True, speech=config.speech())
        if not await self.requests.request(question):
            return None
        if wait:
            await question.answered.wait()
        return question.response_id

    async def create_response(self, *, client_event_id: str | None = None, text: str | None = None,
                              instructions: str | None = None, max_tokens: int | None = None,
                              in_conversation: bool = True, metadata: dict[str, object] | None = None,
                              tools: ToolUse | None = None, input_items: tuple[str, ...] = (),
                              speech: OutputAudio | None | Literal["session"] = "session") -> str | None:
        """`response.create`: answer what the user said or typed since the last answer (or `text`, a request's
        own input, which may hold the text of the conversation's `input_items`), after every commit sent before it
        has its transcript; with none, answer from the conversation as it stands (an agent that speaks first). It
        may call `tools` (None: the session's); `speech`: how it is spoken (None: text; default: the session's)."""
        config = self.settings.config
        question = Question(text, self.media_time, self.pushed_until, client_event_id, commits=self.commits,
                            instructions=config.instructions if instructions is None else instructions,
                            max_tokens=config.max_output_tokens if max_tokens is None else max_tokens,
                            in_conversation=in_conversation, metadata=metadata,
                            tools=config.tools if tools is None else tools, input_items=input_items,
                            speech=config.speech() if speech == "session" else speech, continues=text is None)
        return question.response_id if await self.requests.request(question) else None

    async def commit_audio(self, client_event_id: str | None = None) -> None:
        """The audio pushed since the last commit becomes a user item (`input_audio_buffer.committed` follows,
        in order with the audio). Raises BufferTooSmall, keeping the buffer, under `MIN_COMMIT_S` of audio."""
        held = self._expected_sample - self._buffer_from
        if held < MIN_COMMIT_S * SAMPLE_RATE:
            raise BufferTooSmall(f"buffer too small: expected at least {MIN_COMMIT_S * 1000:.0f} ms of audio, the "
                                 f"buffer holds {1000 * held / SAMPLE_RATE:.0f} ms")
        self.commits += 1
        self._buffer_from = self._expected_sample
        await self.audio_in.put(BufferEnd(client_event_id=client_event_id))

    async def clear_audio(self, client_event_id: str | None = None) -> None:
        self._buffer_from = self._expected_sample
        await self.audio_in.put(BufferEnd(clear=True, client_event_id=client_event_id))

    # -- the conversation ------------------------------------------------------------------------------------
    async def add_item(self, role: Role, text: str, *, item_id: str | None = None, after: str | None = None,
                       kind: ItemType = "message", call_id: str = "", name: str = "") -> str:
        """A typed user or system message, or a function call's output, joins the conversation
        (`conversation.item.create`); raises KeyError for an unknown `after`, ValueError for an id already in
        use."""
        if item_id is not None and self.conversation.get(item_id) is not None:
            raise ValueError(item_id)
        item = Item(item_id or new_id("item"), self.media_time, self.media_time, role=role, audio=False,
                    stable=text, completed=True, type=kind, call_id=call_id, name=name)
        previous = self.conversation.add(item, after=after)
        self.changes.mark()
        await self.emit(ItemAdded(item=item.to_api(), previous_item_id=previous, media_time=self.media_time))
        await self.emit(ItemDone(item=item.to_api(), previous_item_id=previous, media_time=self.media_time))
        return item.item_id

    async def add_spoken_item(self, samples: np.ndarray, *, item_id: str | None = None,
                              after: str | None = None) -> str:
        """A spoken user message sent whole (`conversation.item.create` with `input_audio`): transcribed by an ASR
        stream of its own, beside the live input buffer, then added like a committed buffer's item."""
        if item_id is not None and self.conversation.get(item_id) is not None:
            raise ValueError(item_id)
        item = Item(item_id or new_id("item"), self.media_time, self.media_time, status="in_progress")
        previous = self.conversation.add(item, after=after)
        await self.emit(ItemAdded(item=item.to_api(), previous_item_id=previous, media_time=self.media_time))
        asr, chunk_ms = self.profile.asr, self.profile.pipeline.audio_chunk_ms
        speech = self.settings.config.transcription_speech(asr.language, asr.task)
        try:
            transcript, language = await self.worker.run(Priority.ASR, transcribe_whole, self.audio.open_asr,
                                                         samples, chunk_ms, speech)
        except ConfigError as err:  # a language or task the model cannot do: said, and heard as the profile says
            field = "language" if speech is not None and speech.language not in ("", "en") else "task"
            await self.emit(error_event(str(err), code="invalid_value", param=f"session.audio.input.transcription."
                                        f"{field}", media_time=self.media_time))
            transcript, language = await self.worker.run(Priority.ASR, transcribe_whole, self.audio.open_asr,
                                                         samples, chunk_ms)
        item.stable, item.completed, item.status = transcript, True, "completed"
        item.end = item.start + len(samples) / SAMPLE_RATE
        self.changes.mark()
        await self.emit(TranscriptionCompleted(item_id=item.item_id, transcript=transcript, start=item.start,
                                               end=item.end, language=language, media_time=self.media_time))
        await self.emit(ItemDone(item=item.to_api(), previous_item_id=previous, media_time=self.media_time))
        return item.item_id

    async def delete_item(self, item_id: str) -> bool:
        if self.conversation.api_item(item_id) is None or not self.conversation.delete(item_id):
            return False
        self.changes.mark()
        await self.emit(ItemDeleted(item_id=item_id, media_time=self.media_time))
        return True

    async def truncate_item(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """`conversation.item.truncate`: an assistant item's audio cut where the user stopped listening, and its
        transcript with it, to the words heard (`memory/spoken.py`). An item still being spoken has its response
        cancelled first (the user stopped listening). A text answer holds 0 ms of audio: cutting at 0 is the one cut
        there is (its text stays, since no audio stood for it). Past the audio's end is a ValueError saying why."""
        item = self.conversation.api_item(item_id)
        if item is None:
            raise KeyError(item_id)
        if item.role != "assistant" or item.is_call or content_index != 0:
            raise ValueError(f"only an assistant message's content 0 can be truncated ({item_id} is a {item.role} "
                             f"{item.type}{'' if content_index == 0 else f', content_index {content_index}'})")
        current = self.answers.current
        if item.spoken is not None and item.status == "in_progress" and current is not None:
            self.answers.cancel(current.response_id)
            await current.answered.wait()
        length = item.spoken.duration_ms if item.spoken is not None else 0
        if audio_end_ms > length:
            raise ValueError(f"audio content of {length} ms is already shorter than {audio_end_ms} ms"
                             + ("" if item.spoken is not None else ": this answer is text, without audio"))
        if item.spoken is not None:
            item.stable, item.unstable = item.spoken.cut(audio_end_ms), ""
            self.changes.mark()
        await self.emit(ItemTruncated(item_id=item_id, content_index=0, audio_end_ms=audio_end_ms,
                                      media_time=self.media_time))

    async def retrieve_item(self, item_id: str) -> bool:
        item = self.conversation.api_item(item_id)
        if item is not None:
            await self.emit(ItemRetrieved(item=item.to_api(), media_time=self.media_time))
        return item is not None

    async def update_config(self, config: SessionConfig) -> None:
        self.settings.config = config
        await self.emit(SessionUpdated(session=self.describe(), media_time=self.media_time))

    @property
    def speaks(self) -> bool:
        """Whether this session has a voice (else `output_modalities` stays ['text'])."""
        return self.answers.speaker is not None

    @property
    def detects_turns(self) -> bool:
        """Whether the turn-detection models loaded (else `turn_detection` stays null: commits by hand)."""
        return self.audio.turns is not None

    def cancel_response(self, response_id: str | None = None) -> bool:
        return self.answers.cancel(response_id)

    # -- reporting -------------------------------------------------------------------------------------------
    def describe(self) -> dict[str, object]:
        """The GA session object (what the client set), then what this server runs (models, profile)."""
        return {"id": self.id, "object": "realtime.session", **self.settings.config.to_api(), **self._describe}

    def metrics(self) -> dict[str, object]:
        t = self.transport
        screen = {"screen": self.video.screen.metrics()} if self.video.screen is not None else {}
        return {
            "loop_lag": self.lag.report(),
            "channels": {c.name: c.stats.to_dict() for c in (self.audio_in, self.video_in, self.questions,
                                                             self.events)},
            "video": self._video_metrics(),
            "asr": {"pushed_until": round(self.pushed_until, 3), "heard_until": round(self.heard.until, 3),
                    "lag_s": round(self.received_until + t.audio_buffered_s - self.heard.until, 3),
                    "dropped_s": round(t.audio_dropped_s, 3)},
            "answers": {"answered": self.answers.answered,
                        "prefilled_tokens": self.prefiller.prefilled_tokens if self.prefiller else 0,
                        **({"warm_requests": self.warmer.sent, "warm_failures": self.warmer.failed,
                            "warm_cancelled": self.warmer.cancelled} if self.warmer else {})},
            "worker": self.worker.stats(),
            "rate_limited": dict(t.rate_limited),
            **screen,  # when the profile reads text on screen
        }

    def _video_metrics(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"frames_in": self.sampler.kept + self.sampler.skipped,
                                       "fps_skipped": self.sampler.skipped,
                                       "dropped_full": self.video_in.stats.dropped,
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
