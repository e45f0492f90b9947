"""`runtime bench voice`'s parts on one or two sentences: every system of the synthesis race gives a real-time factor
(the `piper` command included, timed without its start-up), and the round trip through Whisper scores. 8-13 s on
2 cores (four voice loads, the piper process, Whisper), so it is marked `slow`."""

from __future__ import annotations

import pytest
from weights_common import packaged_or_skip

from runtime.bench.voice import SENTENCES, intelligibility, synthesis


@pytest.mark.slow
def test_the_synthesis_race_and_the_round_trip_on_a_small_set() -> None:
    packaged_or_skip("piper-en-us-joe-medium")
    packaged_or_skip("whisper-tiny.en")
    lines: list[str] = []
    race = synthesis(["Yes, it is done."], 1, lines.append)
    rows = race["systems"]
    assert set(rows) == {"runtime", "runtime_1_thread", "runtime_spinning", "onnxruntime_direct",
                         "piper_library_defaults", "piper_command"}
    assert rows["runtime"]["spinning"] is False and rows["runtime_spinning"]["spinning"] is True
    for name, row in rows.items():
        assert row["audio_s"] > 0.5 and 0 < row["rtf"] < 2.0, (name, row)
    assert rows["piper_command"]["startup_s"] > 0
    assert lines  # progress on stderr
    heard = intelligibility(SENTENCES[:1], lines.append)  # heard word for word in every full run so far
    assert heard["sentences"] == 1 and heard["wer"] <= 10.0  # at most one word of its 10 misheard
    assert heard["target"]["target"] == "<= 5"
