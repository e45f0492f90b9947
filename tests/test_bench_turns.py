"""`runtime bench turns`: the quick run on the espeak demo (what CI, without the human clips, runs) gives the
documented keys with sane values; the false-cut-off and delay accounting is checked on scripted probabilities
through the real `TurnDetector`, with the answers worked out by hand in the comments."""

from __future__ import annotations

import json

import numpy as np
from weights_common import packaged_or_skip

from runtime.bench import turns
from runtime.pipeline.turn_detector import SpeechStarted, TurnDetector, VADSettings
from runtime.pipeline.turn_signals import TurnEvent

W = 512  # samples per VAD window
CHUNK = 1600  # 100 ms


class ScriptedTurns:
    """TurnTaking's contract over scripted per-window probabilities: window i is pushed once a chunk reaches
    its end, as the streaming VAD does."""

    def __init__(self, probs: list[float], detector: TurnDetector) -> None:
        self.probs, self.detector, self.done = probs, detector, 0

    def detect(self, chunk) -> list[TurnEvent]:
        ready = min(chunk.end_sample // W, len(self.probs))
        first, self.done = self.done, ready
        return [TurnEvent(True, e.audio_start_sample) if isinstance(e, SpeechStarted)
                else TurnEvent(False, e.audio_end_sample) for e in self.detector.push(self.probs[first:ready], first)]

    def reset(self, at_sample: int) -> None:
        self.detector.reset(at_sample)


# windows 0-9 silence, 10-39 speech, 40-59 an inserted pause (640 ms), 60-89 speech, 90-159 the tail
PROBS = [0.0] * 10 + [0.9] * 30 + [0.0] * 20 + [0.9] * 30 + [0.0] * 70
AUDIO = np.zeros(len(PROBS) * W, np.float32)
STREAM = turns.Stream("scripted", AUDIO, speech_end=90 * W, pauses=((40 * W, 60 * W),), pause_ms=640)


def _stops(settings: VADSettings, audio: np.ndarray = AUDIO, **kw) -> list[turns.Stop]:
    return turns.play(ScriptedTurns(PROBS, TurnDetector(settings, W, **kw)), audio, CHUNK)


def test_server_vad_500_cuts_the_inserted_pause_and_ends_520_ms_late():
    stops = _stops(VADSettings(silence_duration_ms=500))
    # pause from 20480; 500 ms = 8000 samples, first reached by window 55 (ends 28672), in the chunk ending 28800;
    # the end at 46080 likewise stops with window 105 (ends 54272), in the chunk ending 54400
    assert stops == [turns.Stop(20480, 28800), turns.Stop(46080, 54400)]
    assert turns.score(STREAM, stops) == turns.Outcome(false_cutoffs=1, cut_pauses=(True,), at_clip_pauses=0,
                                                       delay_ms=(54400 - 46080) / 16)  # 520 ms


def test_server_vad_800_waits_out_the_pause():
    stops = _stops(VADSettings(silence_duration_ms=800))
    # 800 ms = 12800 samples > the 10240 of the pause; the end stops with window 114 (ends 58880), chunk end 59200
    assert stops == [turns.Stop(46080, 59200)]
    assert turns.score(STREAM, stops) == turns.Outcome(0, (False,), 0, 820.0)


def test_semantic_vad_high_asks_in_the_pause_and_ends_at_the_first_check():
    calls: list[int] = []

    def end_of_turn(pause_start: int) -> float:
        calls.append(pause_start)
        return 1.0 if pause_start >= 46080 else 0.0  # unfinished mid-utterance, finished at the end

    stops = _stops(VADSettings(), end_of_turn=end_of_turn, eagerness="high")
    # checks every 200 ms (3200 samples) of pause: windows 46, 52, 58 in the first (3584, 6656, 9728 samples in);
    # at the end window 96 (ends 49664, 3584 in), in the chunk ending 51200
    assert calls == [20480, 20480, 20480, 46080]
    assert stops == [turns.Stop(46080, 51200)]
    assert turns.score(STREAM, stops) == turns.Outcome(0, (False,), 0, 320.0)


def test_a_cut_at_the_clips_own_pause_and_a_missed_end():
    clip_pause = turns.Stream("scripted", AUDIO, speech_end=90 * W, pauses=(), pause_ms=640)
    stops = _stops(VADSettings(silence_duration_ms=500))
    assert turns.score(clip_pause, stops) == turns.Outcome(1, (), 1, 520.0)
    short = AUDIO[:100 * W]  # ends at 51200, before the final stop (emitted at 54400): missed
    stops = _stops(VADSettings(silence_duration_ms=500), short)
    assert stops == [turns.Stop(20480, 28800)]
    missed = turns.score(turns.Stream("scripted", short, 90 * W, STREAM.pauses, 640), stops)
    assert missed == turns.Outcome(1, (True,), 0, None)


def test_tolerance_and_attribution_edges():
    # the true end 46080 minus 100 ms (1600) is 44480: a stop there is the final one, one sample before is a cut
    assert turns.score(STREAM, [turns.Stop(44480, 50000)]).false_cutoffs == 0
    assert turns.score(STREAM, [turns.Stop(44479, 50000), turns.Stop(46080, 50000)]).false_cutoffs == 1
    # a stop up to 200 ms (3200) before an inserted pause is charged to it, earlier to the clip's own pauses
    assert turns.score(STREAM, [turns.Stop(20480 - 3200, 0)]).cut_pauses == (True,)
    assert turns.score(STREAM, [turns.Stop(20480 - 3201, 0)]).at_clip_pauses == 1


def test_summary_rates_and_delays():
    streams = [STREAM, STREAM]
    outcomes = [turns.Outcome(1, (True,), 0, 520.0), turns.Outcome(2, (False,), 2, None)]
    row = turns.summarise(streams, outcomes, smart_turn_calls=6, cpu_s=0.5)
    cut = row["false_cutoffs"]
    assert (cut["count"], cut["rate_per_inserted_pause"], cut["at_clip_pauses"], cut["total"]) == (1, 0.5, 2, 3)
    assert (cut["streams_cut"], cut["rate_per_stream"]) == (2, 1.0)
    assert cut["by_pause_ms"] == {"640": {"pauses": 2, "cut": 1, "rate": 0.5}}
    assert row["missed"] == 1 and row["delay_ms"] == {"p50": 520.0, "p95": 520.0, "n": 1}
    assert row["smart_turn_calls_per_stream"] == 3.0


def test_streams_put_pauses_inside_the_speech():
    rng = np.random.default_rng(0)
    audio = (rng.standard_normal(100 * W) * 0.1).astype(np.float32)  # 3.2 s
    probs = [0.0] * 10 + [0.9] * 40 + [0.0] * 10 + [0.9] * 30 + [0.0] * 10
    stream = turns.build_stream("x", audio, probs, 300, 2, np.random.default_rng(1))
    assert stream is not None and len(stream.pauses) == 2
    lead, gap = turns.LEAD_MS * 16, 300 * 16
    assert len(stream.audio) == lead + len(audio) + 2 * gap + turns.TAIL_MS * 16
    assert stream.speech_end == lead + 90 * W + 2 * gap
    points = [start - lead - i * gap for i, (start, _) in enumerate(stream.pauses)]
    margin = turns.MARGIN_MS * 16
    for point in points:  # MARGIN_MS of speech windows either side, in one of the two runs
        assert 10 * W + margin <= point <= 50 * W - margin or 60 * W + margin <= point <= 90 * W - margin
    assert points[1] - points[0] >= turns.MIN_APART_MS * 16
    for start, end in stream.pauses:
        assert not stream.audio[start:end].any()
    assert turns.build_stream("x", audio, [0.0] * 100, 300, 1, rng) is None  # no speech, no stream


def test_quick_bench_on_the_espeak_demo(monkeypatch, tmp_path, capsys):
    packaged_or_skip("silero-vad")
    packaged_or_skip("smart-turn-v3.2")
    from runtime.cli import main

    missing = tmp_path / "no-speech-here"
    monkeypatch.setattr(turns, "DEV_SPEECH", missing)
    assert main(["bench", "turns", "--quick", "--json", "-q"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    result = json.loads(out)
    assert result["speech"] == f"espeak demo (human clips not found at {missing})"
    assert result["clips"] == 1 and result["pause_ms"] == [600]
    assert result["streams"] >= 1 and result["inserted_pauses"] >= result["streams"]
    assert set(result["configs"]) == set(turns.CONFIGS)
    for name, row in result["configs"].items():
        cut = row["false_cutoffs"]
        assert 0 <= cut["count"] <= result["inserted_pauses"]
        assert 0.0 <= cut["rate_per_inserted_pause"] <= 1.0 and 0.0 <= cut["rate_per_stream"] <= 1.0
        assert cut["total"] >= cut["count"] + cut["at_clip_pauses"]
        assert 0 <= row["missed"] <= result["streams"]
        assert row["delay_ms"]["n"] == result["streams"] - row["missed"]
        if row["delay_ms"]["n"]:
            assert 0 <= row["delay_ms"]["p50"] <= row["delay_ms"]["p95"]
        assert row["cpu_s"] > 0
        if row["type"] == "server_vad":
            assert row["smart_turn_calls"] == 0
        else:
            assert row["smart_turn_calls"] > 0, name
    assert result["machine"]["cpu_count"] >= 1
    assert set(result["code"]) == {"turn_taking.py", "turn_detector.py"}
