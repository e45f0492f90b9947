"""`runtime bench asr-quality`'s systems table (issue 22): the random-weight refusal, word latency on hand-made
updates, the rows that say why when faster-whisper or the human set is missing, and the targets' arithmetic.
Fast: the one run through the CLI scores only the offline Whisper on one short clip."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np
import pytest
import soundfile
from cli_common import one_error_line, run_cli

from runtime.bench import asr_systems, word_latency
from runtime.bench.word_latency import Timed, latencies, matched, summary, timed_stream, word_times
from runtime.chunks import SAMPLE_RATE
from runtime.errors import CheckpointNotFound
from runtime.models.asr.base import TranscriptUpdate


def _tiny_en_or_skip() -> None:
    from runtime.models.packaged import packaged_checkpoint

    try:
        packaged_checkpoint("whisper-tiny.en")
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))


def test_random_whisper_weights_are_refused_before_any_data_or_model(capsys):
    from runtime.models.loading import resolve_checkpoint

    code, _, err = run_cli(capsys, "bench", "asr-quality", "--quick", "--whisper", "tiny:whisper", "--data",
                           "/nonexistent")
    assert code != 0 and "random weights" in one_error_line(err)
    tiny = resolve_checkpoint("tiny:whisper", role="asr")  # the same random weights, named by their path
    code, _, err = run_cli(capsys, "bench", "asr-quality", "--quick", "--whisper", str(tiny), "--data",
                           "/nonexistent")
    assert code != 0 and "random weights" in one_error_line(err)
    code, _, err = run_cli(capsys, "bench", "asr-quality", "--systems", "offline,nope")
    assert code != 0 and "nope" in one_error_line(err)
    code, _, err = run_cli(capsys, "bench", "asr-quality", "--chunks", "100,abc")
    assert code != 0 and "--chunks" in one_error_line(err)
    code, _, err = run_cli(capsys, "bench", "llm", "--quick", "--systems", "offline", "--human", "x")
    assert code != 0 and "--systems and --human" in one_error_line(err)


def _u(item: str, delta: str = "", unstable: str = "", *, done: str | None = None) -> TranscriptUpdate:
    if done is not None:
        return TranscriptUpdate(item, delta, "", 0.0, 0.0, completed=True, transcript=done)
    return TranscriptUpdate(item, delta, unstable, 0.0, 0.0)


def _timed(*events: tuple[float, TranscriptUpdate]) -> list[Timed]:
    return [Timed(t, t + 0.05, u) for t, u in events]  # every event appears 50 ms after its audio


def test_word_times_shown_and_final_from_byte_pieces_and_items():
    """Whisper-style updates: stable text may end inside a word ("wor"), so a word is final only once a later
    word is stable or its item is complete; a wrong guess in the tail does not count as shown."""
    timed = _timed(
        (0.5, _u("a", "", " hello")),  # hello shown at 0.5
        (1.0, _u("a", " hello", " word")),  # a wrong second word: world not yet shown
        (1.5, _u("a", " wor", "ld")),  # world shown at 1.5; hello final (a later word is stable)
        (2.0, _u("a", done=" hello world")),  # world final
        (2.5, _u("b", "", " again")),
        (3.0, _u("b", done=" again")),
    )
    words = word_times(timed)
    assert [(w, s.media, f.media) for w, s, f in words] == [("hello", 0.5, 1.5), ("world", 1.5, 2.0),
                                                            ("again", 2.5, 3.0)]
    assert [t.wall for _, s, f in words for t in (s, f)] == pytest.approx([0.55, 1.55, 1.55, 2.05, 2.55, 3.05])
    ends = [("hello", 0.4), ("world", 1.2), ("again", 2.4)]
    lat = latencies(ends, words)
    assert np.allclose(lat["shown_media"], [0.1, 0.3, 0.1]) and np.allclose(lat["final_media"], [1.1, 0.8, 0.6])
    assert np.allclose(lat["shown"], [0.15, 0.35, 0.15]) and np.allclose(lat["final"], [1.15, 0.85, 0.65])
    out = summary(lat)
    assert out["shown"]["median"] == 0.15 and out["media_only"]["final"]["median"] == 0.8
    assert out["words_timed"] == 3


def test_word_times_of_whole_word_streams_and_misrecognised_words():
    """The CTC beam's stable text is whole words (final once stable) and its tail is joined by a space; a word
    the stream got wrong is not timed, and an inserted one shifts nothing."""
    timed = _timed(
        (0.3, _u("a", "", "the")),
        (0.6, _u("a", "the", "cat")),  # the final; cat shown ("the" + " " + "cat")
        (0.9, _u("a", " cat", "")),
        (1.2, _u("a", done="the cat sat uh")),
    )
    words = word_times(timed, whole_words=True)
    assert [(w, s.media, f.media) for w, s, f in words] == [("the", 0.3, 0.6), ("cat", 0.6, 0.9),
                                                            ("sat", 1.2, 1.2), ("uh", 1.2, 1.2)]
    ends = [("the", 0.2), ("dog", 0.5), ("sat", 0.8)]  # "cat" is a substitution, "uh" an insertion
    assert matched(["the", "dog", "sat"], ["the", "cat", "sat", "uh"]) == [(0, 0), (2, 2)]
    assert np.allclose(latencies(ends, words)["final_media"], [0.4, 0.4])
    assert summary(latencies([], []))["shown"] == {"median": None, "p90": None}


def test_timed_stream_queues_calls_on_a_real_time_clock(monkeypatch):
    """Each call takes 0.25 s for 0.1 s of audio: calls queue, and events appear when their call returns."""

    class Stream:
        def __init__(self) -> None:
            self.calls = 0

        def accept(self, chunk: object) -> list[TranscriptUpdate]:
            self.calls += 1
            return [_u("a", "", f" w{self.calls}")]

        def finish(self) -> list[TranscriptUpdate]:
            return [_u("a", done=" w1 w2 w3")]

        def close(self) -> None:
            pass

    class ASR:
        name = "fake"

        def open_stream(self) -> Stream:
            return Stream()

    ticks = itertools.count(0.0, 0.25)  # read before and after each call: 0.25 s per call
    monkeypatch.setattr(word_latency, "perf_counter", lambda: next(ticks))
    timed, compute = timed_stream(ASR(), np.zeros(SAMPLE_RATE * 3 // 10, np.float32))
    assert compute == pytest.approx(1.0)
    assert [t.media for t in timed] == pytest.approx([0.1, 0.2, 0.3, 0.3])
    assert [t.wall for t in timed] == pytest.approx([0.35, 0.6, 0.85, 1.1])


def test_repeats_count_each_clips_fastest_run(monkeypatch):
    """`--repeats`: every clip runs that many times, and its least time counts (other load only ever adds time)."""
    times = iter([0.0, 3.0, 3.0, 4.0, 4.0, 6.5, 6.5, 9.0, 9.0, 9.5, 9.5, 14.0])  # perf_counter: before, after
    monkeypatch.setattr(asr_systems.time, "perf_counter", lambda: next(times))
    calls = []
    outs, compute = asr_systems.timed_map(lambda a: calls.append(len(a)) or len(a), [np.zeros(2), np.zeros(5)], 3)
    assert outs == [2, 5] and calls == [2, 2, 2, 5, 5, 5]
    assert compute == pytest.approx(1.0 + 0.5)  # clip 1 took 3, 1 and 2.5 s; clip 2 2.5, 0.5 and 4.5 s
    assert asr_systems.fastest(iter([("a", 2.0), ("b", 1.0), ("c", 1.5)]).__next__, 3) == ("b", 1.0)
    with pytest.raises(SystemExit):
        from runtime.bench import add_arguments

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        parser.parse_args(["asr-quality", "--repeats", "0"])


def test_targets_from_rows_of_one_run():
    table = {
        "whisper-offline": {"human": {"wer": 0.0, "compute_s": 1.0, "audio_s": 10.0}},
        "causal-whisper-300ms": {"human": {"wer": 0.0, "compute_s": 0.5, "audio_s": 10.0,
                                           "word_latency_s": {"shown": {"median": 0.5, "p90": 0.7},
                                                              "words_timed": 7}},
                                 "synthetic": {"wer": 9.0, "compute_s": 1.5, "audio_s": 10.0}},
        "whisper-buffered-1s": {"human": {"wer": 2.0, "compute_s": 5.0, "audio_s": 10.0},
                                "synthetic": {"wer": 3.0, "compute_s": 5.0, "audio_s": 10.0}},
        "faster-whisper-int8": {"human": {"utterances": 0, "reason": "faster_whisper is not installed"}},
    }
    t = asr_systems.targets(table, [300])
    assert t["causal_300ms_human_wer_within_1.25x_offline"]["met"] is True  # 0 <= 1.25 x 0
    assert t["causal_100ms_human_wer_within_1.5x_offline"]["met"] is False  # not measured: not met
    assert t["causal_300ms_human_wer_minus_buffered_points"]["value"] == -2.0
    assert t["causal_300ms_compute_over_buffered"]["value"] == 0.2  # pooled over both sets: 2 s / 10 s
    assert t["causal_300ms_compute_over_buffered"]["met"] is True
    assert t["causal_300ms_human_median_word_latency_s"] == {"value": 0.5, "target": "<= 0.6", "met": True,
                                                             "words_timed": 7}
    assert t["causal_300ms_compute_over_faster_whisper"]["value"] is None
    assert t["causal_300ms_compute_over_faster_whisper"]["met"] is False


def test_missing_faster_whisper_and_human_set_are_rows_with_reasons(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # `import faster_whisper` raises ImportError
    fw, why = asr_systems.faster_whisper(tmp_path, "")
    assert fw is None and "not installed" in why
    missing = asr_systems.human_set(argparse.Namespace(human=str(tmp_path / "none")), _never_read)
    assert missing.reason and "manifest.jsonl" in missing.reason and not missing.audios

    _tiny_en_or_skip()
    from runtime.io.sample import demo_script, demo_speech

    soundfile.write(tmp_path / "a.flac", demo_speech()[: 3 * SAMPLE_RATE], SAMPLE_RATE, subtype="PCM_16")
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"audio": "a.flac", "text": demo_script()}) + "\n")
    code, out, err = run_cli(capsys, "bench", "asr-quality", "--quick", "--json", "--threads", "1", "--data",
                             str(tmp_path), "--systems", "offline,faster-whisper", "--human", str(tmp_path / "none"),
                             "--repeats", "2")
    assert code == 0, err
    result = json.loads(out)
    assert result["repeats"] == 2
    assert "greedy" not in result  # the FastConformer's own report is skipped without `fastconformer`
    assert set(result["systems"]) == {"whisper-offline", "faster-whisper-int8"}
    row = result["systems"]["whisper-offline"]["synthetic"]
    assert row["utterances"] == 1 and row["compute_s_per_audio_s"] > 0 and 0 <= row["cer"] <= 100
    assert 0 < row["wer"] <= 100  # three seconds against the whole script: most words missing
    assert row["word_latency_s"] is None and "offline" in row["word_latency_reason"]
    assert "not installed" in result["systems"]["faster-whisper-int8"]["synthetic"]["reason"]  # set, no engine
    for system in result["systems"].values():
        assert system["human"]["utterances"] == 0 and "manifest.jsonl" in system["human"]["reason"]
    assert "manifest.jsonl" in result["sets"]["human"]["reason"]
    assert result["targets"]["causal_300ms_human_wer_within_1.25x_offline"]["met"] is False



def test_the_causal_rows_stream_with_the_profiles_adapter_unless_told_otherwise() -> None:
    """As a session streams tiny.en (the whisper-tiny-en profile's adapter) or base (the whisper-base profile's);
    `--adapter none` scores the bare stream, and another Whisper has no adapter trained for it."""
    shipped = "builtin:causal-whisper-tiny.en"

    def adapter(ref: str = asr_systems.WHISPER, **flag: str) -> str:
        return asr_systems.stream_adapter(argparse.Namespace(**flag), ref, shipped)

    assert adapter() == shipped
    assert adapter(adapter="none") == adapter(adapter="") == ""
    assert adapter(adapter="/tmp/my-lora") == "/tmp/my-lora"
    assert adapter("builtin:whisper-base") == "builtin:causal-whisper-base"  # the whisper-base profile's
    assert adapter("builtin:whisper-base", adapter="none") == ""
    assert adapter("openai/whisper-small") == ""

def _never_read(path: object) -> np.ndarray:
    raise AssertionError(f"a missing set reads no audio ({path})")


def test_word_ends_fall_inside_the_speech():
    """Cross-attention DTW on the real tiny.en: after 1 s of silence every word ends after 1 s, in order, and
    before the audio does."""
    _tiny_en_or_skip()
    from runtime.config import ASRConfig
    from runtime.io.sample import demo_speech
    from runtime.models.asr.registry import load_asr
    from runtime.models.asr.whisper_checkpoint import whisper_path

    audio = np.concatenate([np.zeros(SAMPLE_RATE, np.float32), demo_speech()[: 4 * SAMPLE_RATE]])
    offline = load_asr(ASRConfig(backend="whisper-buffered", model="builtin:whisper-tiny.en"), device="cpu",
                       dtype="float32")
    ids = offline.hypothesis(audio)
    ends = word_latency.Aligner(offline, whisper_path("builtin:whisper-tiny.en")).word_ends(audio, ids)
    assert len(ends) >= 4
    times = [end for _, end in ends]
    assert times == sorted(times) and times[0] > 1.0 and times[-1] <= len(audio) / SAMPLE_RATE


def test_two_pass_rows_end_where_the_offline_ceiling_does(capsys, tmp_path):
    """The `two-pass` rows run the real stream with each final pass; the offline pass's transcripts are the
    offline model's as the whisper-tiny-en profile runs it (its dtype, window and head), so its error rates are
    those of that decoder on the clip (the ceiling's when the profile keeps Whisper's 30 s window), and its targets
    are computed beside the others."""
    _tiny_en_or_skip()
    import copy
    from dataclasses import replace

    from runtime.config import ASRConfig
    from runtime.io.sample import demo_script, demo_speech
    from runtime.models.asr.causal_whisper.asr import offline_decoder
    from runtime.models.asr.registry import load_asr
    from runtime.models.asr.whisper_checkpoint import whisper_path
    from runtime.models.loading import resolve_dtype
    from runtime.profile_files import load_profile
    from runtime.train.text_norm import cer, wer

    audio = demo_speech()[: 4 * SAMPLE_RATE]
    soundfile.write(tmp_path / "a.flac", audio, SAMPLE_RATE, subtype="PCM_16")
    audio, _ = soundfile.read(tmp_path / "a.flac", dtype="float32")
    ref, profile = asr_systems.WHISPER, load_profile("whisper-tiny-en").asr
    pass_dtype = resolve_dtype(profile.final_pass_dtype, "cpu") or "float32"  # "auto": as the bench resolves it
    plain = load_asr(ASRConfig(backend="whisper-buffered", model=ref, max_new_tokens=asr_systems.OFFLINE_TOKENS),
                     device="cpu", dtype="float32")
    second = offline_decoder(copy.deepcopy(plain.model), plain.tokenizer, whisper_path(ref), replace(
        plain.cfg, head_weights=profile.head_weights, final_pass_window_s=profile.final_pass_window_s), "cpu",
        pass_dtype)
    expected = second.text(second.hypothesis(audio))
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"audio": "a.flac", "text": demo_script()}) + "\n")
    code, out, err = run_cli(capsys, "bench", "asr-quality", "--quick", "--json", "--threads", "1", "--data",
                             str(tmp_path), "--systems", "offline,two-pass", "--chunks", "300", "--human",
                             str(tmp_path / "none"), "--adapter", "builtin:causal-whisper-tiny.en",
                             "--refresh-ms", "300")
    assert code == 0, err
    result = json.loads(out)
    assert set(result["systems"]) == {"whisper-offline", "causal-whisper-300ms+decoder", "causal-whisper-300ms+offline"}
    offline, row = (result["systems"][s]["synthetic"] for s in ("whisper-offline", "causal-whisper-300ms+offline"))
    assert (row["wer"], row["cer"]) == (round(100 * wer([demo_script()], [expected]), 2),
                                         round(100 * cer([demo_script()], [expected]), 2))
    if profile.final_pass_window_s == 30 and not profile.head_weights:
        assert (row["wer"], row["cer"]) == (offline["wer"], offline["cer"])
    assert row["word_latency_s"]["words_timed"] > 0
    settings = result["system_settings"]["causal-whisper-300ms+offline"]
    assert pass_dtype in settings and f"{profile.final_pass_window_s:g} s windows" in settings
    # the stream runs as the profile does (its token budget), with the --refresh-ms asked for
    assert f"{profile.max_new_tokens} tokens an item" in settings and "re-fed after 300 ms" in settings
    assert {"causal_300ms+offline_human_wer_within_1.25x_offline",
            "causal_300ms+decoder_compute_over_faster_whisper"} <= set(result["targets"])
