"""The voice's WebRTC track on its own (runtime/web/voice_track.py), on a fake clock: one 20 ms frame per 20 ms, silence
when nothing plays, a late loop caught up and a very late one restarted; the buffered audio played in order with its
played clock; `output_audio_buffer.started/stopped/cleared` at the right frames; a clear silences the next frame and
drops the rest of the response; a full buffer makes `play` wait."""

import asyncio

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from runtime.web.voice_track import CLEARED, FRAME, RATE, STARTED, STOPPED, VoiceTrack

pytestmark = pytest.mark.asyncio


class FakeClock:
    """Time that passes only when the track sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def tone(ms: int, level: int = 8000) -> bytes:
    """`ms` of a constant non-zero level, as the speaker hands it over (24 kHz PCM16)."""
    return np.full(RATE * ms // 1000, level, dtype="<i2").tobytes()


def make_track(buffer_s: float = 60.0) -> tuple[VoiceTrack, FakeClock, list[tuple[str, str]]]:
    clock, events = FakeClock(), []
    track = VoiceTrack(lambda kind, rid: events.append((kind, rid)), buffer_s=buffer_s, clock=clock,
                       sleep=clock.sleep)
    return track, clock, events


async def frames(track: VoiceTrack, n: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        frame = await track.recv()
        assert (frame.sample_rate, frame.samples, frame.layout.name) == (RATE, FRAME, "mono")
        out.append(frame.to_ndarray().reshape(-1))
    return out


async def test_frames_are_paced_at_real_time_with_silence_when_nothing_plays() -> None:
    track, clock, events = make_track()
    got = [await track.recv() for _ in range(50)]
    assert [f.pts for f in got] == [i * FRAME for i in range(50)]
    assert clock.slept == pytest.approx([0.02] * 49)  # the first at once, then one every 20 ms
    assert not any(f.to_ndarray().any() for f in got) and not events
    clock.now += 0.1  # the loop was busy for 100 ms: the frames owed come at once, then the pace resumes
    slept = len(clock.slept)
    await frames(track, 6)
    assert clock.slept[slept:] == pytest.approx([0.02])
    clock.now += 5.0  # far behind (a stalled loop): the clock restarts instead of sending 5 s in a burst
    slept = len(clock.slept)
    await frames(track, 3)
    assert clock.slept[slept:] == pytest.approx([0.02, 0.02])


async def test_audio_plays_in_order_with_its_played_clock_and_events() -> None:
    track, _, events = make_track()
    await track.play("resp_a", "item_a", tone(50, 1000))
    await track.play("resp_a", "item_a", tone(50, 2000))
    assert track.buffered == 2400 and track.played_ms("item_a") == 0 and not events
    first = await frames(track, 1)
    assert events == [(STARTED, "resp_a")] and track.played_ms("item_a") == 20
    rest = await frames(track, 5)
    samples = np.concatenate(first + rest)
    assert (samples[:1200] == 1000).all() and (samples[1200:2400] == 2000).all() and not samples[2400:].any()
    assert track.played_ms("item_a") == 100 and track.buffered == 0
    assert events == [(STARTED, "resp_a")]  # drained, but more may come: not stopped yet
    track.end("resp_a", "item_a")
    assert events == [(STARTED, "resp_a"), (STOPPED, "resp_a")]

    # A response that ends before its audio has played stops when the audio has; the next one starts after it.
    await track.play("resp_b", "item_b", tone(30))
    track.end("resp_b", "item_b")
    await track.play("resp_c", "item_c", tone(30))
    await frames(track, 2)
    assert events[2:] == [(STARTED, "resp_b"), (STOPPED, "resp_b"), (STARTED, "resp_c")]
    assert (track.played_ms("item_b"), track.played_ms("item_c")) == (30, 10)
    track.end("resp_never", "item_never")  # sent no audio: nothing to stop
    assert len(events) == 5


async def test_clear_silences_the_next_frame_and_drops_the_rest_of_the_response() -> None:
    track, _, events = make_track()
    await track.play("resp_a", "item_a", tone(1000))
    await frames(track, 5)
    assert track.played_ms("item_a") == 100
    assert track.clear() == "resp_a"
    assert events == [(STARTED, "resp_a"), (CLEARED, "resp_a")] and track.buffered == 0
    assert not np.concatenate(await frames(track, 2)).any()
    await track.play("resp_a", "item_a", tone(200))  # made before the cancel reached the speaker: dropped
    track.end("resp_a", "item_a")
    assert track.buffered == 0 and track.played_ms("item_a") == 100 and len(events) == 2  # no stopped after a clear

    track.mute("resp_b")  # the response in progress, which has sent nothing yet
    await track.play("resp_b", "item_b", tone(100))
    assert track.buffered == 0
    assert track.clear() is None and len(events) == 2  # nothing played or waited: nothing to name
    assert track.clear(always=True) == "resp_a" and events[-1] == (CLEARED, "resp_a")  # the client asked: answered

    await track.play("resp_c", "item_c", tone(100))  # buffered, not yet playing: cleared all the same
    assert track.clear() == "resp_c" and track.buffered == 0 and events[-1] == (CLEARED, "resp_c")


async def test_a_full_buffer_makes_play_wait_until_enough_has_played() -> None:
    track, _, events = make_track(buffer_s=0.1)
    await track.play("resp_a", "item_a", tone(80))
    second = asyncio.create_task(track.play("resp_a", "item_a", tone(60)))
    await asyncio.sleep(0.01)
    assert not second.done() and track.buffered == 1920  # 80 + 60 ms would not fit in 100 ms
    await frames(track, 1)
    await asyncio.sleep(0.01)
    assert not second.done()  # 60 + 60 ms still would not
    await frames(track, 1)
    await asyncio.wait_for(second, 1.0)  # 40 + 60 ms does
    assert track.buffered == RATE * 100 // 1000
    # A piece longer than the whole buffer goes in once the buffer is empty, rather than never.
    longer = asyncio.create_task(track.play("resp_a", "item_a", tone(300)))
    await frames(track, 5)
    await asyncio.wait_for(longer, 1.0)
    # Stopping the track releases a waiting `play` (its audio is dropped) and ends the frames.
    waiting = asyncio.create_task(track.play("resp_a", "item_a", tone(50)))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    track.stop()
    await asyncio.wait_for(waiting, 1.0)
    with pytest.raises(MediaStreamError):
        await track.recv()
    assert events == [(STARTED, "resp_a")]


async def test_output_audio_buffer_clear_without_a_voice_track_is_an_error_that_says_so() -> None:
    """The WebRTC peer answers the event itself; elsewhere (the websocket, where the client plays the audio) it is
    refused with an error that says what to do instead."""
    from runtime.web.commands import ProtocolError
    from runtime.web.protocol import parse_client_event

    with pytest.raises(ProtocolError) as refused:
        parse_client_event('{"type": "output_audio_buffer.clear", "event_id": "c1"}')
    assert (refused.value.code, refused.value.event_id) == ("unsupported_event", "c1")
    assert "conversation.item.truncate" in str(refused.value)
