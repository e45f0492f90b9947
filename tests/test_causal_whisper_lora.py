"""LoRA adapters for causal Whisper and `runtime train causal-whisper`: targets, zero-init identity, the loss
going down, saved adapters reproducing the trained model, exact resume."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from cli_common import one_error_line, run_cli
from transformers import AutoTokenizer, WhisperConfig, WhisperForConditionalGeneration

from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.encoder import CausalWhisperEncoder
from runtime.models.asr.causal_whisper.lora import add_lora, load_adapter
from runtime.models.asr.whisper_checkpoint import transcript_prompt
from runtime.models.loading import resolve_checkpoint
from runtime.train import causal_whisper
from runtime.train.causal_whisper import TrainConfig, decoder_logits, encode_text, loss_and_logits, make_batch, train
from runtime.train.data import load_examples
from runtime.train.token_times import cached_token_ends

TEXTS = ["the quick brown fox", "good morning everyone", "listen carefully to the river", "thank you very much"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short tones in noise with transcripts; one 8 kHz file exercises the resampling (PyAV) path."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for i, text in enumerate(TEXTS):
        rate = 8_000 if i == 3 else 16_000
        n = rate * (2 + i) // 4
        t = np.arange(n) / rate
        x = 0.3 * np.sin(2 * np.pi * (200 + 150 * i) * t) + 0.05 * rng.standard_normal(n)
        soundfile.write(root / f"clip{i}.wav", x.astype(np.float32), rate)
        (root / f"clip{i}.txt").write_text(text + "\n")
    (root / "orphan.txt").write_text("no audio beside me")
    return root


def base_model() -> WhisperForConditionalGeneration:
    return WhisperForConditionalGeneration.from_pretrained(resolve_checkpoint("tiny:whisper", role="asr")).eval()


def config(data_dir: Path, out: Path, **kw) -> TrainConfig:
    defaults = dict(base="tiny:whisper", data=str(data_dir), out=str(out), steps=30, batch_size=2, lr=1e-2,
                    save_every=10, chunk_ms=40)
    return TrainConfig(**{**defaults, **kw})


def probe_logits(model: torch.nn.Module, data_dir: Path) -> torch.Tensor:
    """Logits of a fixed batch (all clips) through the block-causal encoder and the decoder."""
    path = resolve_checkpoint("tiny:whisper", role="asr")
    tok = AutoTokenizer.from_pretrained(path)
    clips = [(ex.audio, encode_text(tok, ex.text)) for ex in load_examples(data_dir)]
    batch = make_batch(clips, transcript_prompt(tok, WhisperConfig.from_pretrained(path), "en"), tok.eos_token_id, 80)
    with torch.no_grad():
        return loss_and_logits(model, CausalWhisperEncoder(model, block_frames=2), batch)[1]


def test_the_recipes_flags_agree_with_the_model_code() -> None:
    """The flags live apart from torch (`causal_whisper_config`), with two numbers of the model code's own."""
    from runtime.models.asr.causal_whisper import encoder, lora
    from runtime.train import causal_whisper_config

    assert causal_whisper_config.RANK == lora.DEFAULT_RANK
    assert causal_whisper_config.FRAME_MS == encoder.FRAME_MS


def test_data_pairs_and_resampling(data_dir: Path) -> None:
    examples = load_examples(data_dir)
    assert [e.path.name for e in examples] == [f"clip{i}.wav" for i in range(4)]  # orphan.txt skipped
    assert [e.text for e in examples] == TEXTS
    assert [len(e.audio) for e in examples] == [8_000, 12_000, 16_000, 20_000]  # 8 kHz clip resampled to 16 kHz
    assert all(e.audio.dtype == np.float32 for e in examples)


