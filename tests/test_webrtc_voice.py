"""The agent's voice over a real WebRTC connection: an aiortc peer in this process (standing in for a browser) offers
to receive audio, asks for a spoken answer on the `events` data channel and plays the server's audio track. The
server runs stand-ins (`session_fakes`): a scripted answerer and a tone voice whose every word is a known length, so
how long the answer sounds is known. Checked: the sound arrives on the track (no audio deltas on the data channel),
`output_audio_buffer.started/stopped` frame it, `output_audio_buffer.clear` silences it, and barge-in (the real Silero
VAD on real speech sent as the microphone) silences it within 200 ms and truncates the answer to what the track
played. Every event validates strictly against the `openai` SDK's models."""

from __future__ import annotations

import asyncio
import fractions
import json
import time

import av
import numpy as np
import pytest
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from session_fakes import ScriptAnswerer, ToneVoice, WordASR, profile_for
from test_spoken_answers import check
from test_webrtc import post

from runtime.io.sample import demo_speech
from runtime.loaded_models import Models, load_turn_models
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker

# paced in real time with time-outs: `make test` runs these alone, after the rest (docs/testing.md)
pytestmark = [pytest.mark.asyncio, pytest.mark.realtime]

COUNTING = "One two three four five six seven eight nine ten."  # 1.0 s at 0.1 s a word
LOUD = 0.02  # RMS of a 20 ms frame (full scale 1) above which it holds sound; the tone voice plays at 0.3


