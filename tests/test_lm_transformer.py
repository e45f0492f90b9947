"""Our Transformer loads real transformers checkpoints (Llama, Qwen2; single-file and sharded safetensors) and
its logits equal the transformers model's own forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_common import save_random_model
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.lm.transformer import Transformer
from runtime.models.lm.transformer_build import load_transformer
from runtime.models.lm.weights import read_config

TOL = 1e-4
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
VARIANTS = {
    "llama": ("llama", None),
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 2.0}),
    "llama-llama3": ("llama", LLAMA3),
    "qwen2": ("qwen2", None),
}


def build(kind: str, path: Path, rope: dict | None = None, **extra) -> PreTrainedModel:
    """A tiny random model saved with save_pretrained (safetensors); biases made non-zero so they count."""
    common = dict(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=4096, rms_norm_eps=1e-5)
    if kind == "llama":
        cfg = LlamaConfig(**common, head_dim=16, attention_bias=True, mlp_bias=True, rope_scaling=rope,
                          rope_theta=500.0, **extra)
        cls = LlamaForCausalLM
    else:
        cfg = Qwen2Config(**common, tie_word_embeddings=True, **extra)
        cls = Qwen2ForCausalLM
    return save_random_model(cls, cfg, path)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory) -> tuple[PreTrainedModel, Transformer]:
    kind, rope = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    ref = build(kind, path, rope)
    return ref, load_transformer(path)


def test_logits_equal_transformers(pair) -> None:
    ref, ours = pair
    ids = torch.randint(0, ref.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]
    got = ours(ids, torch.arange(150))
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= TOL
    assert (ours(ids, torch.arange(150), last_only=True)[0] - expected[-1]).abs().max() <= TOL
    # without the head (a prefill that only fills the cache): the last layer's states, which the final norm makes
    # transformers' last hidden state
    hidden = ours(ids, torch.arange(150), head=False)
    assert hidden.shape == (150, ref.config.hidden_size)
    with torch.no_grad():
        states = ref.model(ids).last_hidden_state[0]
    assert (ours.model.norm.forward(hidden) - states).abs().max() <= TOL


def test_config_is_read(tmp_path: Path) -> None:
    build("llama", tmp_path, LLAMA3)
    args = read_config(tmp_path)
    assert (args.head_dim, args.num_kv_heads, args.qkv_bias, args.o_bias, args.mlp_bias) == (16, 2, True, True, True)
    assert args.rope_scaling["rope_type"] == "llama3" and args.rope_theta == 500.0
    build("qwen2", tmp_path)
    args = read_config(tmp_path)
    assert (args.qkv_bias, args.o_bias, args.tie_word_embeddings, args.rope_scaling) == (True, False, True, {})


def test_legacy_rope_keys_are_read(tmp_path: Path) -> None:
    """Older checkpoints write rope_theta + rope_scaling {"type": ...} instead of rope_parameters."""
    build("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = read_config(tmp_path)
    assert args.rope_theta == 1234.0 and args.rope_scaling["rope_type"] == "linear"


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    ref = build("qwen2", tmp_path)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours = load_transformer(tmp_path / "sharded")
    ids = torch.arange(40)[None] % 211
    with torch.no_grad():
        assert (ours(ids, torch.arange(40)) - ref(ids).logits[0]).abs().max() <= TOL


def test_half_precision_loads_on_request(tmp_path: Path) -> None:
    build("qwen2", tmp_path)
    ours = load_transformer(tmp_path, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours(torch.arange(10), torch.arange(10)).dtype == torch.float32


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope scaling 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "sliding-window"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    build("qwen2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError, match=message) as err:
        load_transformer(tmp_path)
    assert "\n" not in str(err.value)


def test_missing_weights_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match="no config.json"):
        load_transformer(tmp_path)
    build("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFound, match="no model.safetensors"):
        load_transformer(tmp_path)
