"""`.nemo` archives: NeMo's checkpoint format, read and written without NeMo.

A `.nemo` is a tar (plain or gzip) holding `model_config.yaml` (the model's config, NeMo keys),
`model_weights.ckpt` (a torch state dict under NeMo's module names) and tokenizer files (`<hash>_tokenizer.model`
a SentencePiece model, `vocab.txt`, ...). Members may be prefixed `./`.

Parameter names (ours are NeMo's, so the mapping is the identity except for the CTC head of hybrids):
  preprocessor.featurizer.{window,fb}              Hann window [400], mel filterbank [1, 80, 257] (buffers)
  encoder.pre_encode.conv.{0,2,3,5,6}.{weight,bias} conv / depthwise / pointwise 2-D convs (dw_striding 8x)
  encoder.pre_encode.out.{weight,bias}             linear from channels x 11 mel bins to d_model
  encoder.layers.N.norm_{feed_forward1,self_att,conv,feed_forward2,out}.{weight,bias}
  encoder.layers.N.feed_forward{1,2}.linear{1,2}.{weight,bias}
  encoder.layers.N.self_attn.linear_{q,k,v,out}.{weight,bias}, .linear_pos.weight, .pos_bias_{u,v} [h, d_k]
  encoder.layers.N.conv.{pointwise_conv1,depthwise_conv,pointwise_conv2}.{weight,bias}
  encoder.layers.N.conv.batch_norm.{weight,bias[,running_mean,running_var,num_batches_tracked]}
  decoder.decoder_layers.0.{weight,bias}           CTC head, 1x1 conv [vocab + 1, d, 1] (EncDecCTCModel)
  ctc_decoder.decoder_layers.0.*  -> decoder.*     CTC head of a hybrid RNNT-CTC model (config `aux_ctc`)
Ignored: a hybrid's RNNT `decoder.*` (prediction net) and `joint.*`, `encoder.pos_enc.pe` (recomputed),
`spec_augmentation.*`. Any other unknown encoder/decoder parameter (adapters, ...) is refused.

Refused with a one-line ConfigError: non-ConformerEncoder encoders, subsampling other than causal
`dw_striding`, attention other than `rel_pos`, `att_context_style` other than `chunked_limited`, unlimited
(-1) contexts, non-causal depthwise convs, conv norms other than batch/layer norm, `feat_out`/reduction
layers, utterance-level feature normalisation, non-16 kHz input, RNNT-only and character-vocabulary models.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from runtime.errors import ConfigError
from runtime.models.asr.fastconformer.features import FeatureConfig
from runtime.models.asr.fastconformer.model import FastConformerConfig, FastConformerCTC
from runtime.models.asr.fastconformer.tokenizer import CTCTokenizer

CONFIG_NAME, WEIGHTS_NAME = "model_config.yaml", "model_weights.ckpt"
IGNORED_PREFIXES = ("joint.", "spec_augmentation.", "encoder.pos_enc.", "preprocessor.featurizer.pe")


def _resolve(value: Any, root: dict[str, Any]) -> Any:
    """Resolve OmegaConf's `${model.a.b}` / `${a.b}` interpolations that NeMo may leave in a saved config."""
    if isinstance(value, str):
        match = re.fullmatch(r"\$\{([\w.]+)\}", value.strip())
        if match:
            node: Any = root
            for part in match.group(1).removeprefix("model.").split("."):
                if not isinstance(node, dict) or part not in node:
                    return None
                node = node[part]
            return _resolve(node, root)
    return value


