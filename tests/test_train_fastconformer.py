"""`runtime train fastconformer`: the recipe learns, its checkpoint directory loads through the runtime's own
ASR loader with identical logits, resume is exact, and the trained model streams exactly as it decodes offline.

The data is a toy language of tone-coded "words" rendered with numpy (no synthesiser needed) in synth-speech's
manifest format, so the whole file runs in seconds on CPU.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import soundfile
import torch
from cli_common import one_error_line, run_cli

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.cli import main
from runtime.cli_parser import build_parser
from runtime.config import ASRConfig
from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.asr.fastconformer.asr import find_checkpoint
from runtime.models.asr.fastconformer.checkpoint import load_checkpoint
from runtime.models.asr.registry import load_asr
from runtime.train.ctc_batched import encode_batch
from runtime.train.ctc_data import batch_for_step, collate, load_split, make_batches, shortest_pool
from runtime.train.fastconformer import TrainConfig, train_model
from runtime.train.fastconformer_config import lookahead_weights

os.environ["HF_HUB_OFFLINE"] = "1"
# One worker for the whole file under xdist: its module fixtures train the model, and split across two workers
# each trained it (CI from a cold cache, 2026-11-29: 135 s and 119 s of setup, one per worker; 4 s quiet).
pytestmark = pytest.mark.xdist_group("train_fastconformer")

WORDS = ("ba", "di", "ku", "mo", "pe", "sa")
STEPS, SAVE_EVERY = 60, 30


def render(words: list[str], rng: np.random.Generator) -> np.ndarray:
    """Each word: two 120 ms tones (a pitch pair of its own) with a short gap; 80 ms of silence between words."""
    t = np.arange(int(0.12 * SAMPLE_RATE)) / SAMPLE_RATE
    parts = [np.zeros(int(0.1 * SAMPLE_RATE))]
    for w in words:
        i = WORDS.index(w)
        for freq in (300 + 170 * i, 2200 - 210 * i):
            parts += [0.3 * np.sin(2 * np.pi * freq * t), np.zeros(int(0.02 * SAMPLE_RATE))]
        parts.append(np.zeros(int(0.08 * SAMPLE_RATE)))
    audio = np.concatenate(parts)
    return (audio + 0.003 * rng.standard_normal(len(audio))).astype(np.float32)


def write_dataset(root, n_train: int = 32, n_heldout: int = 4):
    rng = np.random.default_rng(0)
    for split, count in (("train", n_train), ("heldout", n_heldout)):
        (root / split).mkdir(parents=True)
        with open(root / f"{split}.jsonl", "w") as f:
            for i in range(count):
                words = [WORDS[int(k)] for k in rng.integers(0, len(WORDS), int(rng.integers(3, 7)))]
                audio = render(words, rng)
                rel = f"{split}/{i:06d}.flac"
                soundfile.write(str(root / rel), audio, SAMPLE_RATE, subtype="PCM_16")
                f.write(json.dumps({"audio": rel, "text": " ".join(words), "voice": "tones",
                                    "duration": round(len(audio) / SAMPLE_RATE, 3)}) + "\n")
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("tones"))


def tiny_cfg(data, out, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), preset="tiny", subsampling=8, d_model=64, n_layers=2, n_heads=4,
                ff_expansion=2, sub_channels=32, conv_kernel=9, vocab=24, lr=5e-3, warmup=4, batch_seconds=12.0,
                steps=STEPS, save_every=SAVE_EVERY, seed=0, device="cpu", quiet=True, short_first=0.5,
                short_first_steps=10, grow_steps=20, voice_warp=0.05, tempo=0.1)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, train_model(tiny_cfg(dataset, out))


def test_loss_goes_down_and_outputs_are_written(trained):
    out, result = trained
    losses = result.losses
    assert len(losses) == STEPS and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:2])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        f"checkpoint-{SAVE_EVERY}", f"checkpoint-{STEPS}"]
    assert sorted(p.name for p in (out / "model").iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / f"checkpoint-{STEPS}" / "trainer_state.pt").is_file()
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["trained_lookahead_ms"] == [1040, 480, 80, 0]
    assert config["features"]["fixed_mean"] is not None  # the training set's normalisation ships with the model
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["heldout"]) == {"lookahead_1040ms", "lookahead_480ms", "lookahead_80ms", "lookahead_0ms"}
    assert all(m["wer"] < 1.0 for m in metrics["heldout"].values())  # it learnt something
    assert len((out / "log.jsonl").read_text().splitlines()) == STEPS


def test_checkpoint_loads_through_the_runtime_with_equal_logits(trained, dataset):
    out, result = trained
    asr = load_asr(ASRConfig(backend="fastconformer", model=str(out / "model"), lookahead_ms=0),
                   device="cpu", dtype="float32")
    audio, _ = soundfile.read(str(dataset / "heldout" / "000000.flac"), dtype="float32")
    for context in result.model.cfg.att_context_sizes:
        with torch.inference_mode():
            want = result.model.decoder(result.model.encode_offline(audio, context).unsqueeze(0))
            got = asr.model.decoder(asr.model.encode_offline(audio, context).unsqueeze(0))
        assert torch.equal(want, got)
    assert asr.tokenizer.to_json() == result.tokenizer.to_json()
    assert find_checkpoint(str(out / "model" / "model.safetensors")) == out / "model"
    assert find_checkpoint(str(out / f"checkpoint-{STEPS}")) == out / f"checkpoint-{STEPS}"  # loadable as is


def test_incomplete_directories_are_named_plainly(trained, tmp_path):
    out, _ = trained
    shutil.copy(out / "model" / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointNotFound, match="no config.json"):
        find_checkpoint(str(tmp_path))
    shutil.copy(out / "model" / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match="missing tokenizer.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match="no .nemo file"):
        find_checkpoint(str(tmp_path / "empty"))


def test_batched_forward_equals_each_utterance_alone(trained, dataset):
    _, result = trained
    model = result.model
    utts = load_split(dataset, "heldout")
    feats = [model.preprocessor.featurizer(soundfile.read(str(u.audio), dtype="float32")[0]) for u in utts]
    assert len({f.shape[0] for f in feats}) > 1  # padding is exercised
    batch, lengths = collate(feats)
    for context in model.cfg.att_context_sizes:
        with torch.no_grad():
            enc, n = encode_batch(model.encoder, batch, lengths, context)
            for i, f in enumerate(feats):
                alone = model.encoder(f.unsqueeze(0), context)[0]
                assert alone.shape[0] == int(n[i])
                assert (enc[i, : int(n[i])] - alone).abs().max().item() < 1e-4


def test_resume_continues_exactly(trained, dataset, tmp_path):
    out, result = trained
    run = tmp_path / "run"
    shutil.copytree(out, run)
    shutil.rmtree(run / f"checkpoint-{STEPS}")
    shutil.rmtree(run / "model")
    with pytest.raises(ConfigError, match="--resume"):
        train_model(tiny_cfg(dataset, run))
    resumed = train_model(tiny_cfg(dataset, run, resume=True))
    assert resumed.losses == result.losses[SAVE_EVERY:]
    assert len((run / "log.jsonl").read_text().splitlines()) == STEPS
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, result.model.state_dict()[name]), name


def test_saved_checkpoint_streams_its_offline_transcript(trained, dataset):
    out, _ = trained
    audio, _ = soundfile.read(str(dataset / "heldout" / "000001.flac"), dtype="float32")
    for lookahead in (0, 1040):
        asr = load_asr(ASRConfig(backend="fastconformer", model=str(out / "model"), lookahead_ms=lookahead),
                       device="cpu", dtype="float32")
        offline = asr.model.transcribe_offline(audio, asr.context)
        stream = asr.open_stream()
        pos = 0
        for size in np.random.default_rng(lookahead).integers(200, 4000, size=100):
            if pos >= len(audio):
                break
            stream.accept(AudioChunk(audio[pos : pos + int(size)], pos))
            pos += int(size)
        stream.finish()
        assert offline and stream.token_ids == offline


def test_buckets_respect_the_padded_budget():
    lengths = [100, 300, 120, 310, 500, 90, 800]
    batches = make_batches(lengths, 900)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in b) * len(b) <= 900 or len(b) == 1 for b in batches)


def test_cli_recipe(dataset, tmp_path):
    args = build_parser().parse_args(["train", "fastconformer", "--data", str(dataset), "--out", str(tmp_path)])
    assert args.recipe == "fastconformer" and args.preset == "small"
    argv = ["train", "fastconformer", "--data", str(dataset), "--out", str(tmp_path / "o"), "--preset", "tiny",
            "--steps", "2", "--save-every", "1", "--eval-limit", "1", "--quiet", "--device", "cpu"]
    assert main(argv) == 0
    assert (tmp_path / "o" / "model" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["steps"] == 2


def test_short_clips_first_then_every_bucket():
    n, fraction, hold, grow = 40, 0.1, 30, 60
    pools = [shortest_pool(step, n, fraction, hold, grow) for step in range(200)]
    assert pools[:hold + 1] == [4] * (hold + 1)  # the shortest 10 % alone
    assert pools == sorted(pools) and pools[hold + grow] == n and set(pools[hold + grow:]) == {n}
    assert shortest_pool(0, n, 1.0, hold, grow) == n  # --short-first 1: no curriculum
    drawn = [batch_for_step(step, n, 0, pools[step]) for step in range(200)]
    assert all(b < pools[s] for s, b in enumerate(drawn))
    assert len(set(drawn[:hold])) > 1  # a draw among them, not always the same bucket
    assert drawn == [batch_for_step(step, n, 0, pools[step]) for step in range(200)]  # pure: resume is exact
    epoch = [batch_for_step(step, n, 0, n) for step in range(n * 3, n * 4)]
    assert sorted(epoch) == list(range(n))  # afterwards, every bucket once per epoch


def test_curriculum_flags_are_checked(dataset, tmp_path):
    with pytest.raises(ConfigError, match="--short-first"):
        train_model(tiny_cfg(dataset, tmp_path / "out", short_first=0.0))
    with pytest.raises(ConfigError, match="--voice-warp"):
        train_model(tiny_cfg(dataset, tmp_path / "out", voice_warp=1.0))
    with pytest.raises(ConfigError, match="--tempo"):
        train_model(tiny_cfg(dataset, tmp_path / "out", tempo=-0.1))


def test_a_4x_subsampled_model_trains_and_streams_exactly(dataset, tmp_path):
    out = tmp_path / "sub4"
    result = train_model(tiny_cfg(dataset, out, subsampling=4, steps=40, save_every=40, short_first=1.0))
    assert result.model.cfg.subsampling_factor == 4 and result.model.cfg.frame_seconds == 0.04
    audio, _ = soundfile.read(str(dataset / "heldout" / "000002.flac"), dtype="float32")
    asr = load_asr(ASRConfig(backend="fastconformer", model=str(out / "model"), lookahead_ms=0),
                   device="cpu", dtype="float32")
    offline = asr.model.transcribe_offline(audio, asr.context)
    stream = asr.open_stream()
    for pos in range(0, len(audio), 1234):
        stream.accept(AudioChunk(audio[pos : pos + 1234], pos))
    stream.finish()
    assert offline and stream.token_ids == offline


def test_lookahead_weights_are_parsed_against_the_trained_lookaheads():
    offered = [1040, 480, 80, 0]
    assert lookahead_weights("", offered) is None  # uniform: the draw earlier runs made
    assert lookahead_weights("0=3", offered) == [1.0, 1.0, 1.0, 3.0]
    assert lookahead_weights(" 1040=0, 80=0.5 ", offered) == [0.0, 1.0, 0.5, 1.0]
    for bad in ("240=2", "0=3,0=1", "0=-1", "0", "zero=1", "0=nan", "0=inf", "1040=0,480=0,80=0,0=0"):
        with pytest.raises(ConfigError, match="--lookahead-weights"):
            lookahead_weights(bad, offered)


def test_lookahead_weights_decide_which_lookaheads_train(dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"\[1040, 480, 80, 0\]"):  # before any feature is computed
        train_model(tiny_cfg(dataset, tmp_path / "bad", lookahead_weights="240=1"))
    train_model(tiny_cfg(dataset, tmp_path / "w", steps=40, save_every=40, lookahead_weights="1040=0,480=0,0=3"))
    drawn = [json.loads(line)["lookahead_ms"] for line in (tmp_path / "w" / "log.jsonl").read_text().splitlines()]
    assert set(drawn) == {80, 0} and drawn.count(0) > drawn.count(80)  # 3 : 1 expected over 40 steps
    config = json.loads((tmp_path / "w" / "model" / "config.json").read_text())
    assert config["training"]["lookahead_weights"] == "1040=0,480=0,0=3"


@pytest.mark.parametrize("flags", [
    ["--hours", "0"], ["--hours", "-1"], ["--hours", "nan"], ["--hours", "inf"], ["--vocab", "1"],
    ["--vocab", "0"], ["--threads", "-1"], ["--lr", "-1"], ["--lr", "0"], ["--lr", "nan"], ["--d-model", "0"],
    ["--d-model", "66"], ["--d-model", "63", "--n-heads", "3"], ["--n-layers", "0"], ["--weight-decay", "-1"],
    ["--weight-decay", "nan"], ["--clip", "0"], ["--clip", "nan"], ["--batch-seconds", "nan"],
    ["--eval-limit", "-1"], ["--warmup", "-1"]])
def test_bad_numbers_are_one_line_before_any_data_is_read(capsys, tmp_path, flags):
    # --data does not exist: the flag must be refused before the data is looked at, and nothing written
    code, _, err = run_cli(capsys, "train", "fastconformer", "--data", str(tmp_path / "no-data"), "--out",
                           str(tmp_path / "out"), *flags)
    flag = "--n-heads" if flags == ["--d-model", "66"] else flags[0]
    assert code != 0 and one_error_line(err).startswith(f"runtime: error: {flag} "), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_vocab_too_small_for_the_transcripts_says_the_minimum(dataset, tmp_path):
    # the tone words use 11 letters, plus the word boundary: the unigram trainer needs 12 pieces
    with pytest.raises(ConfigError, match="--vocab 11 is too small.* at least 12"):
        train_model(tiny_cfg(dataset, tmp_path / "out", vocab=11))


def test_an_out_that_cannot_be_a_folder_is_one_line(capsys, dataset, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, message in [(afile, "is a file, not a folder"), (afile / "sub", "afile is a file, not a folder"),
                         ("/proc/nope", "cannot create --out /proc/nope: ")]:
        code, _, err = run_cli(capsys, "train", "fastconformer", "--data", str(dataset), "--out", str(out),
                               "--preset", "tiny", "--steps", "1", "--quiet", "--device", "cpu")
        assert code != 0 and message in one_error_line(err) and "Traceback" not in err
