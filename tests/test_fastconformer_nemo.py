"""FastConformer `.nemo` archives, tokenizer files, the `StreamingASR` backend and what is refused."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from runtime.chunks import AudioChunk
from runtime.config import ASRConfig
from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.asr.fastconformer import FastConformerASR, build_tiny_fastconformer, load_nemo, save_nemo
from runtime.models.asr.fastconformer.features import FeatureConfig, MelFeaturizer
from runtime.models.asr.fastconformer.model import FastConformerCTC
from runtime.models.asr.fastconformer.nemo import config_from_nemo
from runtime.models.asr.fastconformer.tiny import TINY_NEMO_NAME, fastconformer_114m_config, synthetic_audio


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    return build_tiny_fastconformer(tmp_path_factory.mktemp("fc"), seed=0)


@pytest.fixture(scope="module")
def tiny(archive):
    return load_nemo(archive)


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def write(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def rewrite(archive: Path, out: Path, *, config=None, state=None, drop=()) -> Path:
    """A copy of `archive` with its config and/or state dict changed by callables."""
    files = {k: v for k, v in members(archive).items() if not k.endswith(tuple(drop))}
    if config:
        cfg = yaml.safe_load(files["./model_config.yaml"])
        config(cfg)
        files["./model_config.yaml"] = yaml.safe_dump(cfg).encode()
    if state:
        sd = torch.load(io.BytesIO(files["./model_weights.ckpt"]), weights_only=True)
        sd = state(sd)
        buf = io.BytesIO()
        torch.save(sd, buf)
        files["./model_weights.ckpt"] = buf.getvalue()
    return write(out, files)


def test_archive_layout_and_nemo_names(archive):
    files = members(archive)
    assert set(files) == {"./model_config.yaml", "./model_weights.ckpt", "./tokenizer.model", "./tokenizer.json"}
    sd = torch.load(io.BytesIO(files["./model_weights.ckpt"]), weights_only=True)
    for key in (
        "preprocessor.featurizer.fb",
        "encoder.pre_encode.conv.0.weight",
        "encoder.pre_encode.conv.2.weight",  # depthwise
        "encoder.pre_encode.conv.3.weight",  # pointwise
        "encoder.pre_encode.out.weight",
        "encoder.layers.0.self_attn.linear_q.weight",
        "encoder.layers.0.self_attn.linear_pos.weight",
        "encoder.layers.1.self_attn.pos_bias_u",
        "encoder.layers.0.conv.depthwise_conv.weight",
        "encoder.layers.0.conv.batch_norm.weight",
        "encoder.layers.1.feed_forward2.linear1.weight",
        "decoder.decoder_layers.0.weight",
    ):
        assert key in sd, key
    assert sd["encoder.pre_encode.out.weight"].shape == (64, 32 * 11)  # causal padding: 80 -> 41 -> 21 -> 11
    assert sd["decoder.decoder_layers.0.weight"].shape == (129, 64, 1)  # 128 tokens + blank


def test_round_trip_is_identical(tmp_path, tiny):
    model, tokenizer = tiny
    again, tok2 = load_nemo(save_nemo(model, tokenizer, tmp_path / "copy.nemo"))
    sd1, sd2 = model.state_dict(), again.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    audio = synthetic_audio(3.0, seed=2)
    assert torch.equal(model.encode_offline(audio, (70, 6)), again.encode_offline(audio, (70, 6)))
    assert (tmp_path / "copy.nemo").read_bytes() == save_nemo(again, tok2, tmp_path / "copy2.nemo").read_bytes()


def test_sentencepiece_model_alone_decodes_the_same(tmp_path, archive, tiny):
    """Real archives carry only a SentencePiece tokenizer.model: read without the sentencepiece package."""
    _, tokenizer = tiny
    _, spm = load_nemo(rewrite(archive, tmp_path / "spm.nemo", drop=["tokenizer.json"]))
    assert spm.vocab_size == tokenizer.vocab_size
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, tokenizer.vocab_size, size=int(rng.integers(1, 12))).tolist()
        assert spm.decode(ids) == tokenizer.decode(ids)
    text = "the weather will be cloudy tomorrow"
    assert spm.encode(text) == tokenizer.encode(text) and tokenizer.decode(tokenizer.encode(text)) == text


def test_hybrid_rnnt_ctc_archive_uses_its_ctc_branch(tmp_path, archive, tiny):
    model, _ = tiny

    def config(cfg):
        cfg["aux_ctc"] = {"decoder": cfg["decoder"]}
        cfg["decoder"] = {"_target_": "nemo.collections.asr.modules.RNNTDecoder", "vocab_size": 128}

    def state(sd):
        sd = {("ctc_" + k if k.startswith("decoder.") else k): v for k, v in sd.items()}
        sd["decoder.prediction.embed.weight"] = torch.zeros(129, 8)
        sd["joint.joint_net.2.weight"] = torch.zeros(129, 8)
        return sd

    hybrid, _ = load_nemo(rewrite(archive, tmp_path / "hybrid.nemo", config=config, state=state))
    audio = synthetic_audio(2.0, seed=4)
    assert hybrid.transcribe_offline(audio, (70, 0)) == model.transcribe_offline(audio, (70, 0))
    assert torch.equal(hybrid.decoder.decoder_layers[0].weight, model.decoder.decoder_layers[0].weight)


def _set(path: str, value):
    def change(cfg):
        *parents, key = path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[key] = value

    return change


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (_set("encoder.self_attention_model", "abs_pos"), "self_attention_model"),
        (_set("encoder.subsampling", "striding"), "subsampling"),
        (_set("encoder.causal_downsampling", False), "causal_downsampling"),
        (_set("encoder.conv_context_size", None), "conv_context_size"),
        (_set("encoder.att_context_style", "regular"), "att_context_style"),
        (_set("encoder.att_context_size", [-1, -1]), "att_context_size"),
        (_set("encoder.conv_norm_type", "group_norm2"), "conv_norm_type"),
        (_set("preprocessor.normalize", "per_feature"), "normalize"),
        (_set("preprocessor.sample_rate", 8000), "sample_rate"),
        (_set("decoder._target_", "nemo.collections.asr.modules.RNNTDecoder"), "RNNT"),
        (_set("tokenizer.type", "wpe"), "tokenizer.type"),
        (_set("decoder.num_classes", 100), "tokenizer has 128 tokens"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(tmp_path, archive, change, needle):
    with pytest.raises(ConfigError) as err:
        load_nemo(rewrite(archive, tmp_path / "bad.nemo", config=change))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        (lambda sd: {**sd, "encoder.layers.0.adapter_layer.lin.weight": torch.zeros(2)}, "unsupported parameters"),
        (lambda sd: {k: v for k, v in sd.items() if "linear_pos" not in k}, "missing parameters"),
        (lambda sd: {**sd, "encoder.layers.0.self_attn.pos_bias_u": torch.zeros(3, 3)}, "has shape"),
    ],
)
def test_mismatched_weights_are_refused(tmp_path, archive, state, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_nemo(rewrite(archive, tmp_path / "bad.nemo", state=state))
    assert "\n" not in str(err.value)


def test_broken_archives_are_refused(tmp_path, archive):
    (tmp_path / "junk.nemo").write_bytes(b"not a tar")
    with pytest.raises(ConfigError, match="not a readable .nemo"):
        load_nemo(tmp_path / "junk.nemo")
    with pytest.raises(ConfigError, match="no tokenizer.model"):
        load_nemo(rewrite(archive, tmp_path / "notok.nemo", drop=["tokenizer.json", "tokenizer.model"]))
    with pytest.raises(ConfigError, match="no model_weights.ckpt"):
        load_nemo(rewrite(archive, tmp_path / "noweights.nemo", drop=["model_weights.ckpt"]))


def test_load_from_file_or_directory_and_lookahead(tmp_path, archive):
    from_file = FastConformerASR.load(ASRConfig(model=str(archive), lookahead_ms=80), device="cpu", dtype="float32")
    assert from_file.context == (70, 1)
    lines: list[str] = []
    from_dir = FastConformerASR.load(
        ASRConfig(model=str(archive.parent), lookahead_ms=0), device="cpu", dtype="float32", progress=lines.append
    )
    assert from_dir.context == (70, 0) and any("loaded" in line for line in lines)
    with pytest.raises(ConfigError, match="one of 0, 80, 480, 1040"):
        FastConformerASR.load(ASRConfig(model=str(archive), lookahead_ms=500), device="cpu", dtype="float32")
    two = tmp_path / "two"
    two.mkdir()
    for name in (TINY_NEMO_NAME, "other.nemo"):
        (two / name).write_bytes(archive.read_bytes())
    with pytest.raises(CheckpointNotFound, match="2 .nemo files"):
        FastConformerASR.load(ASRConfig(model=str(two)), device="cpu", dtype="float32")


class _LabelsAsLogits(torch.nn.Module):
    """A CTC head whose 'encoder frames' are already one-hot label logits."""

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return frames


def test_items_complete_at_pauses_and_repeats_collapse_across_calls(tmp_path, archive):
    model, tokenizer = load_nemo(archive)
    model.decoder = _LabelsAsLogits()
    asr = FastConformerASR(model, tokenizer, ASRConfig(lookahead_ms=0))
    blank, a, b, c = model.blank, 16, 60, 63  # '▁the', '▁wi', '▁be' (any ids work)
    labels = [a, a, blank, blank, blank, a] + [blank] * 10 + [b, b, blank, c, c]
    stream = asr.open_stream()

    def frames(seq):
        return torch.nn.functional.one_hot(torch.tensor(seq), model.blank + 1).float()

    parts = [[a], [a, blank], [blank, blank, a, blank], [blank] * 8, [blank, b], [b, blank, c], [c]]
    assert sum(parts, []) == labels  # the same sequence, cut inside runs of repeats and blanks
    updates = []
    for part in parts:
        updates += stream._decode(frames(part))
    updates += stream.finish()
    assert stream.token_ids == [a, a, b, c]
    done = [u for u in updates if u.completed]
    assert [d.transcript for d in done] == [tokenizer.decode([a, a]), tokenizer.decode([b, c])]
    assert [(d.start, d.end) for d in done] == [(0.0, pytest.approx(0.48)), (pytest.approx(1.28), pytest.approx(1.68))]
    assert len({d.item_id for d in done}) == 2
    for d in done:
        assert "".join(u.delta for u in updates if u.item_id == d.item_id) == d.transcript


def test_stream_checks_contiguity_and_closes(tiny):
    model, tokenizer = tiny
    stream = FastConformerASR(model, tokenizer, ASRConfig(lookahead_ms=480)).open_stream()
    audio = synthetic_audio(0.5, seed=1)
    stream.accept(AudioChunk(audio[:800], 16000))
    with pytest.raises(ValueError, match="gap"):
        stream.accept(AudioChunk(audio[900:1000], 16900))
    stream.accept(AudioChunk(audio[800:], 16800))
    stream.finish()
    assert stream.finish() == []
    stream.close()
    with pytest.raises(RuntimeError):
        stream.accept(AudioChunk(audio[:10], 16000 + len(audio)))


def test_features_match_nemo_stft_framing():
    """Our exactly-incremental featurizer is NeMo's: torch.stft(center=True, pad_mode='constant')."""
    featurizer = MelFeaturizer(FeatureConfig())
    for n in (199, 401, 16000, 16159, 16160):
        audio = synthetic_audio(n / 16000, seed=n)
        x = torch.from_numpy(audio).double()
        x = torch.cat([x[:1], x[1:] - 0.97 * x[:-1]])
        spec = torch.stft(x, 512, 160, 400, featurizer.window.double(), center=True, pad_mode="constant",
                          return_complex=True)
        ref = torch.log(featurizer.fb[0].double() @ spec.abs().square() + 2**-24).T
        ours = featurizer(audio)
        assert ours.shape == (n // 160 + 1, 80) and (ours.double() - ref).abs().max().item() < 1e-4


def test_114m_config_has_the_real_shape():
    cfg, prefix = config_from_nemo(fastconformer_114m_config())
    assert prefix == "decoder" and cfg.att_context_sizes == ((70, 13), (70, 6), (70, 1), (70, 0))
    with torch.device("meta"):
        model = FastConformerCTC(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert 105e6 < params < 112e6  # the hybrid's extra ~5M are its RNNT prediction and joint networks
    assert [cfg.lookahead_ms(c) for c in cfg.att_context_sizes] == [1040, 480, 80, 0]
