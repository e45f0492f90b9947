"""WebRTC through the real server with the tiny models: an aiortc peer (standing in for a browser) sends speech
and frames as media tracks and asks over the `events` data channel; transcript and answer events come back on
it with media times, and closing the peer leaves no session behind. Plus the signalling endpoint's refusals
and the demo page's files."""

import asyncio
import fractions
import json
import time
import urllib.error
import urllib.request

import av
import numpy as np
import pytest
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from test_web_server import tiny, wait_until  # noqa: F401  (the module-scoped models fixture)

from runtime.io.sample import demo_speech, render_frame
from runtime.web.server import RealtimeServer

# paced in real time with time-outs: `make test` runs these alone, after the rest (docs/testing.md)
pytestmark = pytest.mark.realtime


class SpeechTrack(MediaStreamTrack):
    """The demo speech as a browser sends a microphone: 48 kHz stereo s16, 20 ms frames, paced in real time."""

    kind = "audio"

    def __init__(self, seconds: float) -> None:
        super().__init__()
        speech = demo_speech()[: int(seconds * 16000)]
        upsampled = np.repeat(speech, 3)  # 16 -> 48 kHz; crude, but the server's resampler sees real 48 kHz
        self.pcm = np.round(np.clip(upsampled, -1, 1) * 32767).astype(np.int16)
        self.sent, self.start = 0, None

    async def recv(self) -> av.AudioFrame:
        if self.start is None:
            self.start = time.monotonic()
        n = 960
        block = self.pcm[self.sent : self.sent + n]
        if len(block) < n:
            block = np.zeros(n, np.int16)  # silence after the speech, like an open microphone
        stereo = np.repeat(block, 2).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(stereo, format="s16", layout="stereo")
        frame.sample_rate, frame.pts, frame.time_base = 48000, self.sent, fractions.Fraction(1, 48000)
        self.sent += n
        await asyncio.sleep(max(0.0, self.start + self.sent / 48000 - time.monotonic()))
        return frame


class CameraTrack(MediaStreamTrack):
    kind = "video"

    def __init__(self) -> None:
        super().__init__()
        self.count, self.start = 0, None

    async def recv(self) -> av.VideoFrame:
        if self.start is None:
            self.start = time.monotonic()
        t = self.count / 5
        await asyncio.sleep(max(0.0, self.start + t - time.monotonic()))
        frame = av.VideoFrame.from_ndarray(render_frame(t, 320, 240), format="rgb24")
        frame.pts, frame.time_base = self.count * 18000, fractions.Fraction(1, 90000)
        self.count += 1
        return frame


def post(port: int, body: bytes, *, path: str = "/v1/webrtc/offer", headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def connect_peer(port: int, seconds: float = 4.0) -> tuple[RTCPeerConnection, asyncio.Queue, object]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTrack(SpeechTrack(seconds))
    pc.addTrack(CameraTrack())
    channel = pc.createDataChannel("events")
    events: asyncio.Queue = asyncio.Queue()
    channel.on("message", lambda message: events.put_nowait(json.loads(message)))
    await pc.setLocalDescription(await pc.createOffer())  # aiortc gathers every candidate here: no trickle
    offer = json.dumps({"sdp": pc.localDescription.sdp, "type": pc.localDescription.type}).encode()
    status, answer = await asyncio.to_thread(post, port, offer)
    assert status == 200, answer
    assert answer["type"] == "answer" and answer["session_id"].startswith("sess_")
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    return pc, events, channel


async def next_event(events: asyncio.Queue, kind: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        event = await asyncio.wait_for(events.get(), max(0.1, deadline - time.monotonic()))
        if event["type"] == kind:
            return event


@pytest.mark.asyncio
async def test_a_peer_streams_speech_and_frames_and_gets_captions_and_an_answer(tiny):  # noqa: F811
    async with RealtimeServer(*tiny, port=0) as server:
        pc, events, channel = await connect_peer(server.port)
        try:
            created = await next_event(events, "session.created")
            assert len(server.sessions) == 1 and created["session"]["id"] in server.sessions
            delta = await next_event(events, "conversation.item.input_audio_transcription.delta")
            assert 0 <= delta["start"] <= delta["end"] <= 6.0
            channel.send(json.dumps({"type": "conversation.item.create", "event_id": "q1", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "what moved?"}]}}))
            channel.send(json.dumps({"type": "response.create", "event_id": "q2"}))
            answer = await next_event(events, "response.output_text.delta")
            assert answer["delta"]
            done = await next_event(events, "response.done")
            assert done["response"]["status"] in ("completed", "incomplete")
            channel.send("not json")
            error = await next_event(events, "error")
            assert error["error"]["code"] == "invalid_json"
            session = server.sessions[created["session"]["id"]]
            await wait_until(lambda: session.metrics()["video"]["frames_in"] >= 2)  # frames came as video
            assert session.metrics()["asr"]["pushed_until"] > 1.0  # and audio through the audio track
        finally:
            await pc.close()
        await wait_until(lambda: not server.sessions and not server.peers, timeout=20)


