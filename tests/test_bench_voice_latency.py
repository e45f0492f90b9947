"""`runtime bench voice`'s voice-to-voice accounting (runtime/bench/voice_latency.py, voice_questions.py,
voice_server.py) on scripted timestamps: the stages are the differences of the marks, a stall is a real-time player's
buffer running dry, the first clause is where the server's own splitter would cut, a spoken question's end of speech
is where its last sample is, and the server's peak RSS is the largest reading during a phase and after it."""

from __future__ import annotations

import asyncio
import base64
import shutil

import numpy as np
import pytest

from runtime.bench.voice_latency import Conversation, Turn, first_clause_done, summarize
from runtime.bench.voice_questions import CHUNK, LEAD_S, RATE, Question, question
from runtime.bench.voice_server import PeakRss

Q = Question("What day is the meeting?", ("thursday",), [], 1.5)


def test_a_stall_is_the_time_the_player_waits_for_the_next_piece() -> None:
    turn = Turn(Q, 0.0, audio=[(1.0, 0.2), (1.1, 0.2), (1.6, 0.3), (1.7, 0.1)])
    # plays 1.0-1.2, 1.2-1.4 (the second came while the first played), waits 1.4-1.6, plays 1.6-1.9, 1.9-2.0
    assert turn.stall_s() == pytest.approx(0.2)
    assert Turn(Q, 0.0, audio=[(1.0, 0.5), (1.2, 0.5)]).stall_s() == 0.0


def test_the_stages_are_the_differences_of_the_marks() -> None:
    marks = {"speech_stopped": 0.70, "committed": 0.71, "transcript": 0.95, "response_created": 0.96,
             "first_token": 1.05, "first_clause": 1.20, "first_audio": 1.33}
    right = Turn(Q, 10.0, dict(marks), answer="It is on Thursday.", status="completed")
    wrong = Turn(Q, 20.0, {**marks, "first_audio": 1.53}, answer="Not known yet.", status="completed")
    silent = Turn(Q, 30.0, {"speech_stopped": 0.7})  # no audio: counted, not timed
    row = summarize([Conversation([right, wrong, silent])])
    assert row["turns"] == 3 and row["turns_with_audio"] == 2 and row["answers_right"] == 1
    assert row["voice_to_voice_ms"] == {"p50": pytest.approx(1430), "p95": pytest.approx(1520), "n": 2}
    stages = {name: s["p50"] for name, s in row["stages_ms"].items()}
    assert stages == {"turn_detection": pytest.approx(710), "final_transcript": pytest.approx(240),
                      "first_clause": pytest.approx(250), "first_audio": pytest.approx(230)}
    assert row["marks_ms"]["first_token"]["p50"] == pytest.approx(1050)
    assert "errors" not in row and summarize([Conversation(error="boom")])["errors"] == ["boom"]


def test_the_first_clause_is_done_where_the_server_cuts_it() -> None:
    assert not first_clause_done(["The team", " meeting"])  # "meeting" may still be followed by more
    assert first_clause_done(["The team", " meeting", " is"])  # the space after "meeting" decided it
    assert first_clause_done(["Yes,", " it"])


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_a_spoken_question_ends_where_its_last_sample_is() -> None:
    q = question("What day is the meeting?", ("thursday",))
    pcm = np.concatenate([np.frombuffer(base64.b64decode(c), "<i2") for c in q.chunks])
    assert all(len(base64.b64decode(c)) == 2 * CHUNK for c in q.chunks)  # whole 100 ms chunks
    loud = np.flatnonzero(np.abs(pcm) > 32768 * 1e-3)
    assert loud[0] >= LEAD_S * RATE - 1  # the lead is silence
    assert q.speech_end_s == pytest.approx((loud[-1] + 1) / RATE, abs=1 / RATE)
    assert 0.5 < q.speech_end_s - LEAD_S < 3.0


def test_the_peak_rss_is_the_largest_reading_during_the_block_and_after_it() -> None:
    class Server:
        readings = iter([900.0, 1500.0, 1200.0, OSError("the server is busy"), 1100.0, 1300.0] + [1000.0] * 100)

        def health(self, window_s: float) -> dict[str, float]:
            value = next(self.readings)
            if isinstance(value, Exception):
                raise value
            return {"rss_mb": value}

    async def phase() -> float:
        async with PeakRss(Server(), every_s=0.001) as peak:  # type: ignore[arg-type]
            await asyncio.sleep(0.05)
        return peak.mb

    assert asyncio.run(phase()) == 1500.0
