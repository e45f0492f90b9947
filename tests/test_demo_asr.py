"""The shipped small ASR (`builtin:demo-fastconformer`, trained here on synthetic speech): it loads through the
`fastconformer` profile like any checkpoint and transcribes the committed Flite recording of the demo script
(`runtime/io/assets/demo_speech.flac`) close to that script, streamed as users get it and through the CLI. A
broken checkpoint, loader, featurizer, stream or decoder fails here."""

import json
import os

import numpy as np
import soundfile
from cli_common import run_cli

from runtime.bench.asr_quality import stream_transcript
from runtime.chunks import SAMPLE_RATE
from runtime.io.sample import demo_script, demo_speech
from runtime.models.asr.registry import load_asr
from runtime.profile_files import load_profile
from runtime.train.text_norm import normalize, wer

os.environ["HF_HUB_OFFLINE"] = "1"
MAX_WER = 0.20  # guards the shipped checkpoint and word LM (measured 0.056 at 240 ms, beam); issue 7 aims at 0.10


def test_the_fastconformer_profile_transcribes_the_committed_recording():
    profile = load_profile("fastconformer")
    assert profile.asr.model == "builtin:demo-fastconformer"  # trained, as the answerer is
    asr = load_asr(profile.asr, device="cpu", dtype="float32")
    heard = stream_transcript(asr, demo_speech())
    assert wer([demo_script()], [heard]) <= MAX_WER, (normalize(demo_script()), normalize(heard))


def test_runtime_transcribe_prints_the_words(capsys, tmp_path):
    wav = tmp_path / "speech.wav"
    soundfile.write(wav, demo_speech(), 16000, subtype="PCM_16")
    code, out, _ = run_cli(capsys, "transcribe", str(wav), "--profile", "fastconformer", "--speed", "0", "--json", "-q")
    assert code == 0
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    said = " ".join(e["transcript"] for e in events
                    if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert wer([demo_script()], [said]) <= MAX_WER, (normalize(demo_script()), normalize(said))


def test_an_item_never_ends_before_its_last_delta():
    """Deltas carry the audio heard so far; the completing update must not pull the item's end back to its
    last spoken frame, or events would go back in media time."""
    from runtime.chunks import AudioChunk

    for lookahead in (0, 240):
        profile = load_profile("fastconformer", overrides=[f"asr.lookahead_ms={lookahead}"])
        stream = load_asr(profile.asr, device="cpu", dtype="float32").open_stream()
        speech, updates = demo_speech(), []
        for start in range(0, len(speech), 1600):
            updates += stream.accept(AudioChunk(speech[start : start + 1600], start))
        updates += stream.finish()
        ends: dict[str, float] = {}
        completed = 0
        for update in updates:
            assert update.end >= ends.get(update.item_id, update.start), (lookahead, update)
            ends[update.item_id] = update.end
            completed += update.completed
        assert completed >= 1


def _said_without_pauses(speech: np.ndarray, times: int) -> np.ndarray:
    """The recording with its silences (over 0.1 s) cut out, said `times` times: one long utterance."""
    loud = np.flatnonzero(np.abs(speech) > 1e-3)
    cuts = np.flatnonzero(np.diff(loud) > SAMPLE_RATE // 10)
    starts, ends = loud[np.r_[0, cuts + 1]], loud[np.r_[cuts, len(loud) - 1]] + 1
    return np.concatenate([speech[a:b] for a, b in zip(starts, ends, strict=True)] * times)


def test_captions_do_not_wait_on_a_doubt_the_audio_never_settles():
    """With the beam, a word is final once every hypothesis agrees on it, or once the best has kept it for
    `asr.commit_after_s`. In a long utterance without pauses (the demo's sentences run together twice, 21 s),
    agreement alone held words back for most of it, so a reader of stable text saw nothing, then everything."""
    speech = _said_without_pauses(demo_speech(), times=2)
    waits: dict[float, list[float]] = {}
    for commit in (0.0, 0.5):
        profile = load_profile("fastconformer", overrides=[f"asr.commit_after_s={commit}"])
        asr = load_asr(profile.asr, device="cpu", dtype="float32")
        waits[commit] = []
        heard = stream_transcript(asr, speech, waits[commit])
        assert wer([" ".join([demo_script()] * 2)], [heard]) <= MAX_WER, (commit, normalize(heard))
    assert max(waits[0.0]) > 8.0  # the failure this guards against is real on this audio
    assert max(waits[0.5]) <= 2.0, waits[0.5]  # 0.5 s held, plus the word's own spelling and the next's start
