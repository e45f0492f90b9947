"""`runtime train synth-speech`: the normaliser, the text source, and a real (tiny) espeak-ng generation."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
from cli_common import one_error_line, run_cli

from runtime.errors import ConfigError
from runtime.train.data import load_examples
from runtime.train.synth_speech import Settings, _progress_entries, generate
from runtime.train.synthesizers import MAX_SECONDS, MIN_SECONDS, Voice, find_voices, render
from runtime.train.text_norm import cer, expand, normalize, number_to_words, wer
from runtime.train.texts import WORDS_FILE, TextSource, build_wordnet_words, is_heldout


def _need(tool: str, package: str) -> None:
    """A missing synthesiser fails under CI (which must apt-get it) and skips elsewhere."""
    if shutil.which(tool) is None:
        message = f"{tool} is not installed (Debian: apt-get install {package})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


# -- the normaliser -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("My car has 15,000 miles on it.", "my car has fifteen thousand miles on it"),
    ("It costs $12.50!", "it costs twelve dollars and fifty cents"),
    ("$3.5 million", "three point five million dollars"),
    ("Meet at 5:30, or 7:00, or 9:05?", "meet at five thirty or seven o'clock or nine oh five"),
    ("the 21st and 2nd and 12th", "the twenty first and second and twelfth"),
    ("In 1984, 2005 and 2024", "in nineteen eighty four two thousand five and twenty twenty four"),
    ("about 45% of -3 degrees", "about forty five percent of minus three degrees"),
    ("pages 10-20 & 3.14", "pages ten twenty and three point one four"),
    ("Don\u2019t  \"QUOTE\" me; it's the children's caf\u00e9 \u2014 well-known.",
     "don't quote me it's the children's cafe well known"),
    ("'quoted' words", "quoted words"),
    ("agent 007", "agent zero zero seven"),
])
def test_normalize(text: str, expected: str) -> None:
    assert normalize(text) == expected
    assert normalize(expected) == expected  # idempotent: hypotheses that are already words stay as they are


def test_numbers_and_expand() -> None:
    assert number_to_words(0) == "zero"
    assert number_to_words(1_000_001) == "one million one"
    assert number_to_words(999_999) == "nine hundred ninety nine thousand nine hundred ninety nine"
    assert expand("Call me at 5:30, Anna!") == "Call me at five thirty, Anna!"  # case and punctuation kept


def test_wer_cer() -> None:
    assert wer(["The cat sat."], ["the cat sat"]) == 0.0
    assert wer(["the cat sat"], ["the hat sat down"]) == pytest.approx(2 / 3)
    assert wer(["it is 5"], ["it is five"]) == 0.0
    assert cer(["abc"], ["abd"]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        wer(["a"], [])


# -- the text source ----------------------------------------------------------------------------------------
def test_text_source_vocabulary_and_split() -> None:
    src = TextSource.load()
    assert len(src.vocabulary) >= 3000
    train, held = src.split_sentences[False], src.split_sentences[True]
    assert len(held) >= 200 and len(train) > 10 * len(held)
    assert not {normalize(s) for s in train} & {normalize(s) for s in held}
    rng = np.random.default_rng(0)
    for heldout in (False, True):
        for _ in range(200):
            kind, text = src.draw(rng, heldout)
            assert is_heldout(text) == heldout and 1 <= len(normalize(text).split()) <= 16


def test_wordnet_words_come_from_definitions_only(tmp_path: Path) -> None:
    # Two synsets in WordNet's data-file layout: offsets and pointers, then " | " and the gloss.
    (tmp_path / "data.noun").write_text(
        "  1 This software and database is being provided | license header\n"
        '00001 03 n 01 slide 0 000 | a Well-Known toy that slides; e.g. 3 kids "the slides stay wet"\n'
        '00002 03 n 01 stay 0 000 | the act of staying; stays; the children\'s \'time\' "examples vanish"\n')
    for pos in ("verb", "adj", "adv"):
        (tmp_path / f"data.{pos}").write_text("")
    words = build_wordnet_words(tmp_path)
    assert words == sorted(["act", "children's", "kids", "known", "of", "slides", "staying", "stays", "that",
                            "the", "three", "time", "toy", "well"])  # no "e"/"g"/"a", no "wet"/"vanish"
    assert build_wordnet_words(tmp_path, min_count=2) == ["the"]


def test_shipped_word_list_is_normalised_words() -> None:
    words = [w for w in WORDS_FILE.read_text(encoding="utf-8").splitlines() if not w.startswith("#")]
    assert len(words) > 30_000 and words == sorted(set(words))
    assert all(normalize(w) == w and len(w) > 1 for w in words)


def test_voice_split() -> None:
    _need("espeak-ng", "espeak-ng")
    voices = find_voices(["espeak"])
    train = {v.id for v in voices if not v.heldout}
    held = {v.id for v in voices if v.heldout}
    assert len(train) >= 100 and len(held) >= 8 and not train & held
    assert Voice("espeak", "en-gb+f4").heldout and not Voice("espeak", "en-gb+f3").heldout


# -- generation ---------------------------------------------------------------------------------------------
def _manifest(out: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]


def _generate(out: Path, seed: int = 1) -> dict:
    return generate(Settings(str(out), hours=5 / 3600, heldout=3, seed=seed, jobs=1, engines=("espeak",),
                             quiet=True))


def test_generate_espeak(tmp_path: Path) -> None:
    _need("espeak-ng", "espeak-ng")
    summary = _generate(tmp_path / "a")
    out = tmp_path / "a"
    train, held = _manifest(out, "train"), _manifest(out, "heldout")
    assert len(held) == 3 and len(train) >= 1 and summary["train"]["hours"] * 3600 >= 5
    for e in train + held:
        path = out / e["audio"]
        audio, rate = soundfile.read(str(path), dtype="float32")
        assert rate == 16000 and audio.ndim == 1
        assert MIN_SECONDS <= e["duration"] <= MAX_SECONDS
        assert len(audio) / rate == pytest.approx(e["duration"], abs=1e-3)
        assert float(np.sqrt(np.mean(audio**2))) > 1e-3  # not silent
        assert e["text"] == normalize(e["text"]) == normalize(e["written"]) and e["text"]
        assert path.with_suffix(".txt").read_text().strip() == e["text"]
    assert not {e["voice"] for e in train} & {e["voice"] for e in held}
    assert all(not is_heldout(e["text"]) for e in train) and all(is_heldout(e["text"]) for e in held)
    # the layout the trainers read: the folder holds exactly the manifest
    assert sorted(str(x.path.relative_to(out)) for x in load_examples(out / "train")) == \
        sorted(e["audio"] for e in train)

    # same seed: the same manifest; the held-out set does not depend on the seed
    _generate(tmp_path / "b")
    assert (tmp_path / "b" / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()
    _generate(tmp_path / "c", seed=2)
    assert (tmp_path / "c" / "train.jsonl").read_bytes() != (out / "train.jsonl").read_bytes()
    assert (tmp_path / "c" / "heldout.jsonl").read_bytes() == (out / "heldout.jsonl").read_bytes()


def test_resume_skips_written(tmp_path: Path) -> None:
    _need("espeak-ng", "espeak-ng")
    _generate(tmp_path)
    entries = _manifest(tmp_path, "train") + _manifest(tmp_path, "heldout")
    stamps = {e["audio"]: (tmp_path / e["audio"]).stat().st_mtime_ns for e in entries}
    removed = tmp_path / entries[0]["audio"]
    before = removed.read_bytes()
    removed.unlink()
    _generate(tmp_path)
    assert removed.read_bytes() == before  # regenerated, identically
    for e in entries[1:]:
        assert (tmp_path / e["audio"]).stat().st_mtime_ns == stamps[e["audio"]]  # skipped, not rewritten
    assert _manifest(tmp_path, "train") + _manifest(tmp_path, "heldout") == entries


@pytest.mark.parametrize(("engine", "tool", "package"), [("flite", "flite", "flite"),
                                                          ("festival", "text2wave", "festival festvox-kallpc16k")])
def test_optional_engines(engine: str, tool: str, package: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"optional synthesiser {engine} is not installed (Debian: apt-get install {package})")
    voice = next(v for v in find_voices([engine]) if not v.heldout)
    audio, info = render(voice, "The train leaves at 5:30 on Monday.", np.random.default_rng(0))
    assert MIN_SECONDS * 16000 <= len(audio) <= MAX_SECONDS * 16000 and float(np.abs(audio).max()) > 0.05


def _pitch_hz(x: np.ndarray, rate: int = 16000) -> float:
    """Median autocorrelation pitch of the loud 40 ms frames."""
    found = []
    for i in range(0, len(x) - 640, 320):
        frame = x[i:i + 640] * np.hanning(640)
        if np.sqrt(np.mean(frame**2)) < 0.02 * np.abs(x).max():
            continue
        ac = np.correlate(frame, frame, "full")[639:]
        lag = rate // 400 + int(np.argmax(ac[rate // 400: rate // 60]))
        if ac[lag] > 0.4 * ac[0]:
            found.append(rate / lag)
    return float(np.median(found))


def _centroid_hz(x: np.ndarray, rate: int = 16000) -> float:
    power = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(len(x), 1 / rate)
    low = f < 5000
    return float((power[low] * f[low]).sum() / power[low].sum())


def test_formant_shift_moves_the_spectrum_and_keeps_pitch_and_tempo() -> None:
    """flite asked for 1/alpha the pitch and alpha the duration, then read at alpha times its rate: the same
    pitch and length as the plain clip, a spectral envelope moved with alpha."""
    _need("flite", "flite")
    from runtime.train.synthesizers import resample, synthesize

    voice = Voice("flite", "slt")
    text = "the quick brown fox jumps over the lazy dog"
    clips = {}
    for alpha in (1 / 1.15, 1.0, 1.15):
        raw, rate, _ = synthesize(voice, text, np.random.default_rng(0), alpha)
        clips[alpha] = resample(raw, round(rate * alpha))
    plain = clips[1.0]
    for alpha in (1 / 1.15, 1.15):
        assert abs(len(clips[alpha]) / len(plain) - 1) < 0.03
        assert abs(_pitch_hz(clips[alpha]) / _pitch_hz(plain) - 1) < 0.06
    assert _centroid_hz(clips[1 / 1.15]) < 0.9 * _centroid_hz(plain) < 0.9**2 * _centroid_hz(clips[1.15])


def test_formant_shift_draws_only_for_flite() -> None:
    _need("flite", "flite")
    flite = Voice("flite", "awb")
    _, info = render(flite, "a short test sentence", np.random.default_rng(1), formant_shift=0.15)
    assert 1 / 1.15 - 1e-3 <= info["formant"] <= 1.15 + 1e-3
    _, plain = render(flite, "a short test sentence", np.random.default_rng(1))
    assert "formant" not in plain
    espeak = Voice("espeak", "en-us+m3")
    a, info = render(espeak, "a short test sentence", np.random.default_rng(2), formant_shift=0.15)
    b, _ = render(espeak, "a short test sentence", np.random.default_rng(2))
    assert "formant" not in info
    np.testing.assert_array_equal(a, b)  # nothing drawn: an espeak clip is the clip it was without the option


# -- refused settings: one line, before any synthesis -------------------------------------------------------
@pytest.mark.parametrize("hours", ["0", "-1", "nan", "inf"])
def test_hours_must_be_a_finite_positive_number(capsys, tmp_path: Path, hours: str) -> None:
    code, _, err = run_cli(capsys, "train", "synth-speech", "--out", str(tmp_path / "s"), "--hours", hours)
    assert code != 0 and "--hours must be a finite number > 0" in one_error_line(err) and "Traceback" not in err
    assert not (tmp_path / "s").exists()


def test_negative_jobs_are_one_line(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "train", "synth-speech", "--out", str(tmp_path / "s"), "--jobs", "-1")
    assert code != 0 and "--jobs must be at least 0" in one_error_line(err) and "Traceback" not in err


def test_an_out_that_cannot_be_a_folder_is_one_line(capsys, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, message in [(afile, f"--out {afile} is a file, not a folder"),
                         (afile / "sub", f"cannot create --out {afile / 'sub'}: {afile} is a file"),
                         ("/proc/nope", "cannot create --out /proc/nope: No such file or directory")]:
        code, _, err = run_cli(capsys, "train", "synth-speech", "--out", str(out), "--hours", "0.01")
        assert code != 0 and message in one_error_line(err) and "Traceback" not in err


def test_a_folder_made_with_other_settings_names_only_what_differs(tmp_path: Path) -> None:
    voices = [f"espeak:en+v{i}" for i in range(800)]
    (tmp_path / ".config.json").write_text(json.dumps({"seed": 0, "voices": voices}))
    with pytest.raises(ConfigError) as refused:
        _progress_entries(tmp_path, {"seed": 5, "voices": voices})
    assert str(refused.value) == (f"{tmp_path} was generated with other settings: seed 0 (this run: 5); use a new "
                                  "--out folder or the same settings")
    with pytest.raises(ConfigError) as refused:
        _progress_entries(tmp_path, {"seed": 0, "voices": [*voices[:7], "flite:rms"], "formant_shift": 0.1})
    message = str(refused.value)
    assert len(message) < 300 and "espeak:en+v9" not in message, message
    assert 'formant_shift unset (this run: 0.1), voices: 800 items (this run: 8), item 8 "espeak:en+v7" (this ' \
        'run: "flite:rms")' in message
