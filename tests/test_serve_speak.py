"""`runtime serve --camera 0 --speak`: the local session's spoken answers played on an output device, and the
microphone gated while they play (runtime/io/playback.py, runtime/io/speech_gate.py).

No audio device in CI: a fake output records what it is given, a fake microphone yields loud chunks and moves a fake
wall clock to each chunk's end as it yields it, so which chunks the gate silences is exact, not timed."""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from cli_common import one_error_line, run_cli
from session_fakes import ScriptAnswerer, ToneVoice, WordASR, profile_for
from weights_common import packaged_or_skip

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.errors import DeviceNotFound, UserError
from runtime.events import ResponseAudioDelta, ResponseDone
from runtime.io.playback import AlsaOutput, LocalSpeech, Player, local_speech
from runtime.io.speech_gate import GatedSource, SpeechGate
from runtime.loaded_models import Models
from runtime.models.tts.voice import to_int16
from runtime.session_builder import open_session

CHUNK = SAMPLE_RATE // 10  # 100 ms
T0 = 1000.0  # the fake wall clock at media time 0


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class FakeOutput:
    """Records every write; `written` is set after each one."""

    rate = 24_000

    def __init__(self) -> None:
        self.pcm: list[np.ndarray] = []
        self.written = threading.Event()
        self.closed = False

    def write(self, pcm: np.ndarray) -> None:
        self.pcm.append(np.array(pcm, dtype=np.int16))
        self.written.set()

    def close(self) -> None:
        self.closed = True

    def samples(self) -> np.ndarray:
        return np.concatenate(self.pcm) if self.pcm else np.zeros(0, np.int16)


class FakeMicrophone:
    """`n` chunks of loud noise, 100 ms each; before yielding chunk k the clock reads its end (it was just
    recorded). `before(k)` runs before chunk k is yielded (after the consumer took chunk k - 1)."""

    description, duration, speed = "fake microphone", None, 0.0

    def __init__(self, n: int, clock: FakeClock, before=None) -> None:
        self.n, self.clock, self.before = n, clock, before
        rng = np.random.default_rng(0)
        self.chunks = [AudioChunk((0.3 * rng.standard_normal(CHUNK)).astype(np.float32), k * CHUNK)
                       for k in range(n)]

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[AudioChunk]:
        for k, chunk in enumerate(self.chunks):
            if self.before is not None:
                await self.before(k)
            self.clock.now = T0 + chunk.end
            yield chunk

    async def aclose(self) -> None:
        pass


def delta(pcm: np.ndarray, response_id: str = "resp_1") -> ResponseAudioDelta:
    return ResponseAudioDelta(response_id=response_id, item_id="item_1",
                              delta=base64.b64encode(pcm.astype("<i2").tobytes()).decode())


@pytest.mark.asyncio
async def test_the_gate_silences_the_microphone_while_the_voice_plays_and_not_after() -> None:
    clock, output = FakeClock(), FakeOutput()
    gate = SpeechGate(hangover_s=0.3, clock=clock)
    player = Player(output, gate)
    answer = (np.arange(output.rate) % 200 - 100).astype(np.int16)  # 1.0 s of a saw tooth

    async def before(k: int) -> None:
        if k == 10:  # media 1.0 s: the answer starts playing
            player.on_event(delta(answer))
            await asyncio.to_thread(output.written.wait, 5)

    mic = FakeMicrophone(30, clock, before)
    gated = GatedSource(mic, gate)
    out = [chunk async for chunk in gated]
    player.close(play_rest=True)
    silent = [k for k, chunk in enumerate(out) if not chunk.samples.any()]
    # sound from 1.0 s to 2.0 s, gated 0.3 s more: chunks [1.0, 1.1) ... [2.2, 2.3)
    assert silent == list(range(10, 23))
    for k in (*range(10), *range(23, 30)):  # before and after: the microphone's samples, untouched
        np.testing.assert_array_equal(out[k].samples, mic.chunks[k].samples)
    assert [c.start_sample for c in out] == [c.start_sample for c in mic.chunks]  # the media clock runs on
    assert gated.gated_s == pytest.approx(1.3)
    np.testing.assert_array_equal(output.samples(), answer)  # played as sent


def test_a_write_while_sound_plays_extends_it_one_after_a_gap_opens_another() -> None:
    clock = FakeClock()
    gate = SpeechGate(hangover_s=0.0, clock=clock)
    gate.playing(0.5)  # [T0, T0 + 0.5)
    clock.now = T0 + 0.2
    gate.playing(0.5)  # lands while playing: after it, to T0 + 1.0
    assert gate.speaking_until() == pytest.approx(T0 + 1.0)
    clock.now = T0 + 3.0
    gate.playing(0.1)
    assert gate.closed(T0 + 0.9, T0 + 1.0) and not gate.closed(T0 + 1.0, T0 + 2.9)
    assert gate.closed(T0 + 3.05, T0 + 3.2)


