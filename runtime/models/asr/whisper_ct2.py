"""A CTranslate2 Whisper directory (faster-whisper's format) turned into a transformers Whisper checkpoint.

CTranslate2 stores Whisper as a `WhisperSpec` in `model.bin` (read by `models/ctranslate2_file.py`) with
`config.json` (alignment heads, suppressed ids) and the tokenizer (`tokenizer.json`). Its layout differs
from transformers' in three ways this module undoes:

- self-attention q/k/v are one fused projection ([3d, d]) and cross-attention k/v another ([2d, d]); the
  key projection has no bias in Whisper, so its slice of the fused bias is zero (checked, not assumed);
- variables that hold the same values are stored once and aliased (the output projection is the token
  embedding; a converter also aliases equal arrays, e.g. zero biases), so an absent variable may be an alias;
- sizes are not written down: layers are counted, widths read off the weights, heads from `num_heads`.

`converted_checkpoint` writes the result once into the cache as an ordinary transformers directory (keyed
by the sha256 of `model.bin`), so every Whisper path in the runtime (causal, buffered, training, the
offline reference) loads it with `from_pretrained` like any other checkpoint. CTranslate2 itself is never
imported here; the tests check this reader against CTranslate2's own converter and its `generate`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.errors import CheckpointNotFound
from runtime.models.ctranslate2_file import CT2Model, read_model_bin
from runtime.models.packaged import sha256_file

MULTILINGUAL_VOCAB = 51865  # Whisper's own rule: a vocabulary this large (or larger) holds the language tokens
CONVERTED_VERSION = 1  # bump when the conversion's output changes


def is_ct2_whisper_dir(path: Path) -> bool:
    """A directory that holds a CTranslate2 model.bin and no transformers config."""
    if not (path / "model.bin").is_file():
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return True  # model.bin without a readable config: let the conversion say what is wrong
    return "model_type" not in config


def _count(model: CT2Model, prefix: str) -> int:
    n = 0
    while f"{prefix}/layer_{n}/ffn/linear_0/weight" in model.variables:
        n += 1
    return n


def _split(model: CT2Model, name: str, parts: list[str], *, no_bias: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Split a fused projection `name` (weight [k*d, d], bias [k*d]) into transformers' separate ones."""
    weight = model.weight(f"{name}/weight")
    chunks = dict(zip(parts, weight.chunk(len(parts)), strict=True))
    out = {f"{part}.weight": w for part, w in chunks.items()}
    if f"{name}/bias" in model.variables:
        for part, b in zip(parts, model.tensor(f"{name}/bias").chunk(len(parts)), strict=True):
            if part in no_bias:
                if torch.count_nonzero(b):
                    raise CheckpointNotFound(f"CTranslate2 Whisper: {name} has a non-zero key bias; not a Whisper "
                                             "checkpoint this reader understands")
            else:
                out[f"{part}.bias"] = b
    else:  # a converter may drop an all-zero bias entirely
        for part in parts:
            if part not in no_bias:
                out[f"{part}.bias"] = torch.zeros(weight.shape[0] // len(parts), dtype=weight.dtype)
    return out


def _linear(model: CT2Model, name: str) -> dict[str, torch.Tensor]:
    out = {"weight": model.weight(f"{name}/weight")}
    out["bias"] = (model.tensor(f"{name}/bias") if f"{name}/bias" in model.variables
                   else torch.zeros(out["weight"].shape[0], dtype=out["weight"].dtype))
    return out


def _norm(model: CT2Model, name: str) -> dict[str, torch.Tensor]:
    return {"weight": model.tensor(f"{name}/gamma"), "bias": model.tensor(f"{name}/beta")}


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in tensors.items()}


def whisper_state_dict(model: CT2Model) -> dict[str, torch.Tensor]:
    """transformers `WhisperForConditionalGeneration` weights from a WhisperSpec (proj_out tied, not listed)."""
    if model.spec != "WhisperSpec":
        raise CheckpointNotFound(f"CTranslate2 model is a {model.spec}, not a WhisperSpec")
    sd: dict[str, torch.Tensor] = {}
    for conv in ("conv1", "conv2"):
        sd |= _prefixed(f"model.encoder.{conv}", _linear(model, f"encoder/{conv}"))
    for side in ("encoder", "decoder"):
        sd[f"model.{side}.embed_positions.weight"] = model.tensor(f"{side}/position_encodings/encodings")
        sd |= _prefixed(f"model.{side}.layer_norm", _norm(model, f"{side}/layer_norm"))
        for i in range(_count(model, side)):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            sd |= _prefixed(f"{dst}.self_attn", _split(model, f"{src}/self_attention/linear_0",
                                                       ["q_proj", "k_proj", "v_proj"], no_bias=("k_proj",)))
            sd |= _prefixed(f"{dst}.self_attn.out_proj", _linear(model, f"{src}/self_attention/linear_1"))
            sd |= _prefixed(f"{dst}.self_attn_layer_norm", _norm(model, f"{src}/self_attention/layer_norm"))
            if side == "decoder":
                sd |= _prefixed(f"{dst}.encoder_attn.q_proj", _linear(model, f"{src}/attention/linear_0"))
                sd |= _prefixed(f"{dst}.encoder_attn", _split(model, f"{src}/attention/linear_1",
                                                              ["k_proj", "v_proj"], no_bias=("k_proj",)))
                sd |= _prefixed(f"{dst}.encoder_attn.out_proj", _linear(model, f"{src}/attention/linear_2"))
                sd |= _prefixed(f"{dst}.encoder_attn_layer_norm", _norm(model, f"{src}/attention/layer_norm"))
            sd |= _prefixed(f"{dst}.fc1", _linear(model, f"{src}/ffn/linear_0"))
            sd |= _prefixed(f"{dst}.fc2", _linear(model, f"{src}/ffn/linear_1"))
            sd |= _prefixed(f"{dst}.final_layer_norm", _norm(model, f"{src}/ffn/layer_norm"))
    sd["model.decoder.embed_tokens.weight"] = model.weight("decoder/embeddings/weight")
    if "decoder/projection/weight" in model.variables and not torch.equal(
        model.weight("decoder/projection/weight"), sd["model.decoder.embed_tokens.weight"]
    ):
        raise CheckpointNotFound("CTranslate2 Whisper: the output projection differs from the token embedding; "
                                 "untied Whisper heads are not supported")
    return {k: v.contiguous() for k, v in sd.items()}


