"""Silence stays silent, on the real Whisper tiny.en: the generated non-speech set (runtime/bench/non_speech.py)
captions 0 words through a session's audio path (Silero VAD gate, Whisper's no-speech probability in the final
pass), while people reading keep their words. Without the gate the same path writes "you" over them: else these
tests could not fail."""

from __future__ import annotations

import numpy as np
import pytest
from speech_dev import dev_clips
from weights_common import packaged_or_skip

from runtime.bench.non_speech import KINDS, SECONDS, non_speech_set
from runtime.chunks import SAMPLE_RATE
from runtime.config import ASRConfig
from runtime.models.asr.causal_whisper.final_pass import NO_SPEECH
from runtime.profile_files import load_profile
from runtime.train.text_norm import wer


def test_the_non_speech_set_is_fixed_and_holds_every_kind() -> None:
    clips = non_speech_set()
    assert [name for name, _ in clips] == list(KINDS) and {len(a) for _, a in clips} == {SECONDS * SAMPLE_RATE}
    again = dict(non_speech_set(quick=True))
    for name, audio in clips:
        assert audio.dtype == np.float32 and np.abs(audio).max() < 1.0
        if name in again:
            np.testing.assert_array_equal(audio, again[name])  # seeded by name: the same on every machine
    assert not np.any(dict(clips)["silence"]) and np.any(dict(clips)["cough"])


@pytest.fixture(scope="module")
def offline():
    packaged_or_skip("whisper-tiny.en")
    from runtime.models.asr.registry import load_asr

    cfg = ASRConfig(backend="whisper-buffered", model="builtin:whisper-tiny.en", max_new_tokens=100)
    return load_asr(cfg, device="cpu", dtype="float32")


def test_whisper_says_no_speech_over_the_non_speech_set_and_not_over_people(offline) -> None:
    for name, audio in non_speech_set(quick=True):
        encoded = offline.encode(audio)
        ids = offline.decode(encoded)
        no_speech, _ = offline.judge(encoded, ids)
        assert no_speech > NO_SPEECH, (name, offline.text(ids), no_speech)
    for name, audio, _ in dev_clips():
        encoded = offline.encode(audio)
        ids = offline.decode(encoded)
        no_speech, logprob = offline.judge(encoded, ids)
        assert no_speech < NO_SPEECH and logprob > -1.0, (name, no_speech, logprob)


@pytest.mark.slow  # the demo profile's ASR and the VAD, 6 clips of 4 s and 2 people reading: about 20 s
def test_a_session_captions_nothing_over_non_speech_and_keeps_peoples_words() -> None:
    packaged_or_skip("whisper-tiny.en")
    from runtime.bench.asr_captions import caption
    from runtime.models.asr.registry import load_asr
    from runtime.models.turns.silero_vad import SileroVAD
    from runtime.pipeline.turn_taking import TurnModels

    asr = load_asr(load_profile("demo").asr, device="cpu", dtype="float32")
    turns = TurnModels(SileroVAD.load())
    shown = {name: caption(asr, turns, audio).words_shown for name, audio in non_speech_set(quick=True)}
    assert shown == dict.fromkeys(shown, 0)
    ungated = 0  # Whisper's "you" (one over each clip, measured): the gate had something to stop
    for _, audio in non_speech_set(quick=True):
        ungated += caption(asr, turns, audio, gate=False).words_shown
        if ungated >= 3:  # enough to say so: the clips after cannot take it back (0.6 s of CPU a clip)
            break
    assert ungated >= 3
    refs, hyps = [], []
    for _, audio, text in dev_clips()[1:]:
        refs.append(text)
        hyps.append(caption(asr, turns, audio).text)
    assert wer(refs, hyps) <= 0.1, hyps


def test_long_form_reads_each_clip_once_with_reader_like_pauses() -> None:
    from runtime.bench.asr_captions import LEAD_S, PAUSE_S, TAIL_S, long_form

    clips = [(np.ones(SAMPLE_RATE, np.float32) * (i + 1) / 10, f"clip {i}.") for i in range(3)]
    audio, text = long_form(clips)
    assert text == "clip 0. clip 1. clip 2." and long_form(clips)[0].tobytes() == audio.tobytes()  # seeded
    voiced = np.flatnonzero(audio)
    assert voiced[0] == round(LEAD_S * SAMPLE_RATE) and len(audio) - 1 - voiced[-1] == round(TAIL_S * SAMPLE_RATE)
    gaps = np.diff(voiced)[np.diff(voiced) > 1] - 1
    assert len(gaps) == 2 and all(PAUSE_S[0] * SAMPLE_RATE <= g <= PAUSE_S[1] * SAMPLE_RATE for g in gaps)
    assert sorted(set(np.round(audio[voiced], 1))) == [0.1, 0.2, 0.3]  # every clip, once each


def test_the_passage_is_read_by_one_voice_at_one_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """`long_form_reading`: every sentence of the passage said once by the same voice with the same prosody (one
    draw of rate and pitch), joined like the long form; a missing synthesiser is the row's reason, not a crash."""
    from runtime.bench import asr_captions
    from runtime.train import synthesizers

    drawn: list[tuple[str, str, dict[str, float]]] = []

    def synthesize(voice, text: str, rng: np.random.Generator, formant: float = 1.0):
        params = {"rate": float(rng.integers(120, 211)), "pitch": float(rng.integers(20, 81))}
        drawn.append((voice.id, text, params))
        return np.full(8000, 0.5, np.float32), 8000, params

    monkeypatch.setattr(synthesizers, "synthesize", synthesize)
    audio, text = asr_captions.reading("espeak:en-us+m6")
    assert [t for _, t, _ in drawn] == list(asr_captions.READING) and text == " ".join(asr_captions.READING)
    assert {v for v, _, _ in drawn} == {"espeak:en-us+m6"} and len({str(p) for _, _, p in drawn}) == 1
    assert np.count_nonzero(audio) == pytest.approx(len(asr_captions.READING) * SAMPLE_RATE, rel=0.01)  # 1 s each
    assert all(synthesizers.Voice(*v.split(":", 1)).heldout for v in asr_captions.READERS)

    def missing(*_args, **_kw):
        raise RuntimeError("espeak-ng is not installed")

    monkeypatch.setattr(synthesizers, "synthesize", missing)
    rows = asr_captions.reading_rows(None, None, None, "", lambda _m: None)  # type: ignore[arg-type]
    assert rows == {v: {"reason": "RuntimeError: espeak-ng is not installed"} for v in asr_captions.READERS}


def test_the_gate_loses_only_reference_words_it_took(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.bench.asr_captions as captions

    assert captions.heard("One, two, three.", "1 2 you three") == 3 and captions.heard("we must", "") == 0
    # one clip's captions, gated then ungated: the gate took "you" (no loss) and "home" (a word lost)
    runs = iter([captions.Captioned(["we must find a new"]), captions.Captioned(["you we must find a new home"])])
    monkeypatch.setattr(captions, "caption", lambda *a, **k: next(runs))
    row = captions.gate_rows(None, None, [("set", [np.zeros(1, np.float32)], ["we must find a new home"])])["set"]  # type: ignore[arg-type]
    assert (row["words_lost"], row["words_removed"], row["clips_emptied"]) == (1, 2, 0)