def test_a_cancelled_answer_stops_and_a_full_queue_drops_the_newest() -> None:
    output = FakeOutput()
    taken, release = threading.Event(), threading.Event()
    # a device whose buffer is full until `release`
    output.write = lambda pcm, write=output.write: (taken.set(), release.wait(5), write(pcm))
    player = Player(output, SpeechGate(), max_queued_s=1.0)
    second = np.full(output.rate // 2, 7, np.int16)
    player.on_event(delta(np.full(output.rate // 2, 5, np.int16), "resp_a"))
    assert taken.wait(5)  # the player took it and waits on the device
    player.on_event(delta(np.full(output.rate // 2, 6, np.int16), "resp_a"))  # queued
    player.on_event(delta(second, "resp_b"))
    player.on_event(delta(second, "resp_b"))  # 0.5 s + 0.5 s + 0.5 s queued > 1.0 s: one is dropped
    player.on_event(ResponseDone(response={"id": "resp_a", "status": "cancelled"}))
    release.set()
    player.close(play_rest=True)
    played = output.samples()
    assert player.dropped_s == pytest.approx(0.5)
    assert set(np.unique(played)) <= {5, 7} and (played == 6).sum() == 0  # the cancelled rest never plays
    assert output.closed


@pytest.mark.asyncio
async def test_the_played_audio_is_what_the_voice_synthesised(worker) -> None:
    class Voice24k(ToneVoice):
        sample_rate = 24_000  # the output's rate: no resampling, so the played samples are the voice's own

    voice, output = Voice24k(), FakeOutput()
    models = Models(WordASR(per_item=1000), ScriptAnswerer("One two three, four five six seven. Eight nine."),
                    voice=voice)
    speech = LocalSpeech(output, gate_microphone=True)
    profile = profile_for()
    config = speech.config(profile, models)
    assert config.output_modalities == ("audio",) and config.speech().format.rate == output.rate
    session = await (await open_session(profile, models, worker, config=config)).start()
    hook = speech.publish(None)

    async def consume() -> None:
        async for event in session.events:
            hook(event)

    consumer = asyncio.create_task(consume())
    await session.ask("count", wait=True)
    await session.finish()
    await consumer
    speech.player.close(play_rest=True)
    assert len(voice.spoken) == 3
    expected = np.concatenate([to_int16(voice.synthesize(clause).samples) for clause in voice.spoken[:3]])
    np.testing.assert_array_equal(output.samples(), expected)
    assert speech.player.played_s == pytest.approx(len(expected) / output.rate)


def test_the_null_alsa_device_plays_and_a_missing_one_is_one_line() -> None:
    from runtime.io.devices import device_backends

    if "alsa" not in device_backends():
        pytest.skip("this PyAV build has no alsa")
    out = AlsaOutput("null")  # alsa-lib's device that discards what it is given
    out.write(np.zeros(2400, np.int16))
    out.close()
    with pytest.raises(DeviceNotFound, match="no speaker 'no-such-speaker'"):
        AlsaOutput("no-such-speaker")


def test_speak_needs_a_local_source(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UserError, match="--camera N, --mic NAME or --source FILE"):
        local_speech(argparse.Namespace(speaker="null", source=None, no_mic=False), None)
    code, _, err = run_cli(capsys, "serve", "--speak", "--profile", "tiny", "--port", "0")
    assert code == 1 and "--speak" in one_error_line(err)
    assert "models ready" not in err  # refused before any model loaded


@pytest.mark.slow
def test_serve_source_speak_answers_aloud_on_the_null_device(demo_file) -> None:
    """The whole CLI path on alsa-lib's `null` device: the file's spoken turns and a typed question are answered,
    spoken, played, and their words printed (the tiny profile's random model says noise; the voice speaks it)."""
    from runtime.io.devices import device_backends

    packaged_or_skip("piper-en-us-joe-medium")
    if "alsa" not in device_backends():
        pytest.skip("this PyAV build has no alsa")
    done = subprocess.run([sys.executable, "-m", "runtime", "serve", "--source", str(demo_file), "--speed", "4",
                           "--speak", "--speaker", "null", "--profile", "tiny", "--set", "lm.max_new_tokens=6",
                           "--port", "0"], input="what moved?\n", capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("A: ") >= 2 and "Q: what moved?" in done.stdout  # turns and the typed question
    spoke = [line for line in done.stderr.splitlines() if "spoke " in line and "s of answers" in line]
    assert len(spoke) == 1 and float(spoke[0].split("spoke ")[1].split(" s")[0]) > 0.5, done.stderr
