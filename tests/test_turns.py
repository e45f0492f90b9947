"""Turn detection: Silero VAD streaming, the server_vad / semantic_vad rule (`TurnDetector`) and Smart Turn.

The rule is tested on scripted probabilities, where every sample index is known; the models on the shipped
espeak demo speech (four sentences with ~0.4 s pauses between them, then ~0.4 s of silence).
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources

import numpy as np
import pytest
import soundfile
from weights_common import packaged_or_skip

from runtime.errors import CheckpointNotFound
from runtime.models import packaged
from runtime.pipeline.turn_detector import (
    EAGERNESS_MS,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    VADSettings,
)

W = 512  # samples per window
MS = 16  # samples per millisecond


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    with resources.as_file(resources.files("runtime.io") / "assets" / "demo_speech.flac") as path:
        audio, rate = soundfile.read(path, dtype="float32")
    assert rate == 16_000 and audio.ndim == 1  # as the asset's README says; a regenerated one must keep it
    return audio


@pytest.fixture(scope="module")
def vad():
    packaged_or_skip("silero-vad")
    from runtime.models.turns.silero_vad import SileroVAD

    return SileroVAD.load()


@pytest.fixture(scope="module")
def smart_turn():
    packaged_or_skip("smart-turn-v3.2")
    from runtime.models.turns.smart_turn import SmartTurn

    return SmartTurn.load()


# --- Silero VAD ---


def test_streaming_vad_equals_one_call_for_any_chunking(vad, speech):
    from runtime.models.turns.silero_vad import WINDOW_SAMPLES

    assert WINDOW_SAMPLES == W
    whole = vad.open_stream()
    expected = whole.accept(speech)
    assert expected.dtype == np.float32 and len(expected) == whole.windows_done == len(speech) // W
    rng = np.random.default_rng(7)
    for max_chunk in (1, 300, 513, 5000):
        stream = vad.open_stream()
        got, at = [], 0
        while at < len(speech):
            n = int(rng.integers(0, max_chunk + 1))  # empty chunks included
            before = stream.windows_done
            probs = stream.accept(speech[at:at + n])
            assert stream.windows_done == before + len(probs) == min(at + n, len(speech)) // W
            got.append(probs)
            at += n
        assert np.array_equal(np.concatenate(got), expected), max_chunk


def test_vad_hears_speech_and_not_silence_or_low_noise(vad, speech):
    probs = vad.open_stream().accept(speech)
    assert (probs >= 0.5).mean() > 0.7  # four sentences of ~2.5 s, pauses of ~0.8 s between them
    assert probs[300 // 32 : 2300 // 32].min() >= 0.5  # 0.3-2.3 s is all the first sentence
    assert probs[2500 // 32 : 2900 // 32].max() < 0.5  # then a pause
    assert vad.open_stream().accept(np.zeros(5 * 16_000, np.float32)).max() < 0.5
    noise = np.random.default_rng(0).normal(0, 0.003, 5 * 16_000).astype(np.float32)  # about -50 dBFS
    assert vad.open_stream().accept(noise).max() < 0.5


def test_vad_refuses_what_is_not_float_mono(vad):
    stream = vad.open_stream()
    with pytest.raises(ValueError, match="1-D float"):
        stream.accept(np.zeros(1024, np.int16))
    with pytest.raises(ValueError, match="1-D float"):
        stream.accept(np.zeros((2, 1024), np.float32))
    assert stream.accept(np.zeros(0, np.float32)).shape == (0,)


def test_server_vad_on_real_speech(vad, speech):
    """The sentence pauses (~0.8 s) are longer than the default 500 ms, so a turn each; at 1 s, one turn."""
    audio = np.concatenate([np.zeros(16_000, np.float32), speech, np.zeros(16_000, np.float32)])
    probs = vad.open_stream().accept(audio)
    onset = 16_000 + 220 * MS  # Flite's voice begins ~0.22 s into the recording
    events = TurnDetector(VADSettings(silence_duration_ms=1000)).push(probs, 0)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    assert abs(events[0].audio_start_sample - (onset - 300 * MS)) <= 2 * W
    assert abs(events[1].audio_end_sample - (16_000 + len(speech) - 0.4 * 16_000)) < 0.2 * 16_000
    events = TurnDetector(VADSettings()).push(probs, 0)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped] * 4


# --- the server_vad rule ---


def _probs(*runs: tuple[float, int]) -> list[float]:
    """(probability, number of windows), ... as one list."""
    return [p for p, n in runs for _ in range(n)]


def test_onset_is_padded_by_the_prefix_and_clamped_to_the_buffer():
    assert TurnDetector(VADSettings()).push(_probs((0, 20), (1, 1)), 0) == [SpeechStarted(20 * W - 300 * MS)]
    assert TurnDetector(VADSettings()).push(_probs((0, 3), (1, 1)), 0) == [SpeechStarted(0)]
    detector = TurnDetector(VADSettings(prefix_padding_ms=0))
    assert detector.push([0.0, 0.5], 40) == [SpeechStarted(41 * W)]  # the threshold itself is speech
    detector = TurnDetector(VADSettings())
    detector.reset(at_sample=10_000)
    assert detector.push(_probs((0, 1), (1, 1)), 20) == [SpeechStarted(10_000)]


def test_a_pause_shorter_than_silence_duration_does_not_stop():
    detector = TurnDetector(VADSettings(silence_duration_ms=500))
    assert detector.push(_probs((1, 10), (0, 15), (1, 5)), 0) == [SpeechStarted(0)]  # 15 windows = 480 ms
    assert detector.speaking


def test_stop_comes_once_the_silence_lasted_and_points_where_it_began():
    detector = TurnDetector(VADSettings(silence_duration_ms=500))
    assert detector.push(_probs((1, 10), (0, 15)), 0) == [SpeechStarted(0)]
    assert detector.push([0.0], 25) == [SpeechStopped(10 * W)]  # the 16th silent window: 512 ms >= 500 ms
    assert not detector.speaking and detector.push(_probs((0, 50)), 26) == []


def test_the_pause_being_timed_is_known_while_it_lasts():
    detector = TurnDetector(VADSettings(silence_duration_ms=500))
    assert detector.pause_start is None
    detector.push(_probs((1, 10), (0, 5)), 0)
    assert detector.pause_start == 10 * W  # where the silence began, before the rule has decided
    detector.push([1.0], 15)
    assert detector.pause_start is None  # speech went on
    detector.push(_probs((0, 16)), 16)
    assert not detector.speaking and detector.pause_start is None  # the rule ended the turn


def test_hysteresis():
    detector = TurnDetector(VADSettings(threshold=0.5, silence_duration_ms=500))
    assert detector.push(_probs((0.45, 30)), 0) == []  # below the threshold never starts
    assert detector.push([0.9], 30) == [SpeechStarted(30 * W - 300 * MS)]
    assert detector.push(_probs((0.36, 40)), 31) == []  # within 0.15 below it is still speech
    # a pause begins only below 0.35, and the band then keeps it running: 0.1 then fifteen 0.4s = 16 windows
    assert detector.push(_probs((0.1, 1), (0.4, 14)), 71) == []
    assert detector.push([0.4], 86) == [SpeechStopped(71 * W)]


def test_a_second_utterance_and_any_batching():
    probs = _probs((0, 20), (1, 30), (0, 20), (0.2, 5), (1, 10), (0, 40))
    expected = [SpeechStarted(20 * W - 300 * MS), SpeechStopped(50 * W),
                SpeechStarted(75 * W - 300 * MS), SpeechStopped(85 * W)]
    assert TurnDetector(VADSettings()).push(probs, 0) == expected
    detector, events, at = TurnDetector(VADSettings()), [], 0
    for n in (1, 7, 0, 33, 2, 50, 100):
        events += detector.push(probs[at:at + n], at)
        at += n
    assert events == expected


def test_reset_forgets_the_speech_and_the_audio_before_it():
    detector = TurnDetector(VADSettings())
    assert detector.push(_probs((1, 10), (0, 5)), 0) == [SpeechStarted(0)]
    detector.reset(at_sample=20 * W + 100)
    assert not detector.speaking
    assert detector.push(_probs((1, 20)), 0) == []  # windows ending before the buffer are not heard
    assert detector.push(_probs((0, 40)), 20) == []  # and no stop for the forgotten speech
    assert detector.push([1.0], 60) == [SpeechStarted(60 * W - 300 * MS)]
    detector.reset(at_sample=60 * W + 200)
    assert detector.push([1.0], 60) == [SpeechStarted(60 * W + 200)]  # a window straddling the start


# --- the semantic_vad rule ---


class FakeEndOfTurn:
    def __init__(self, probability: float) -> None:
        self.probability = probability
        self.asked: list[int] = []

    def __call__(self, pause_start_sample: int) -> float:
        self.asked.append(pause_start_sample)
        return self.probability


def _windows(ms: int) -> int:
    return -(-ms * MS // W)  # the window on which a pause reaches `ms`


def test_semantic_finished_stops_at_the_first_check():
    for eagerness in ("high", "medium", "auto", "low"):
        finished = FakeEndOfTurn(0.9)
        detector = TurnDetector(VADSettings(), end_of_turn=finished, eagerness=eagerness)
        check = _windows(EAGERNESS_MS[eagerness][0])
        assert detector.push(_probs((1, 10), (0, check - 1)), 0) == [SpeechStarted(0)]
        assert finished.asked == []
        assert detector.push([0.0], 10 + check - 1) == [SpeechStopped(10 * W)]
        assert finished.asked == [10 * W]


def test_semantic_not_finished_asks_at_each_check_and_stops_at_the_maximum():
    for eagerness in ("high", "auto", "low"):
        check_ms, max_ms = EAGERNESS_MS[eagerness]
        unfinished = FakeEndOfTurn(0.1)
        detector = TurnDetector(VADSettings(silence_duration_ms=100), end_of_turn=unfinished, eagerness=eagerness)
        events = detector.push(_probs((1, 10), (0, _windows(max_ms) - 1)), 0)
        assert events == [SpeechStarted(0)]  # silence_duration_ms plays no part
        assert unfinished.asked == [10 * W] * (-(-max_ms // check_ms) - 1)
        assert detector.push([0.0], 10 + _windows(max_ms) - 1) == [SpeechStopped(10 * W)]


def test_semantic_speech_resuming_starts_the_checks_over():
    unfinished = FakeEndOfTurn(0.4)
    detector = TurnDetector(VADSettings(), end_of_turn=unfinished, eagerness="high")
    assert detector.push(_probs((1, 10), (0, 8), (1, 3), (0, 7)), 0) == [SpeechStarted(0)]
    assert unfinished.asked == [10 * W, 21 * W]  # once per pause: 8 and 7 windows reach 200 ms once
    unfinished.probability = 0.5  # the threshold itself is finished
    assert detector.push(_probs((1, 1), (0, 7)), 28) == [SpeechStopped(29 * W)]


def test_unknown_eagerness_is_refused():
    with pytest.raises(ValueError, match="eagerness"):
        TurnDetector(VADSettings(), end_of_turn=FakeEndOfTurn(1.0), eagerness="eager")  # type: ignore[arg-type]


# --- Smart Turn ---


def test_smart_turn_gives_a_probability_on_real_speech(smart_turn, speech):
    from runtime.models.turns.smart_turn import last_8s

    sentence_end = int(2.6 * 16_000)  # "A red ball rolls from the left to the right." (a pause follows)
    mid_word = int(4.0 * 16_000)  # inside the second sentence, "A blue square slides down ..."
    for audio in (speech[:sentence_end], speech[:mid_word], speech, np.zeros(100, np.float32)):
        p = smart_turn.end_of_turn_probability(audio)
        assert isinstance(p, float) and 0.0 <= p <= 1.0
    assert smart_turn.features(speech).shape == (1, 80, 800)
    # only the last 8 s count, and shorter audio is padded at the start
    assert smart_turn.end_of_turn_probability(speech) == smart_turn.end_of_turn_probability(last_8s(speech))
    short = speech[:mid_word]
    padded = np.concatenate([np.zeros(16_000, np.float32), short])
    assert smart_turn.end_of_turn_probability(padded) == pytest.approx(smart_turn.end_of_turn_probability(short),
                                                                       abs=1e-6)
    with pytest.raises(ValueError, match="1-D float"):
        smart_turn.end_of_turn_probability(np.zeros(100, np.int16))


# --- packaging ---


def test_missing_package_is_one_line_naming_the_install(monkeypatch):
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pipecat" else real(name, *a))
    for name in ("silero-vad", "smart-turn-v3.2"):
        with pytest.raises(CheckpointNotFound) as err:
            packaged.packaged_checkpoint(name)
        message = str(err.value)
        assert "\n" not in message and "pipecat-ai==1.14.0" in message and "requirements/weights.txt" in message
    from runtime.models.turns.silero_vad import SileroVAD
    from runtime.models.turns.smart_turn import SmartTurn

    for model in (SileroVAD, SmartTurn):
        with pytest.raises(CheckpointNotFound, match="pipecat-ai"):
            model.load()


def test_a_substituted_weight_file_is_refused(monkeypatch):
    packaged_or_skip("silero-vad")
    monkeypatch.setattr(packaged, "_verified", {})
    monkeypatch.setitem(packaged.PACKAGED, "silero-vad", replace(packaged.PACKAGED["silero-vad"], sha256="0" * 64))
    with pytest.raises(CheckpointNotFound, match="expected 000000000000"):
        packaged.packaged_checkpoint("silero-vad")


def test_finding_the_package_does_not_import_it():
    packaged_or_skip("silero-vad")
    import sys

    assert packaged.packaged_checkpoint("smart-turn-v3.2") is not None
    assert not any(name == "pipecat" or name.startswith("pipecat.") for name in sys.modules)