def test_batch_layout_and_padding_masks() -> None:
    clips = [(np.zeros(3200, np.float32), [7, 8]), (np.full(1600, 0.1, np.float32), [9])]
    batch = make_batch(clips, [1, 2], 0, 80)
    assert batch.mel.shape == (2, 80, 20) and batch.frames.tolist() == [[10] * 4, [5] * 4]  # per position
    assert batch.input_ids.tolist() == [[1, 2, 7, 8], [1, 2, 9, 0]]
    assert batch.labels.tolist() == [[-100, 7, 8, 0], [-100, 9, 0, -100]]  # next token; prompt, padding ignored
    # The decoder reads only each row's own frames: changing row 1's padding frames changes nothing.
    model = base_model()
    states = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))
    other = states.clone()
    other[1, 5:] = 7.0
    with torch.no_grad():
        a, b = (decoder_logits(model, batch.input_ids, s, batch.frames) for s in (states, other))
        assert torch.equal(a, b)
        other[1, 4] = 7.0
        assert not torch.allclose(decoder_logits(model, batch.input_ids, other, batch.frames)[1], a[1])


def test_adapter_targets_and_zero_init_identity(data_dir: Path) -> None:
    model = base_model()
    before = probe_logits(model, data_dir)
    peft = add_lora(model)
    wrapped = {n.removeprefix("base_model.model.").rsplit(".lora_A", 1)[0]
               for n, _ in peft.named_parameters() if ".lora_A." in n}
    expected = {f"model.{part}.{proj}"
                for i in range(2)
                for part in (f"encoder.layers.{i}.self_attn", f"decoder.layers.{i}.self_attn",
                             f"decoder.layers.{i}.encoder_attn")
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj")}
    assert wrapped == expected
    cfg = peft.peft_config["default"]
    assert cfg.r == 16 and cfg.lora_alpha == 16
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert all(torch.count_nonzero(p) == 0 for n, p in peft.named_parameters() if ".lora_B." in n)
    assert torch.equal(probe_logits(peft, data_dir), before)


def test_training_lowers_loss_and_saved_adapter_reproduces_it(data_dir: Path, tmp_path: Path) -> None:
    model, losses = train(config(data_dir, tmp_path / "run"))
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    out = tmp_path / "run"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [e["loss"] for e in logged] == losses

    trained = probe_logits(model, data_dir)
    assert not torch.allclose(trained, probe_logits(base_model(), data_dir), atol=1e-3)
    loaded = load_adapter(base_model(), out / "adapter").eval()
    assert torch.equal(probe_logits(loaded, data_dir), trained)
    # Inference merges the adapter into the weights: same function up to float rounding.
    asr = CausalWhisperASR.load(ASRConfig(chunk_ms=40, adapter=str(out / "adapter")), device="cpu", dtype="float32")
    assert not hasattr(asr.model, "peft_config")
    torch.testing.assert_close(probe_logits(asr.model, data_dir), trained, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("stale", [0.0, 0.5])
def test_resume_continues_the_same_trajectory(data_dir: Path, tmp_path: Path, stale: float) -> None:
    _, straight = train(config(data_dir, tmp_path / "a", steps=8, save_every=3, stale_share=stale))
    parser = argparse.ArgumentParser()
    causal_whisper.add_arguments(parser)

    def argv(steps: int) -> list[str]:
        return ["--base", "tiny:whisper", "--data", str(data_dir), "--out", str(tmp_path / "b"), "--steps",
                str(steps), "--batch-size", "2", "--lr", "1e-2", "--save-every", "3", "--chunk-ms", "40",
                "--stale-share", str(stale)]

    assert causal_whisper.run(parser.parse_args(argv(5))) == 0
    # an interrupted run: the log went past the last checkpoint (6 steps logged, checkpoint-5 the latest)
    log = tmp_path / "b" / "log.jsonl"
    log.write_text(log.read_text() + json.dumps({"step": 6, "loss": 0.0}) + "\n")
    with pytest.raises(ConfigError, match="--resume"):
        causal_whisper.run(parser.parse_args(argv(8)))
    assert causal_whisper.run(parser.parse_args([*argv(8), "--resume"])) == 0
    resumed = [json.loads(line)["loss"] for line in log.read_text().splitlines()][5:]
    assert resumed == straight[5:]
    assert [json.loads(line)["loss"] for line in log.read_text().splitlines()] == straight


def test_stale_positions_train_on_token_times_kept_beside_the_run(data_dir: Path, tmp_path: Path) -> None:
    _, fresh = train(config(data_dir, tmp_path / "fresh", steps=2, lr=1e-30))
    _, stale = train(config(data_dir, tmp_path / "stale", steps=2, lr=1e-30, stale_share=1.0))
    assert all(a != b for a, b in zip(fresh, stale, strict=True))  # the same clips, read through stale positions
    assert not (tmp_path / "fresh" / "token_ends.json").exists()
    cache = tmp_path / "stale" / "token_ends.json"
    saved = json.loads(cache.read_text())
    timed = saved["clips"]
    assert saved["base"] == "tiny:whisper" and sorted(timed) == [f"clip{i}.wav" for i in range(4)]
    for entry in timed.values():
        assert len(entry["ends"]) == len(entry["ids"]) and entry["ends"] == sorted(entry["ends"])
    # timed once: the clips the cache holds, same ids and length, are not timed again (so "tiny:whisper" is not
    # even loaded); a changed clip is, and so is every clip for another base
    clips = [(key, np.zeros(entry["samples"]), entry["ids"]) for key, entry in timed.items()]
    assert cached_token_ends("tiny:whisper", clips, saved["prompt"], 0, cache) == [e["ends"] for e in timed.values()]
    with pytest.raises(ConfigError):  # the unknown base is loaded, to time the clip again
        cached_token_ends("tiny:nothing", clips, saved["prompt"], 0, cache)
    clips[0] = (clips[0][0], np.zeros(len(clips[0][1]) + 1), clips[0][2])
    with pytest.raises(ConfigError):
        cached_token_ends("tiny:nothing", clips, saved["prompt"], 0, cache)


def test_stale_positions_need_a_base_with_alignment_heads(capsys, data_dir: Path, tmp_path: Path) -> None:
    import shutil

    base = tmp_path / "base"
    shutil.copytree(resolve_checkpoint("tiny:whisper", role="asr"), base)
    generation = json.loads((base / "generation_config.json").read_text())
    (base / "generation_config.json").write_text(json.dumps({**generation, "alignment_heads": None}))
    code, _, err = run_cli(capsys, "train", "causal-whisper", "--base", str(base), "--data", str(data_dir),
                           "--out", str(tmp_path / "out"), "--stale-share", "0.5", "--steps", "1")
    assert code != 0 and "Traceback" not in err
    assert "--stale-share needs token times" in one_error_line(err) and "alignment_heads" in err


def test_init_starts_a_new_run_from_an_adapters_weights(data_dir: Path, tmp_path: Path) -> None:
    first, _ = train(config(data_dir, tmp_path / "first", steps=6, save_every=6))
    trained = probe_logits(first, data_dir)
    # lr this small moves no weight past float rounding: the run starts where the adapter ended, not at zero
    again, losses = train(config(data_dir, tmp_path / "again", steps=1, lr=1e-30, init=str(tmp_path / "first/adapter")))
    torch.testing.assert_close(probe_logits(again, data_dir), trained, rtol=0, atol=1e-6)
    fresh, fresh_losses = train(config(data_dir, tmp_path / "fresh", steps=1, lr=1e-30))
    assert not torch.allclose(probe_logits(fresh, data_dir), trained, atol=1e-3)
    assert losses[0] < fresh_losses[0]  # it had learned the clips already
    def base(run: str) -> str:
        return json.loads((tmp_path / run / "adapter/adapter_config.json").read_text())["base_model_name_or_path"]

    assert base("again") == base("fresh")  # the base this run trained for, recorded as a fresh run records it
    # an init adapter that names another base (same shapes) is trained for this one and says so
    config_path = tmp_path / "first/adapter/adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": "other"}))
    train(config(data_dir, tmp_path / "renamed", steps=1, lr=1e-30, init=str(tmp_path / "first/adapter")))
    assert base("renamed") == base("fresh") != "other"
    # --resume continues its own checkpoint: an --init that has gone since does not stop it
    _, resumed = train(config(data_dir, tmp_path / "again", steps=2, lr=1e-30, init=str(tmp_path / "gone"),
                              resume=True))
    assert len(resumed) == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--init", "no-such-adapter"], "--init no-such-adapter: no adapter there"),
    (["--rank", "0"], "--rank must be at least 1"), (["--steps", "0"], "--steps must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"), (["--save-every", "-1"], "--save-every"),
    (["--chunk-ms", "30"], "--chunk-ms must be positive multiples of 20"), (["--chunk-ms", "0"], "--chunk-ms"),
    (["--lr", "0"], "--lr must be a finite number > 0"), (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"),
    (["--stale-share", "1.5"], "--stale-share must be between 0 and 1"), (["--stale-share", "nan"], "--stale-share"),
    (["--stale-share", "1", "--stale-lag-ms", "30"], "--stale-lag-ms must be a multiple of 20"),
    (["--stale-share", "1", "--stale-lag-ms", "-20"], "--stale-lag-ms"),
    (["--stale-lag-ms", "200"], "--stale-lag-ms applies to stale positions only")])
