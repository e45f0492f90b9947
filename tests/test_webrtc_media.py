"""The WebRTC peer's media handling, piece by piece with the tiny models (no network): gaps in a microphone
track come in as silence so the audio clock keeps pace with the video's wall clock, audio dropped when the
models fall behind is counted in `metrics`, the frame sampler keeps `video.fps`, a data-channel append beside
a microphone track is refused without costing the session, and a flood refusal names the event it dropped."""

import asyncio
import fractions
import json

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError
from test_web_server import tiny  # noqa: F401  (the module-scoped models fixture)

from runtime.config import with_overrides
from runtime.session_builder import open_session
from runtime.session_state import TransportStats
from runtime.web.webrtc import INBOX_MESSAGES, WebRTCPeer, next_sample_due

# paced in real time with time-outs: `make test` runs these alone, after the rest (docs/testing.md)
pytestmark = pytest.mark.realtime

RATE = 48000
FRAME = 960  # 20 ms, as browsers send


class GappyMicrophone:
    """20 ms frames of a tone whose RTP clock jumps `gap_s` after `before_s`: the peer sent nothing then."""

    kind = "audio"

    def __init__(self, before_s: float, gap_s: float, after_s: float) -> None:
        n_before, n_after = round(before_s * RATE / FRAME), round(after_s * RATE / FRAME)
        self.pts = [i * FRAME for i in range(n_before)]
        self.pts += [round((before_s + gap_s) * RATE) + i * FRAME for i in range(n_after)]

    async def recv(self) -> av.AudioFrame:
        if not self.pts:
            raise MediaStreamError
        tone = (np.sin(np.arange(FRAME) * 0.05) * 8000).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(np.repeat(tone, 2).reshape(1, -1), format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self.pts.pop(0), fractions.Fraction(1, RATE)
        return frame


async def fed_samples(peer: WebRTCPeer) -> list[tuple[int, bool]]:
    """What the peer hands the session, as (samples, all silent) per push, once its buffer is empty."""
    pushed: list[tuple[int, bool]] = []

    async def push_audio(samples: np.ndarray) -> None:
        pushed.append((len(samples), not samples.any()))

    peer.driver.push_audio = push_audio  # type: ignore[method-assign]
    peer.driver.started.set()
    feeder = asyncio.create_task(peer._feed_audio())
    while peer.audio_buffer:
        await asyncio.sleep(0.01)
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    return pushed


async def _peer(profile, models, worker) -> WebRTCPeer:
    stats = TransportStats()
    return WebRTCPeer(await open_session(profile, models, worker, transport=stats), profile, stats)


@pytest.mark.asyncio
async def test_a_gap_in_the_microphone_track_comes_in_as_silence(tiny):  # noqa: F811
    profile, models, worker = tiny
    peer = await _peer(profile, models, worker)
    await peer._consume_audio(GappyMicrophone(before_s=1.0, gap_s=2.5, after_s=1.0))
    assert peer.audio_silence == 40000  # 2.5 s at 16 kHz, waiting as a count, not as samples
    assert peer.stats.audio_buffered_s == pytest.approx(4.5, abs=0.05)
    pushed = await fed_samples(peer)
    total = sum(n for n, _ in pushed)
    assert total == pytest.approx(4.5 * 16000, abs=800)  # the clock covers the gap: 4.5 s, not 2 s
    assert sum(n for n, silent in pushed if silent) >= 40000
    assert peer.stats.audio_buffered_s == 0.0
    await peer.pc.close()


@pytest.mark.asyncio
async def test_audio_dropped_behind_a_live_peer_is_counted_and_a_gap_survives_it(tiny):  # noqa: F811
    profile, models, worker = tiny
    small = with_overrides(profile, serve={"webrtc_audio_buffer_s": 0.5})
    peer = await _peer(small, models, worker)
    session = peer.session
    await peer._consume_audio(GappyMicrophone(before_s=1.0, gap_s=2.0, after_s=1.0))  # nobody feeds meanwhile
    assert peer.stats.audio_dropped_s == pytest.approx(1.5, abs=0.05)  # 2 s of sound, 0.5 s kept
    assert peer.audio_silence == 32000  # the gap's silence is not dropped: the clock must not slip
    assert session.metrics()["asr"]["dropped_s"] == pytest.approx(1.5, abs=0.05)
    assert session.metrics()["asr"]["lag_s"] == pytest.approx(2.5, abs=0.05)  # kept audio + the gap, unheard
    await peer.pc.close()


def test_the_frame_sampler_keeps_video_fps_from_a_camera_off_its_grid():
    def taken(times: list[float], period: float) -> list[float]:
        out, due = [], 0.0
        for t in times:
            if t >= due:
                out.append(t)
                due = next_sample_due(due, t, period)
        return out

    camera = [i / 5 + 0.013 for i in range(5 * 300)]  # 5 fps for 300 s, off the 1 s grid
    assert len(taken(camera, 1.0)) == 300  # the frame's time + period took 0.88 fps
    stalled = [t for t in camera if not 100 <= t < 110]  # the camera stops for 10 s
    after = [t for t in taken(stalled, 1.0) if t >= 110]
    assert all(b - a >= 1.0 - 1e-9 for a, b in zip(after, after[1:], strict=False))  # no catch-up burst


@pytest.mark.asyncio
async def test_a_data_channel_append_beside_a_microphone_track_is_refused_and_the_session_goes_on(tiny):  # noqa: F811
    profile, models, worker = tiny
    peer = await _peer(profile, models, worker)
    peer.driver.take_audio_from_track()  # as _on_track does when the offer has a microphone
    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    async def messages():
        silence = "AAAA" * 800  # 2400 bytes of pcm16 zeros, base64
        yield json.dumps({"type": "input_audio_buffer.append", "event_id": "a1", "audio": silence})
        yield json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "what was said?"}]}})
        yield json.dumps({"type": "response.create"})
        yield json.dumps({"type": "runtime.session.finish"})
        await asyncio.sleep(3600)  # the client stays; the driver ends once the session has drained

    assert await asyncio.wait_for(peer.driver.run(messages(), send), 120)
    errors = [e["error"] for e in sent if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("audio_from_track", "a1")]
    assert "response.done" in [e["type"] for e in sent] and sent[-1]["type"] == "runtime.metrics"
    await peer.pc.close()


@pytest.mark.asyncio
async def test_a_flood_refusal_names_the_event_it_dropped(tiny):  # noqa: F811
    profile, models, worker = tiny
    peer = await _peer(profile, models, worker)

    class Channel:
        readyState = "open"
        sent: list[str] = []

        def send(self, text: str) -> None:
            self.sent.append(text)

    peer.channel = Channel()  # type: ignore[assignment]
    for i in range(INBOX_MESSAGES + 1):
        peer._on_message(json.dumps({"type": "session.update", "event_id": f"u{i}", "session": {}}))
    (refusal,) = [json.loads(text)["error"] for text in Channel.sent]
    assert (refusal["code"], refusal["event_id"]) == ("rate_limited", f"u{INBOX_MESSAGES}")
    await peer.pc.close()