def whisper_config(model: CT2Model, ct2_config: dict, vocab: dict[str, int]) -> dict:
    """transformers' WhisperConfig fields, read off the weights, the heads and the tokenizer's special ids."""
    embed = model.variables["decoder/embeddings/weight"]
    conv1 = model.variables["encoder/conv1/weight"]
    eot, sot = vocab.get("<|endoftext|>"), vocab.get("<|startoftranscript|>")
    if eot is None or sot is None:
        raise CheckpointNotFound("CTranslate2 Whisper: the tokenizer has no <|endoftext|> / <|startoftranscript|>")
    return {
        "model_type": "whisper",
        "architectures": ["WhisperForConditionalGeneration"],
        "vocab_size": int(embed.shape[0]),
        "num_mel_bins": int(conv1.shape[1]),
        "d_model": int(embed.shape[1]),
        "encoder_layers": _count(model, "encoder"),
        "decoder_layers": _count(model, "decoder"),
        "encoder_attention_heads": model.scalar("encoder/num_heads"),
        "decoder_attention_heads": model.scalar("decoder/num_heads"),
        "encoder_ffn_dim": int(model.variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "decoder_ffn_dim": int(model.variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "max_source_positions": int(model.variables["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(model.variables["decoder/position_encodings/encodings"].shape[0]),
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "pad_token_id": eot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "decoder_start_token_id": sot,
        "suppress_tokens": ct2_config.get("suppress_ids") or None,
        "begin_suppress_tokens": ct2_config.get("suppress_ids_begin") or None,
    }


def _generation_config(config: dict, ct2_config: dict) -> dict:
    return {
        "decoder_start_token_id": config["decoder_start_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "bos_token_id": config["bos_token_id"],
        "suppress_tokens": config["suppress_tokens"],
        "begin_suppress_tokens": config["begin_suppress_tokens"],
        "alignment_heads": ct2_config.get("alignment_heads"),
        "is_multilingual": config["vocab_size"] >= MULTILINGUAL_VOCAB,
        "max_length": config["max_target_positions"],
    }


def _tokenizer_files(src: Path, dst: Path, config: dict) -> None:
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_target_positions"],
    }, indent=2))
    (dst / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": config["num_mel_bins"],
        "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400, "padding_value": 0.0,
        "padding_side": "right", "return_attention_mask": False,
    }, indent=2))


def convert(src: Path, dst: Path) -> None:
    """Write the transformers checkpoint of CTranslate2 Whisper directory `src` into `dst` (weights in the
    file's own float dtype; `from_pretrained(dtype=...)` casts)."""
    if not (src / "tokenizer.json").is_file():
        raise CheckpointNotFound(f"{src}: a CTranslate2 Whisper directory needs its tokenizer.json beside model.bin "
                                 "(faster-whisper's downloads carry it)")
    ct2_config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    for token in json.loads((src / "tokenizer.json").read_text()).get("added_tokens", []):
        vocab[token["content"]] = token["id"]
    model = read_model_bin(src / "model.bin")
    config = whisper_config(model, ct2_config, vocab)
    save_file(whisper_state_dict(model), str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "generation_config.json").write_text(json.dumps(_generation_config(config, ct2_config), indent=2))
    _tokenizer_files(src, dst, config)


def converted_checkpoint(src: Path, cache: Path, progress: Callable[[str], None] | None = None) -> Path:
    """The transformers directory for CTranslate2 directory `src`, converted once into `cache` (atomic: a
    concurrent converter or an interrupted one never leaves a half-written checkpoint behind)."""
    key = f"{sha256_file(src / 'model.bin')[:16]}-v{CONVERTED_VERSION}"
    final = cache / "ct2-whisper" / key
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"converting CTranslate2 Whisper {src} into {final} (once) ...")
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=final.parent))
    try:
        convert(src, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
