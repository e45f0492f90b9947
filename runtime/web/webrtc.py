"""A browser's session over WebRTC (aiortc): camera and microphone as media tracks, events on a data channel.

Signalling is one `POST /v1/webrtc/offer` (server.py): the browser's offer (its tracks and a data channel named
`events`, ICE candidates gathered, no trickle) in, our answer out. Then:

- Audio arrives as 48 kHz (usually stereo) s16 frames every 20 ms; PyAV's resampler turns it into 16 kHz mono
  float32 for the session. aiortc's receive queues are unbounded, so a consumer task reads the track without
  pause into a bounded buffer (`serve.webrtc_audio_buffer_s`); a feeder pushes from it into the session, which
  applies backpressure. If the pipeline falls that far behind, the oldest audio is dropped and counted.
- Video: a consumer keeps only the latest decoded frame; a sampler converts one per `video.fps` (downscaled to
  `video.max_side`, in a thread) and pushes it. Media time for video is wall time since the first media frame
  arrived, which matches the audio clock (samples counted since the first audio frame) for a live peer.
- The voice (issue 52): when the offer can receive audio (its audio transceiver is sendrecv or recvonly), the answer
  sends a `VoiceTrack` (voice_track.py) and the session's speaker plays into it instead of sending
  `response.output_audio.delta` events; `output_audio_buffer.started/stopped/cleared` come on the data channel. The
  track is cleared at a barge-in (the session's `input_audio_buffer.speech_started` while turn detection has
  `interrupt_response`) and on the client's `output_audio_buffer.clear`, which this peer answers itself; either also
  drops the rest of the response in progress's audio. A truncation at barge-in then cuts to what the track played.
- The `events` data channel carries the websocket protocol's JSON both ways (`SessionDriver`): server events
  out, questions in. Sending waits while more than `HIGH_WATER` bytes are buffered, so a slow peer slows the
  session as a slow websocket does.

The peer ends when the connection fails or closes, the data channel closes, or the peer never connects within
`CONNECT_TIMEOUT_S`; the session then stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from runtime.chunks import SAMPLE_RATE, VideoFrame
from runtime.config import Profile
from runtime.events import (
    Event,
    OutputAudioBufferCleared,
    OutputAudioBufferStarted,
    OutputAudioBufferStopped,
    SpeechStarted,
    error_event,
)
from runtime.io.file_source import scaled_size
from runtime.session import Session
from runtime.session_state import TransportStats
from runtime.web.driver import SessionDriver
from runtime.web.protocol import event_id_of
from runtime.web.voice_track import CLEARED, STARTED, VoiceTrack

log = logging.getLogger(__name__)

EVENTS_LABEL = "events"
CONNECT_TIMEOUT_S = 30.0  # from the answer to an open data channel
HIGH_WATER, LOW_WATER = 1 << 20, 256 << 10  # data channel bytes buffered: wait above HIGH until below LOW
INBOX_MESSAGES = 64  # client events waiting to be parsed; past it a message is refused with an error
MIN_AUDIO_GAP_S = 0.01  # RTP timestamps further apart than the audio between them: the peer sent nothing
MAX_AUDIO_GAP_S = 3600.0  # a jump beyond this is taken for a broken timestamp, not an hour of silence
BUFFER_EVENTS = 64  # output_audio_buffer.* events waiting for the session's event channel; past it one is dropped
CLEAR_EVENT = "output_audio_buffer.clear"


class WebRTCPeer:
    def __init__(self, session: Session, profile: Profile, stats: TransportStats,
                 observe: Callable[[Event], None] | None = None) -> None:
        """`stats`: this peer's own measurements (audio it buffers and drops), which `session` was built with.
        `observe`: sees every event sent (the server's metrics)."""
        self.session, self.profile, self.stats = session, profile, stats
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # no STUN: host candidates only
        self.observe = observe
        self.driver = SessionDriver(session, profile, stats, observe=self._observe)
        self.voice = VoiceTrack(self._on_buffer_event)
        self.speaks = False  # the answer sends the voice track (the offer could receive audio)
        self.buffer_events: asyncio.Queue[Event] = asyncio.Queue(BUFFER_EVENTS)
        self.channel: RTCDataChannel | None = None
        self.channel_open = asyncio.Event()
        self.closed = asyncio.Event()
        self.inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue(INBOX_MESSAGES)
        self.tasks: set[asyncio.Task[None]] = set()
        self.t0: float | None = None  # wall time of the first media frame: media time zero
        self.audio_buffer: deque[np.ndarray | int] = deque()  # samples, or a count of silent ones (a gap)
        self.audio_buffered = 0  # samples in the arrays
        self.audio_silence = 0  # samples in the gaps, made only as they are fed (they take no memory here)
        self.audio_ready = asyncio.Event()
        self.latest_frame: tuple[av.VideoFrame, float] | None = None
        self.video_ready = asyncio.Event()
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

    async def answer(self, sdp: str) -> dict[str, str]:
        """Take the browser's offer; returns our answer with every ICE candidate in it."""
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if audio and self.session.answers.speaker is not None:
            self.pc.addTrack(self.voice)  # on the offer's audio transceiver: sent where the offer can receive it
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        self.speaks = any(t.sender.track is self.voice and t.currentDirection in ("sendrecv", "sendonly")
                          for t in audio)
        if self.speaks:
            self.session.answers.speaker.playout = self.voice  # type: ignore[union-attr]
        return {"sdp": self.pc.localDescription.sdp, "type": self.pc.localDescription.type}

    async def run(self) -> None:
        """Until the peer goes (see the module docstring); the session is stopped when this returns."""
        driver = asyncio.create_task(self.driver.run(self._messages(), self._send), name=f"{self.session.id}:rtc")
        self._spawn(self._emit_buffer_events(), "rtc-voice-events")
        try:
            try:
                await asyncio.wait_for(self.channel_open.wait(), CONNECT_TIMEOUT_S)
            except TimeoutError:
                log.info("session %s: the WebRTC peer did not connect within %.0f s", self.session.id,
                         CONNECT_TIMEOUT_S)
                return
            closed = asyncio.create_task(self.closed.wait())
            await asyncio.wait({driver, closed}, return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
        finally:
            await self.close()
            await asyncio.gather(driver, return_exceptions=True)

    async def close(self) -> None:
        self._closing()
        self.voice.stop()  # a `play` waiting for room returns
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # shielded: cancelling a second close() would cancel aiortc's own
            await asyncio.shield(self.pc.close())  # "closed" future, and the first close() then fails

    def _closing(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            if self.inbox.full():  # the end must get through even past a flood of client events
                self.inbox.get_nowait()
            self.inbox.put_nowait(None)  # ends the driver's reader

    def _spawn(self, coro: Coroutine[object, object, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"{self.session.id}:{name}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # Signalling callbacks (aiortc's event emitter calls them on the loop).

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._closing()

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self.driver.take_audio_from_track()
            self._spawn(self._consume_audio(track), "rtc-audio-in")
            self._spawn(self._feed_audio(), "rtc-audio-feed")
        elif track.kind == "video":
            self._spawn(self._consume_video(track), "rtc-video-in")
            self._spawn(self._sample_video(), "rtc-video-sample")

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_LABEL or self.channel is not None:
            channel.close()  # only one events channel per peer
            return
        self.channel = channel
        channel.bufferedAmountLowThreshold = LOW_WATER
        channel.on("message", self._on_message)
        channel.on("close", self._closing)
        if channel.readyState == "open":
            self.channel_open.set()
        else:
            channel.on("open", self.channel_open.set)

    def _on_message(self, message: str | bytes) -> None:
        try:
            self.inbox.put_nowait(message)
        except asyncio.QueueFull:
            refused = error_event(f"more than {INBOX_MESSAGES} client events are waiting; this one was dropped",
                                  code="rate_limited", media_time=self.session.media_time,
                                  client_event_id=event_id_of(message) if isinstance(message, str) else None)
            if self.channel is not None and self.channel.readyState == "open":
                self.channel.send(refused.to_json())

    # The data channel as the driver's transport.

    async def _messages(self) -> AsyncIterator[str | bytes]:
        while (message := await self.inbox.get()) is not None:
            if isinstance(message, str) and CLEAR_EVENT in message and self._clear_asked(message):
                continue  # answered here: the driver knows nothing of the track
            yield message

    # The voice.

    def _clear_asked(self, message: str) -> bool:
        """The client's `output_audio_buffer.clear`: silence now, and no more of the response in progress's audio;
        `cleared` names the response cut (or the last one that spoke, when nothing was playing)."""
        if not self.speaks or len(message) > 1024:
            return False
        try:
            data = json.loads(message)
        except ValueError:
            return False
        if not (isinstance(data, dict) and data.get("type") == CLEAR_EVENT):
            return False
        self._cut_voice(always=True)
        return True

    def _cut_voice(self, *, always: bool = False) -> None:
        self.voice.clear(always=always)  # first: it names the response whose sound it cuts
        current = self.session.answers.current
        if current is not None:
            self.voice.mute(current.response_id)  # its later audio too, even if none was buffered yet

    def _observe(self, event: Event) -> None:
        """Every event on its way out (the driver's writer): barge-in clears the track the moment the session
        reports the speech that cuts the answer short."""
        if self.observe is not None:
            self.observe(event)
        if isinstance(event, SpeechStarted) and self.speaks:
            detection = self.session.settings.config.turn_detection
            if detection is not None and detection.interrupt_response:
                self._cut_voice()

    def _on_buffer_event(self, kind: str, response_id: str) -> None:
        """From the track, on the loop (it must not wait): queued for the session's event channel."""
        cls = OutputAudioBufferStarted if kind == STARTED else (
            OutputAudioBufferCleared if kind == CLEARED else OutputAudioBufferStopped)
        try:
            self.buffer_events.put_nowait(cls(response_id=response_id, media_time=self.session.media_time))
        except asyncio.QueueFull:  # the session's events have been stuck for dozens of responses: the peer is gone
            log.warning("session %s: dropped %s (%s): the event channel is not moving", self.session.id, kind,
                        response_id)

    async def _emit_buffer_events(self) -> None:
        while True:
            await self.session.emit(await self.buffer_events.get())

    async def _send(self, text: str) -> None:
        await self.channel_open.wait()
        channel = self.channel
        assert channel is not None
        while channel.bufferedAmount > HIGH_WATER and channel.readyState == "open":
            low = asyncio.Event()
            channel.once("bufferedamountlow", low.set)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(low.wait(), 1.0)  # also re-checks readyState once a second
        if channel.readyState != "open":
            raise ConnectionError("the events data channel closed")
        channel.send(text)

    # Media.

    def _media_start(self) -> float:
        if self.t0 is None:
            self.t0 = time.monotonic()
        return self.t0

    async def _consume_audio(self, track: MediaStreamTrack) -> None:
        """Decode, resample and buffer the microphone. The audio clock is the sample count, so a stretch the
        peer did not send (a network stall, a track paused with replaceTrack) comes in as silence as long as
        its RTP timestamps say, or captions would fall behind the video's wall-clock times for good."""
        resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
        next_pts: float | None = None  # where the next frame should start, in seconds of its stream
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            self._media_start()
            if frame.pts is not None and frame.time_base is not None:
                start = float(frame.pts * frame.time_base)
                gap = start - next_pts if next_pts is not None else 0.0
                if MIN_AUDIO_GAP_S <= gap <= MAX_AUDIO_GAP_S:
                    self.audio_buffer.append(round(gap * SAMPLE_RATE))
                    self.audio_silence += self.audio_buffer[-1]
                next_pts = start + frame.samples / frame.sample_rate
            for out in resampler.resample(frame):
                self._buffer_audio(out.to_ndarray().reshape(-1).astype(np.float32) / 32768.0)
            self.audio_ready.set()

    def _buffer_audio(self, samples: np.ndarray) -> None:
        """Queue samples for the session; past `serve.webrtc_audio_buffer_s` the pipeline is far behind a
        live peer that cannot be slowed, and the oldest audio is dropped (counted in `metrics`)."""
        self.audio_buffer.append(samples)
        self.audio_buffered += len(samples)
        limit = int(self.profile.serve.webrtc_audio_buffer_s * SAMPLE_RATE)
        while self.audio_buffered > limit:  # the oldest audio goes; a gap's silence stays, or the clock would slip
            oldest = next(i for i, item in enumerate(self.audio_buffer) if not isinstance(item, int))
            dropped = self.audio_buffer[oldest]
            del self.audio_buffer[oldest]
            self.audio_buffered -= len(dropped)  # type: ignore[arg-type]
            self.stats.audio_dropped_s += len(dropped) / SAMPLE_RATE  # type: ignore[arg-type]
        self._report_upstream()

    def _report_upstream(self) -> None:
        self.stats.audio_buffered_s = (self.audio_buffered + self.audio_silence) / SAMPLE_RATE

    async def _feed_audio(self) -> None:
        await self.driver.started.wait()
        while True:
            await self.audio_ready.wait()
            self.audio_ready.clear()
            while self.audio_buffer:
                item = self.audio_buffer.popleft()
                if isinstance(item, int):  # a gap: its silence, a second at a time
                    for start in range(0, item, SAMPLE_RATE):
                        silent = min(SAMPLE_RATE, item - start)
                        self.audio_silence -= silent
                        self._report_upstream()
                        await self.driver.push_audio(np.zeros(silent, np.float32))
                    continue
                self.audio_buffered -= len(item)
                self._report_upstream()
                await self.driver.push_audio(item)

    async def _consume_video(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            self.latest_frame = (frame, time.monotonic() - self._media_start())  # only the latest is kept
            self.video_ready.set()

    async def _sample_video(self) -> None:
        await self.driver.started.wait()
        period, next_due = 1.0 / self.profile.video.fps, 0.0
        while True:
            await self.video_ready.wait()
            self.video_ready.clear()
            if self.latest_frame is None or self.latest_frame[1] < next_due:
                continue
            frame, media_time = self.latest_frame
            next_due = next_sample_due(next_due, media_time, period)
            image = await asyncio.to_thread(_to_rgb, frame, self.profile.video.max_side)
            self.session.push_video(VideoFrame(image, media_time))


def next_sample_due(due: float, taken: float, period: float) -> float:
    """When the next frame is due, given that one due at `due` was taken at `taken`: on the `period` grid, so
    a camera whose frames do not fall on it still gives `video.fps` on average (the frame's own time plus a
    period would lose up to one camera interval each time), unless the frames stopped for longer than a
    period, when the grid restarts at the frame taken (no burst of catch-up frames)."""
    return due + period if taken - due < period else taken + period


def _to_rgb(frame: av.VideoFrame, max_side: int) -> np.ndarray:
    width, height = scaled_size(frame.width, frame.height, max_side)
    return frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