class _Section:
    """One config section with interpolation, defaults and `where` for error messages."""

    def __init__(self, data: Any, root: dict[str, Any], where: str) -> None:
        self.data = data if isinstance(data, dict) else {}
        self.root, self.where = root, where

    def get(self, key: str, default: Any = None) -> Any:
        value = _resolve(self.data.get(key, default), self.root)
        return default if value is None else value

    def refuse(self, key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{self.where}.{key}={value!r} is not supported: {why}")

    def require(self, key: str, default: Any, ok: Callable[[Any], bool], why: str) -> Any:
        value = self.get(key, default)
        if not ok(value):
            raise self.refuse(key, value, why)
        return value


def _contexts(value: Any, enc: _Section) -> tuple[tuple[int, int], ...]:
    items = value if value and isinstance(value[0], list | tuple) else [value]
    try:
        contexts = tuple((int(left), int(right)) for left, right in items)
    except (TypeError, ValueError):
        raise enc.refuse("att_context_size", value, "expected [left, right] or a list of them") from None
    if any(left < 0 or right < 0 for left, right in contexts):
        raise enc.refuse("att_context_size", value, "unlimited (-1) context cannot stream")
    return contexts


def _features(cfg: dict[str, Any], where: str) -> FeatureConfig:
    pre = _Section(cfg.get("preprocessor"), cfg, f"{where}: preprocessor")
    mel = "AudioToMelSpectrogramPreprocessor"
    pre.require("_target_", mel, lambda v: v.endswith(mel), "only log-mel preprocessors")
    sr = pre.require("sample_rate", 16000, lambda v: v == 16000, "audio is 16 kHz here")
    pre.require("window", "hann", lambda v: v == "hann", "only a Hann window")
    pre.require("frame_splicing", 1, lambda v: v == 1, "no frame splicing")
    pre.require("log", True, lambda v: v is True, "log-mel features only")
    pre.require("exact_pad", False, lambda v: v is False, "only center=True framing")
    pre.require("mag_power", 2.0, lambda v: float(v) == 2.0, "power spectrum only")
    pre.require("log_zero_guard_type", "add", lambda v: v == "add", "only the 'add' log guard")
    guard = pre.require("log_zero_guard_value", 2**-24, lambda v: isinstance(v, int | float), "a number")
    norm = pre.get("normalize", "NA")
    mean = std = None
    if isinstance(norm, dict) and "fixed_mean" in norm and "fixed_std" in norm:
        mean, std = tuple(map(float, norm["fixed_mean"])), tuple(map(float, norm["fixed_std"]))
    elif norm not in ("NA", "none", "None", False):
        raise pre.refuse("normalize", norm, "utterance statistics are not causal; use 'NA' or fixed_mean/fixed_std")
    win = round(float(pre.get("window_size", 0.02)) * sr)
    n_fft = int(pre.get("n_fft", 0)) or 2 ** (win - 1).bit_length()
    return FeatureConfig(
        sample_rate=sr,
        features=int(pre.get("features", 64)),
        window_size=win,
        window_stride=round(float(pre.get("window_stride", 0.01)) * sr),
        n_fft=n_fft,
        preemph=_resolve(pre.data.get("preemph", 0.97), cfg),  # an explicit null means none
        lowfreq=float(pre.get("lowfreq", 0.0)),
        highfreq=pre.get("highfreq"),
        log_zero_guard=float(guard),
        fixed_mean=mean,
        fixed_std=std,
    )


def config_from_nemo(cfg: dict[str, Any], *, where: str = "model_config.yaml") -> tuple[FastConformerConfig, str]:
    """Our model config from a NeMo model config, and the state-dict prefix of its CTC head."""
    features = _features(cfg, where)
    enc = _Section(cfg.get("encoder"), cfg, f"{where}: encoder")
    enc.require("_target_", "ConformerEncoder", lambda v: v.endswith("ConformerEncoder"), "only ConformerEncoder")
    enc.require("subsampling", "dw_striding", lambda v: v == "dw_striding", "only dw_striding")
    enc.require("causal_downsampling", False, lambda v: v is True, "subsampling must be causal to stream")
    enc.require("self_attention_model", "rel_pos", lambda v: v == "rel_pos", "only rel_pos attention")
    enc.require("att_context_style", "regular", lambda v: v == "chunked_limited", "only chunked_limited")
    enc.require("feat_out", -1, lambda v: v == -1, "no output projection")
    enc.require("reduction", None, lambda v: v is None, "no reduction layers")
    enc.require("feat_in", features.features, lambda v: v == features.features, "must equal preprocessor.features")
    kernel = int(enc.get("conv_kernel_size", 31))
    enc.require("conv_context_size", None, lambda v: v == "causal" or list(v or []) == [kernel - 1, 0],
                "the depthwise conv must be causal ('causal')")
    norm = enc.require("conv_norm_type", "batch_norm", lambda v: v in ("batch_norm", "layer_norm"),
                       "batch_norm or layer_norm")
    factor = enc.require("subsampling_factor", 4, lambda v: v >= 2 and v & (v - 1) == 0, "a power of 2")
    d_model, heads = int(enc.get("d_model", 256)), int(enc.get("n_heads", 4))
    if d_model % heads:
        raise enc.refuse("n_heads", heads, f"must divide d_model {d_model}")
    channels = int(enc.get("subsampling_conv_channels", -1))
    contexts = _contexts(enc.get("att_context_size", [-1, -1]), enc)

    decoder = _Section(cfg.get("decoder"), cfg, f"{where}: decoder")
    prefix = "decoder"
    if not decoder.get("_target_", "").endswith("ConvASRDecoder"):
        if "aux_ctc" not in cfg:
            raise decoder.refuse("_target_", decoder.get("_target_"), "only CTC heads (RNNT-only model)")
        decoder, prefix = _Section(cfg["aux_ctc"].get("decoder"), cfg, f"{where}: aux_ctc.decoder"), "ctc_decoder"
    tok = _Section(cfg.get("tokenizer"), cfg, f"{where}: tokenizer")
    if not cfg.get("tokenizer"):
        raise ConfigError(f"{where}: no tokenizer section: character-vocabulary models are not supported")
    tok.require("type", "bpe", lambda v: v == "bpe", "only SentencePiece (bpe) tokenizers")
    num_classes = int(decoder.get("num_classes", -1))
    if num_classes <= 0:
        num_classes = len(decoder.get("vocabulary", []))
    if num_classes <= 0:
        raise decoder.refuse("num_classes", num_classes, "needs the vocabulary size")
    config = FastConformerConfig(
        vocab_size=num_classes,
        n_layers=int(enc.get("n_layers", 17)),
        d_model=d_model,
        n_heads=heads,
        ff_expansion_factor=int(enc.get("ff_expansion_factor", 4)),
        subsampling_factor=int(factor),
        subsampling_conv_channels=d_model if channels == -1 else channels,
        conv_kernel_size=kernel,
        conv_norm_type=norm,
        att_context_sizes=contexts,
        xscaling=bool(enc.get("xscaling", True)),
        use_bias=bool(enc.get("use_bias", True)),
        features=features,
    )
    return config, prefix


def nemo_config(cfg: FastConformerConfig, tokenizer: CTCTokenizer) -> dict[str, Any]:
    """A NeMo EncDecCTCModelBPE config for `cfg` (keys as NeMo's cache-aware streaming configs)."""
    f = cfg.features
    contexts = [list(c) for c in cfg.att_context_sizes]
    normalize: Any = "NA"
    if f.fixed_mean is not None:
        normalize = {"fixed_mean": list(f.fixed_mean), "fixed_std": list(f.fixed_std or ())}
    return {
        "target": "nemo.collections.asr.models.ctc_bpe_models.EncDecCTCModelBPE",
        "sample_rate": f.sample_rate,
        "tokenizer": {
            "dir": None, "type": "bpe", "model_path": "nemo:tokenizer.model", "hf_tokenizer": "nemo:tokenizer.json"
        },
        "preprocessor": {
            "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
            "sample_rate": f.sample_rate, "normalize": normalize, "window_size": f.window_size / f.sample_rate,
            "window_stride": f.window_stride / f.sample_rate, "window": "hann", "features": f.features,
            "n_fft": f.n_fft, "preemph": f.preemph, "lowfreq": f.lowfreq, "highfreq": f.highfreq,
            "log_zero_guard_value": f.log_zero_guard, "frame_splicing": 1, "dither": 1e-05, "pad_to": 0,
        },
        "encoder": {
            "_target_": "nemo.collections.asr.modules.ConformerEncoder",
            "feat_in": f.features, "feat_out": -1, "n_layers": cfg.n_layers, "d_model": cfg.d_model,
            "subsampling": "dw_striding", "subsampling_factor": cfg.subsampling_factor,
            "subsampling_conv_channels": cfg.subsampling_conv_channels, "causal_downsampling": True,
            "ff_expansion_factor": cfg.ff_expansion_factor, "self_attention_model": "rel_pos",
            "n_heads": cfg.n_heads, "att_context_size": contexts if len(contexts) > 1 else contexts[0],
            "att_context_style": "chunked_limited", "xscaling": cfg.xscaling, "untie_biases": True,
            "pos_emb_max_len": 5000, "conv_kernel_size": cfg.conv_kernel_size, "conv_norm_type": cfg.conv_norm_type,
            "conv_context_size": "causal", "use_bias": cfg.use_bias,
        },
        "decoder": {
            "_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": cfg.d_model,
            "num_classes": cfg.vocab_size,
            "vocabulary": [tokenizer.tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)],
        },
    }


