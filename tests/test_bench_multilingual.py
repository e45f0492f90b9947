"""`runtime bench asr-quality`'s multilingual rows: the espeak-ng sentences (quick: one a language), the scoring of
a row (language identification and WER), and a reason instead of rows where espeak-ng is missing. The rows
themselves run Whisper base and its peers (minutes): `runtime bench asr-quality --systems multilingual`."""

from __future__ import annotations

import argparse
import shutil

import pytest

from runtime.bench import asr_multilingual as ml
from runtime.chunks import SAMPLE_RATE


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_quick_speaks_one_sentence_of_each_language():
    sets = ml.clips(quick=True)
    assert sorted(sets) == ["de", "es", "fr"] and all(len(pairs) == ml.QUICK_SENTENCES == 1 for pairs in sets.values())
    for lang, [(audio, text)] in sets.items():
        assert text == ml.SENTENCES[lang][0] and 2.0 < len(audio) / SAMPLE_RATE < 10.0 and abs(audio).max() > 0.05


def test_a_row_scores_the_language_and_the_words():
    row = ml._row(["der zug fährt", "heute morgen"], ["der zug fährt", "heute abend"], ["de", "yi"], "de", 1.0, 4.0,
                  stream_langs=["de", "de"])
    assert row["lid"] == 0.5 and row["lid_stream"] == 1.0 and row["wer"] == 20.0
    assert row["compute_s_per_audio_s"] == 0.25
    assert "lid" not in ml._row(["a b"], ["a b"], None, "de", 1.0, 1.0)  # a system given the language


def test_without_espeak_the_rows_say_why(monkeypatch):
    monkeypatch.setattr(ml.shutil, "which", lambda name: None)
    out = ml.multilingual_part(argparse.Namespace(quick=True), "cpu", "float32", lambda s: None)
    assert out == {"reason": "espeak-ng is not installed (apt-get install espeak-ng)"}


def test_streamed_tells_the_completed_language_from_the_one_first_shown():
    from runtime.models.asr.base import TranscriptUpdate

    class Stream:
        def accept(self, chunk):
            return [TranscriptUpdate("a", "", " Hallo", 0.0, chunk.end, language="yi")] if chunk.start_sample else []

        def finish(self):
            return [TranscriptUpdate("a", "", "", 0.0, 0.2, True, " Hallo Welt", language="de")]

        def close(self):
            pass

    class ASR:
        def open_stream(self):
            return Stream()

    import numpy as np

    assert ml.streamed(ASR(), np.zeros(3200, np.float32), None) == ("Hallo Welt", "de", "yi")