def test_bad_numbers_are_one_line_before_the_model_loads(capsys, tmp_path: Path, flags: list[str],
                                                          message: str) -> None:
    code, _, err = run_cli(capsys, "train", "causal-whisper", "--base", "tiny:whisper", "--data",
                           str(tmp_path / "no-data"), "--out", str(tmp_path / "out"), *flags)
    assert code != 0 and message in one_error_line(err) and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_one_line(capsys, data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    code, _, err = run_cli(capsys, "train", "causal-whisper", "--base", "tiny:whisper", "--data", str(data_dir),
                           "--out", str(tmp_path / "afile"))
    assert code != 0 and "is a file, not a folder" in one_error_line(err) and "Traceback" not in err


@pytest.mark.parametrize("change", [{"d_model": 96}, {"encoder_layers": 3, "decoder_layers": 3}])
def test_an_adapter_for_another_base_is_refused_in_one_line(tmp_path: Path, change: dict) -> None:
    """Other widths fail inside peft with a size mismatch, more layers load only partly with a warning: either
    way the user learns in one line that the adapter belongs to another base model."""
    base = base_model()
    add_lora(base).save_pretrained(tmp_path / "adapter")  # an adapter of the tiny base (zero-initialised B)
    other = WhisperForConditionalGeneration(type(base.config)(**{**base.config.to_dict(), **change}))
    with pytest.raises(ValueError, match="trained for another base model"):
        load_adapter(other, tmp_path / "adapter")
    assert isinstance(load_adapter(base_model(), tmp_path / "adapter"), torch.nn.Module)  # its own base loads


def test_length_buckets_keep_epochs_whole_and_batches_alike() -> None:
    from runtime.train.causal_whisper import batch_indices

    lengths = [(i * 7919) % 1000 for i in range(160)]
    for seed in (0, 1):
        epoch = [i for step in range(20) for i in batch_indices(step, 160, 8, seed, lengths)]
        assert sorted(epoch) == list(range(160))  # every clip once an epoch
        assert epoch == [i for step in range(20) for i in batch_indices(step, 160, 8, seed, lengths)]  # pure
        spread = sum(max(lengths[i] for i in epoch[k : k + 8]) - min(lengths[i] for i in epoch[k : k + 8])
                     for k in range(0, 160, 8))
        plain = [i for step in range(20) for i in batch_indices(step, 160, 8, seed)]
        assert sorted(plain) == list(range(160))
        random_spread = sum(max(lengths[i] for i in plain[k : k + 8]) - min(lengths[i] for i in plain[k : k + 8])
                            for k in range(0, 160, 8))
        assert spread * 4 < random_spread  # padding within a batch is a fraction of a random batch's