class Microphone(MediaStreamTrack):
    """48 kHz stereo 20 ms frames, paced: silence until `say` queues speech (16 kHz float)."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.queued = np.zeros(0, np.int16)
        self.sent, self.start = 0, None

    def say(self, speech16k: np.ndarray) -> None:
        self.queued = np.round(np.clip(np.repeat(speech16k, 3), -1, 1) * 32767).astype(np.int16)

    async def recv(self) -> av.AudioFrame:
        if self.start is None:
            self.start = time.monotonic()
        block, self.queued = self.queued[:960], self.queued[960:]
        block = np.pad(block, (0, 960 - len(block)))
        frame = av.AudioFrame.from_ndarray(np.repeat(block, 2).reshape(1, -1), format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = 48000, self.sent, fractions.Fraction(1, 48000)
        self.sent += 960
        await asyncio.sleep(max(0.0, self.start + self.sent / 48000 - time.monotonic()))
        return frame


class Browser:
    """The peer: its microphone, the events it got (checked) and the voice it heard, frame by frame as
    (arrival time, RMS, the frame's place in the stream in seconds)."""

    def __init__(self) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Microphone()
        self.pc.addTrack(self.mic)  # sendrecv: the offer can receive the server's voice on the same transceiver
        self.channel = self.pc.createDataChannel("events")
        self.arrived = asyncio.Event()
        self.events: list[tuple[float, dict]] = []
        self.taken: dict[str, int] = {}  # events of each kind `next` has returned
        self.heard: list[tuple[float, float, float]] = []
        self.listening: asyncio.Task | None = None
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)

    def _on_message(self, message: str) -> None:
        event = json.loads(message)
        check(event)
        self.events.append((time.monotonic(), event))
        self.arrived.set()

    def _on_track(self, track) -> None:
        if track.kind == "audio":
            self.listening = asyncio.create_task(self._listen(track))

    async def _listen(self, track) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            samples = frame.to_ndarray().astype(np.float32) / 32768
            rms = float(np.sqrt(np.mean(samples**2)))
            self.heard.append((time.monotonic(), rms, float(frame.pts * frame.time_base)))

    async def connect(self, port: int) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        offer = json.dumps({"sdp": self.pc.localDescription.sdp, "type": "offer"}).encode()
        status, answer = await asyncio.to_thread(post, port, offer)
        assert status == 200, answer
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        await self.next("session.created")

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    async def next(self, kind: str, timeout: float = 30.0) -> dict:
        """The next event of `kind` not yet returned, in arrival order (whatever other kinds came between)."""
        async with asyncio.timeout(timeout):
            while True:
                of_kind = [e for _, e in self.events if e["type"] == kind]
                if len(of_kind) > self.taken.get(kind, 0):
                    self.taken[kind] = self.taken.get(kind, 0) + 1
                    return of_kind[self.taken[kind] - 1]
                self.arrived.clear()
                await self.arrived.wait()

    def received(self, kind: str) -> float:
        """When the first event of `kind` arrived."""
        return next(t for t, e in self.events if e["type"] == kind)

    def loud(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        return [t for t, rms, _ in self.heard if rms > LOUD and start <= t < end]

    def last_sound_on_time(self) -> float:
        """When the last loud frame would have arrived had it been no later than the stream's most punctual frame:
        its arrival less its lateness in this peer's own receive path (aiortc's jitter buffer and decoder thread,
        which share this process with the server's device worker and can fall behind the data channel on a loaded
        machine). The constant part of the path (the jitter buffer's 80 ms prefetch) stays in."""
        lags = [arrived - at for arrived, _, at in self.heard]
        last = max(i for i, (_, rms, _) in enumerate(self.heard) if rms > LOUD)
        return self.heard[last][0] - (lags[last] - min(lags))

    async def ask(self, text: str) -> None:
        self.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        self.send({"type": "response.create"})

    async def close(self) -> None:
        await self.pc.close()
        if self.listening is not None:
            await asyncio.gather(self.listening, return_exceptions=True)


async def serve(answerer, voice, turns=None) -> tuple[RealtimeServer, DeviceWorker]:
    worker = DeviceWorker().start()
    models = Models(WordASR(per_item=1000), answerer, turns=turns, voice=voice)
    return await RealtimeServer(profile_for(metrics_interval_s=0), models, worker, port=0).start(), worker


async def test_the_answer_is_spoken_on_the_track_framed_by_the_buffer_events() -> None:
    server, worker = await serve(ScriptAnswerer(COUNTING), ToneVoice())
    browser = Browser()
    try:
        await browser.connect(server.port)
        browser.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"]}})
        await browser.next("session.updated")
        await asyncio.sleep(0.5)  # silence before the answer
        await browser.ask("count to ten")
        started = await browser.next("output_audio_buffer.started")
        done = (await browser.next("response.done"))["response"]
        stopped = await browser.next("output_audio_buffer.stopped")
        await asyncio.sleep(0.3)
        t_start, t_stop = browser.received("output_audio_buffer.started"), browser.received(
            "output_audio_buffer.stopped")
        loud = browser.loud()
    finally:
        await browser.close()
        await server.stop()
        worker.stop()
    assert done["status"] == "completed" and started["response_id"] == stopped["response_id"] == done["id"]
    assert done["output"][0]["content"][0] == {"type": "output_audio", "transcript": COUNTING}
    kinds = [e["type"] for _, e in browser.events]
    assert "response.output_audio.delta" not in kinds  # the audio is on the track, not on the data channel
    assert kinds.index("response.output_audio_transcript.done") < kinds.index("output_audio_buffer.stopped")
    assert kinds.index("response.done") < kinds.index("output_audio_buffer.stopped")  # all sent, then drained
    assert loud, "no sound on the track"
    assert not browser.loud(end=t_start - 0.1)  # quiet before the answer
    # paced at real time: the 1.0 s answer sounds for about 1 s (20 ms frames), between started and stopped
    assert 0.9 <= len(loud) * 0.02 <= 1.1, len(loud)
    # the events are sent as the frames go out; the sound comes through the receiver's jitter buffer, ~0.1 s later
    assert t_start - 0.05 <= loud[0] <= t_start + 0.25 and loud[-1] <= t_stop + 0.25
    assert 0.85 <= t_stop - t_start <= 2.0  # about 1 s; the upper bound leaves room for a loaded machine


async def test_output_audio_buffer_clear_silences_the_answer_at_once() -> None:
    long = " ".join([COUNTING] * 6)  # 6 s of sound
    server, worker = await serve(ScriptAnswerer(long), ToneVoice())
    browser = Browser()
    try:
        await browser.connect(server.port)
        browser.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"]}})
        await browser.next("session.updated")
        await browser.ask("count")
        started = await browser.next("output_audio_buffer.started")
        await browser.next("response.done")  # the whole answer is made (faster than real time) and waits to play
        await asyncio.sleep(0.6)
        asked = time.monotonic()
        browser.send({"type": "output_audio_buffer.clear", "event_id": "clear_1"})
        cleared = await browser.next("output_audio_buffer.cleared")
        await asyncio.sleep(0.5)
        loud_after = browser.loud(start=asked + 0.2)
    finally:
        await browser.close()
        await server.stop()
        worker.stop()
    assert cleared["response_id"] == started["response_id"]
    assert not loud_after, f"sound {loud_after[-1] - asked:.2f} s after the clear"
    assert not [e for _, e in browser.events if e["type"] in ("error", "output_audio_buffer.stopped")]


@pytest.fixture(scope="module")
def turn_models():
    models = load_turn_models()
    assert models is not None, "make install installs the turn-detection models (pipecat-ai, requirements/weights.txt)"
    return models


@pytest.mark.parametrize("writing", [False, True], ids=["answer-written-still-playing", "answer-still-written"])
async def test_barge_in_silences_the_track_and_truncates_to_what_it_played(turn_models, writing) -> None:
    """Speech over the answer: the track goes quiet within 200 ms of the detection, and the answer is cut to what the
    track played, whether it was still being written (then it is cancelled) or was written whole and is still playing
    (the usual case here: synthesis outruns playback and the track's buffer holds the rest)."""
    # 40 words of 0.3 s (12 s of sound) written at once, or 120 (36 s) written over 7 s in short steps (a step holds
    # the device worker, and the VAD's jobs wait behind it: long steps would delay the detection by seconds)
    long = " ".join([COUNTING] * (12 if writing else 4))
    answerer = ScriptAnswerer(long, step_s=0.06 if writing else 0.0)
    server, worker = await serve(answerer, ToneVoice(word_s=0.3), turns=turn_models)
    browser = Browser()
    vad = {"type": "server_vad", "create_response": False, "interrupt_response": True}
    try:
        await browser.connect(server.port)
        browser.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"],
                                                            "audio": {"input": {"turn_detection": vad}}}})
        await browser.next("session.updated")
        await browser.ask("count slowly")
        started = await browser.next("output_audio_buffer.started")
        await asyncio.sleep(1.5)
        browser.mic.say(demo_speech()[: int(2.5 * 16_000)])  # the user talks over the answer
        await browser.next("input_audio_buffer.speech_started")
        cleared = await browser.next("output_audio_buffer.cleared")
        done = (await browser.next("response.done"))["response"]
        truncated = await browser.next("conversation.item.truncated")
        await asyncio.sleep(0.4)
    finally:
        await browser.close()
        await server.stop()
        worker.stop()
    detected = browser.received("input_audio_buffer.speech_started")
    assert cleared["response_id"] == started["response_id"] == done["id"]
    if writing:
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    else:
        assert done["status"] == "completed" and browser.received("response.done") < detected
    assert truncated["item_id"] == done["output"][0]["id"]
    assert not [e for _, e in browser.events if e["type"] in ("error", "output_audio_buffer.stopped")]
    loud = browser.loud()
    # sound stops within 200 ms of the detection, as a punctual receiver hears it (unloaded: 0.11-0.13 s either way)
    went_on = browser.last_sound_on_time() - detected
    assert went_on <= 0.2, f"sound went on {went_on:.2f} s after the speech was detected"
    assert loud[-1] - detected <= 0.5, f"sound arrived {loud[-1] - detected:.2f} s after the speech was detected"
    # the cut is what the track played (to its 20 ms frames), not the 12 s made, nor the input clock's guess
    heard_ms = len(loud) * 20
    assert 1500 <= truncated["audio_end_ms"] <= 8000  # speech at 1.5 s, detected within the VAD's windows
    assert abs(truncated["audio_end_ms"] - heard_ms) <= 100, (truncated["audio_end_ms"], heard_ms)