def save_nemo(model: FastConformerCTC, tokenizer: CTCTokenizer, path: Path) -> Path:
    """Write `model` as a `.nemo` archive (NeMo names; SentencePiece and tokenizers-format tokenizer files).
    Deterministic: fixed member order and mtimes, so equal models give byte-identical files."""
    path = Path(path)
    weights = io.BytesIO()
    torch.save({k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
                for k, v in model.state_dict().items()}, weights)
    members = {
        CONFIG_NAME: yaml.safe_dump(nemo_config(model.cfg, tokenizer), sort_keys=False).encode(),
        WEIGHTS_NAME: weights.getvalue(),
        "tokenizer.model": tokenizer.to_sentencepiece(),
        "tokenizer.json": tokenizer.to_json().encode(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def read_members(path: Path) -> dict[str, bytes]:
    """The archive's files (config, weights, tokenizer files) by name without a leading './'."""
    wanted = (CONFIG_NAME, WEIGHTS_NAME, "tokenizer.model", "tokenizer.json")
    try:
        with tarfile.open(path, "r:*") as tar:
            out = {}
            for member in tar.getmembers():
                name = member.name.removeprefix("./")
                if member.isfile() and name.endswith(wanted):
                    out[name] = tar.extractfile(member).read()
            return out
    except (tarfile.TarError, OSError) as err:
        raise ConfigError(f"{path}: not a readable .nemo archive ({err})") from None


def _tokenizer(members: dict[str, bytes], path: Path) -> CTCTokenizer:
    for suffix in ("tokenizer.json", "tokenizer.model"):
        names = sorted(n for n in members if n.endswith(suffix))
        if len(names) > 1:
            raise ConfigError(f"{path}: several {suffix} files ({', '.join(names)}): aggregate tokenizers unsupported")
        if names:
            data = members[names[0]]
            try:
                if suffix == "tokenizer.json":
                    return CTCTokenizer.from_json(data.decode())
                return CTCTokenizer.from_sentencepiece(data)
            except Exception as err:  # a corrupt file: say which and what would work
                raise ConfigError(
                    f"{path}: cannot read {names[0]} ({err}); add a tokenizers-library tokenizer.json to the archive"
                ) from None
    raise ConfigError(f"{path}: no tokenizer.model (SentencePiece) or tokenizer.json in the archive")


def load_nemo(path: Path) -> tuple[FastConformerCTC, CTCTokenizer]:
    """Read a `.nemo` archive into our model (fp32, CPU, eval) and its tokenizer; refuses what we cannot run."""
    path = Path(path)
    members = read_members(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not any(n.endswith(name) for n in members):
            raise ConfigError(f"{path}: not a .nemo archive (no {name})")
    config_bytes = next(v for n, v in members.items() if n.endswith(CONFIG_NAME))
    cfg = yaml.safe_load(config_bytes)
    cfg = cfg.get("model", cfg) if isinstance(cfg, dict) else {}
    config, prefix = config_from_nemo(cfg, where=path.name)
    tokenizer = _tokenizer(members, path)
    if tokenizer.vocab_size != config.vocab_size:
        raise ConfigError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the CTC head {config.vocab_size}")
    weights = next(v for n, v in members.items() if n.endswith(WEIGHTS_NAME))
    state = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    model = FastConformerCTC(config)
    load_weights(model, state, prefix, where=str(path))
    return model, tokenizer


def load_weights(model: FastConformerCTC, state: dict[str, torch.Tensor], ctc_prefix: str, *, where: str) -> None:
    """Load a NeMo state dict (names as in the module docstring); unknown model parameters are refused."""
    mapped: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state.items():
        if key.startswith(ctc_prefix + "."):
            mapped["decoder." + key[len(ctc_prefix) + 1 :]] = value
        elif key.startswith(("encoder.", "preprocessor.featurizer.")) and not key.startswith(IGNORED_PREFIXES):
            mapped[key] = value
        elif not key.startswith(IGNORED_PREFIXES + ("decoder.", "preprocessor.")):
            unknown.append(key)
    ours = model.state_dict()
    unknown += [k for k in mapped if k not in ours]
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise ConfigError(f"{where}: unsupported parameters {', '.join(unknown[:3])}{more}")
    optional = {"preprocessor.featurizer.window", "preprocessor.featurizer.fb"}  # recomputed when absent
    missing = [k for k in ours if k not in mapped and k not in optional]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConfigError(f"{where}: missing parameters {', '.join(missing[:3])}{more}")
    bad = [k for k, v in mapped.items() if tuple(v.shape) != tuple(ours[k].shape)]
    if bad:
        k = bad[0]
        raise ConfigError(f"{where}: {k} has shape {list(mapped[k].shape)}, the config implies {list(ours[k].shape)}")
    model.load_state_dict(mapped, strict=False)
    model.eval()