@pytest.mark.asyncio
async def test_signalling_refusals(tiny):  # noqa: F811
    profile, models, worker = tiny
    async with RealtimeServer(profile, models, worker, port=0, max_sessions=1, token="s3cret") as server:
        port = server.port
        auth = {"Authorization": "Bearer s3cret"}
        cases = [
            (b'{"sdp": 1, "type": "offer"}', "/v1/webrtc/offer", auth, 400, "invalid_offer"),
            (b"not json", "/v1/webrtc/offer", auth, 400, "invalid_offer"),
            (b'{"sdp": "v=0 nonsense", "type": "offer"}', "/v1/webrtc/offer", auth, 400, "invalid_offer"),
            (b'{"sdp": "x", "type": "offer"}', "/v1/webrtc/offer", auth, 400, "invalid_offer"),  # no data channel
            (b'{"sdp": "v=0\\r\\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\\r\\n", "type": "offer"}',
             "/v1/webrtc/offer", auth, 400, "invalid_offer"),  # one, but aiortc cannot use the rest
            (b'{"sdp": "v=0\\r\\nm=application 9 x\\r\\n", "type": "offer"}', "/v1/webrtc/offer", auth, 400,
             "invalid_offer"),  # aiortc refuses it with an exception that has no text
            (b'{"sdp": "", "type": "answer"}', "/v1/webrtc/offer", auth, 400, "invalid_offer"),
            (b"{}", "/v1/webrtc/offer", {}, 401, "unauthorized"),
            (b"{}", "/v1/webrtc/offer", {"Authorization": "Bearer nope"}, 401, "unauthorized"),
            (b"{}", "/v1/webrtc/offer", {**auth, "Origin": "http://evil.example"}, 403, "origin_not_allowed"),
            (b"{}", "/v1/other", auth, 404, "not_found"),
        ]
        for body, path, headers, status, code in cases:
            got_status, got = await asyncio.to_thread(post, port, body, path=path, headers=headers)
            assert (got_status, got["error"]["code"]) == (status, code), (body, path, got)
            assert got["type"] == "error" and got["error"]["message"] and not got["error"]["message"].endswith(": ")
        assert not server.sessions  # a refused offer leaves nothing behind
        status, _ = await asyncio.to_thread(post, port, b"x" * (300 * 1024), headers=auth)
        assert status == 413
        # The one session slot taken by a peer: the next offer is refused as busy.
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.createDataChannel("events")
        await pc.setLocalDescription(await pc.createOffer())
        unsigned = "".join(line for line in pc.localDescription.sdp.splitlines(keepends=True)
                           if not line.startswith("a=fingerprint:"))
        status, refused = await asyncio.to_thread(post, port, json.dumps({"sdp": unsigned, "type": "offer"}).encode(),
                                                  headers=auth)
        assert (status, refused["error"]["code"]) == (400, "invalid_offer") and not server.sessions
        offer = json.dumps({"sdp": pc.localDescription.sdp, "type": "offer"}).encode()
        assert (await asyncio.to_thread(post, port, offer, headers=auth))[0] == 200
        status, busy = await asyncio.to_thread(post, port, offer, headers=auth)
        assert (status, busy["error"]["code"]) == (503, "server_busy")
        await pc.close()
    assert not server.sessions and not server.peers


@pytest.mark.asyncio
async def test_the_demo_page_is_served(tiny):  # noqa: F811
    async with RealtimeServer(*tiny, port=0) as server:
        def get(path: str) -> tuple[int, str, bytes]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as response:
                    return response.status, response.headers["Content-Type"], response.read()
            except urllib.error.HTTPError as err:
                return err.code, err.headers["Content-Type"], err.read()

        status, kind, body = await asyncio.to_thread(get, "/")
        assert status == 200 and kind.startswith("text/html") and b"webrtc/offer" in body + (
            await asyncio.to_thread(get, "/static/app.js"))[2]
        status, kind, _ = await asyncio.to_thread(get, "/static/app.js")
        assert status == 200 and "javascript" in kind
        for path in ("/static/nope.js", "/static/../server.py", "/static/%2e%2e/server.py", "/elsewhere"):
            assert (await asyncio.to_thread(get, path))[0] == 404, path


@pytest.mark.asyncio
async def test_peers_that_vanish_mid_stream_leave_nothing_behind(tiny):  # noqa: F811
    import gc
    import weakref

    async with RealtimeServer(*tiny, port=0) as server:
        sessions = []
        for _ in range(10):
            pc, events, _ = await connect_peer(server.port, seconds=2.0)
            await next_event(events, "session.created")
            sessions.append(weakref.ref(next(iter(server.sessions.values()))))
            await asyncio.sleep(0.3)  # media flowing
            await pc.close()  # no goodbye on the data channel: the transport just goes
            await wait_until(lambda: not server.sessions and not server.peers, timeout=20)
        await wait_until(lambda: not [t for t in asyncio.all_tasks() if "sess_" in t.get_name()], timeout=10)
    gc.collect()
    assert not [ref for ref in sessions if ref() is not None], "sessions still referenced after their peers left"
