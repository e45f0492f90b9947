"""`runtime train distil-whisper`: examples built for streaming, labelled by the teacher, resumable."""

import json

import numpy as np
import pytest
import soundfile

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError
from runtime.train.causal_whisper import TrainConfig, chunk_sizes, encode_text
from runtime.train.distil_whisper import FRAME, DistilConfig, compose, distil, source_files


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.2 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.fixture
def sources(tmp_path):
    folder = tmp_path / "src"
    (folder / "a").mkdir(parents=True)
    for i, (seconds, hz) in enumerate([(1.0, 300), (2.5, 500), (4.0, 700)]):
        soundfile.write(folder / "a" / f"{i}.flac", tone(seconds, hz), SAMPLE_RATE)
    (folder / "a" / "0.txt").write_text("ignored")
    return folder


def test_examples_are_joined_clips_cut_at_an_emission_point(sources):
    files = source_files(str(sources))
    assert [f.name for f in files] == ["0.flac", "1.flac", "2.flac"]
    clips = {f: soundfile.read(f, dtype="float32")[0] for f in files}
    cfg = DistilConfig(base="", data="", out="", max_seconds=6.0, whole_share=0.3, seed=1)
    whole = cut = 0
    for i in range(60):
        audio, info = compose(i, files, cfg, clips.__getitem__)
        again, _ = compose(i, files, cfg, clips.__getitem__)
        assert np.array_equal(audio, again)  # a pure function of (seed, index)
        assert 1 <= len(info["sources"]) <= 4
        assert len(audio) <= 6.0 * SAMPLE_RATE
        if info["cut_s"] is None:
            whole += 1
            # whole: the clips back to back with their pauses, nothing lost
            assert len(audio) >= sum(len(clips[files[0].parent / n]) for n in info["sources"])
        else:
            cut += 1
            assert len(audio) % FRAME == FRAME // 2  # the moment a block ending on a frame is emitted live
            assert len(audio) >= cfg.min_prefix_s * SAMPLE_RATE
            assert info["cut_s"] == round(len(audio) / SAMPLE_RATE, 3)
    assert whole and cut > whole  # most are cut


def test_distil_writes_teacher_labels_and_resumes(sources, tmp_path):
    out = tmp_path / "out"
    cfg = DistilConfig(base="tiny:whisper", data=str(sources), out=str(out), examples=3, max_seconds=4.0, threads=1)
    summary = distil(cfg)
    assert summary["examples"] == 3
    rows = [json.loads(line) for line in (out / "distil.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    for row in rows:
        audio, rate = soundfile.read(out / row["audio"], dtype="float32")
        assert rate == SAMPLE_RATE and abs(len(audio) / SAMPLE_RATE - row["duration"]) < 1e-3
        assert (out / row["audio"]).with_suffix(".txt").read_text().strip() == row["text"]
    before = (out / "000" / "000001.flac").stat().st_mtime_ns
    summary = distil(DistilConfig(**{**cfg.__dict__, "examples": 4}))  # grows, keeps what is there
    assert summary["examples"] == 4 and (out / "000" / "000001.flac").stat().st_mtime_ns == before
    assert len((out / "distil.jsonl").read_text().splitlines()) == 4


def test_bad_flags_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no audio files"):
        source_files(str(tmp_path))
    with pytest.raises(ConfigError, match="--max-seconds"):
        distil(DistilConfig(base="tiny:whisper", data=str(tmp_path), out=str(tmp_path / "o"), max_seconds=40))


def test_chunk_sizes_and_blank_transcripts():
    assert chunk_sizes(TrainConfig("", "", "", chunk_ms="100,200,300")) == [100, 200, 300]
    assert chunk_sizes(TrainConfig("", "", "", chunk_ms=40)) == [40]
    for bad in ("100,150", "0", "x", ""):
        with pytest.raises(ConfigError, match="--chunk-ms"):
            chunk_sizes(TrainConfig("", "", "", chunk_ms=bad))
    assert encode_text(None, "  ") == []  # the teacher heard nothing yet: eos at once


def test_the_batched_ctranslate2_teacher_gives_the_runtimes_own_tokens(sources, tmp_path):
    pytest.importorskip("ctranslate2")
    import shutil

    from ctranslate2.converters import TransformersConverter
    from transformers import WhisperFeatureExtractor

    from runtime.config import ASRConfig
    from runtime.models.asr.whisper_buffered import WhisperBuffered
    from runtime.models.asr.whisper_checkpoint import load_whisper
    from runtime.models.loading import resolve_checkpoint
    from runtime.train.distil_whisper import fast_teacher

    tiny = resolve_checkpoint("tiny:whisper", role="asr")
    folder = tmp_path / "ct2"
    TransformersConverter(str(tiny)).convert(str(folder), force=True)
    shutil.copy(tiny / "tokenizer.json", folder / "tokenizer.json")
    model, tokenizer, path = load_whisper(str(folder))
    teacher = WhisperBuffered(model, tokenizer, WhisperFeatureExtractor.from_pretrained(path),
                              ASRConfig(backend="whisper-buffered", max_new_tokens=20))
    fast = fast_teacher(str(folder), teacher)
    assert fast is not None and fast_teacher(str(tiny), teacher) is None  # only for CTranslate2 folders
    files = source_files(str(sources))
    cfg = DistilConfig(base="", data="", out="", max_seconds=5.0)
    clips = [compose(i, files, cfg, lambda p: soundfile.read(p, dtype="float32")[0])[0] for i in range(4)]
    # Token for token, except where two float32 engines may break a near tie of the random model differently:
    # there both tokens must be the top two of our own distribution, within 1e-3 of each other.
    import torch

    for audio, theirs in zip(clips, fast(clips), strict=True):
        ours = teacher.hypothesis(audio)
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if k is None:
            assert ours == theirs
            continue
        with torch.inference_mode():
            logits = teacher._next_logits(torch.tensor([teacher.prompt_ids + ours[:k]]), teacher.encode(audio).states,
                                          None)[0]
        top = logits.log_softmax(-1).topk(2)
        assert {ours[k], theirs[k]} == set(top.indices.tolist()) and float(top.values[0] - top.values[1]) < 1e-3


def test_a_cut_transcript_loses_the_sentence_end_the_teacher_adds():
    from runtime.train.distil_whisper import at_the_cut

    assert at_the_cut("A red ball rose from the left to the right.") == "A red ball rose from the left to the right"
    assert at_the_cut("Ever tried. Ever failed. ") == "Ever tried. Ever failed"  # only the end
    assert at_the_cut("Is it?!") == "Is it" and at_the_cut(".") == "" and at_the_cut("3.5") == "3.5"
