"""GGUF loading: a tiny file the test writes with the `gguf` package (as llama.cpp's converter lays it out) read by
our loader and, independently, by transformers' GGUF loader; the weight formats built from it; and the errors.
The real SmolLM2 file is checked against transformers in test_smollm2.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.lm.gguf_checkpoint import GGUFCheckpoint, gguf_file, open_gguf
from runtime.models.lm.transformer_build import load_transformer
from runtime.models.lm.weight_formats import Int4Linear, Int8Linear, q4_blocks_of

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to a `llama` q/k projection's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, path: Path, arch: str, qtype: GGMLQuantizationType,
               tie: bool = True, types: dict[str, GGMLQuantizationType] | None = None) -> None:
    """`types`: another storage by tensor kind (`attn_v`, `ffn_down`, `output`, ...), as a Q4_K_M file mixes them."""
    cfg = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    # a byte-level BPE vocabulary without merges: enough for transformers' GGUF tokenizer converter
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = ["<unk>", "<s>", "</s>", *[chr(ord("!") + i) for i in range(cfg.vocab_size - 3)]]
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, *[1] * (cfg.vocab_size - 3)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_merges([])
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "lm_head.weight" and tie:
            continue
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            if arch == "llama" and module == "self_attn.q_proj":
                a = llama_cpp_permute(a, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                a = llama_cpp_permute(a, cfg.num_key_value_heads)
            gname = f"blk.{i}.{NAMES[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if a.ndim == 2 and a.shape[1] % 32 == 0:
            kind = gname.split(".")[-2] if gname.startswith("blk.") else gname.split(".")[0]
            own = (types or {}).get(kind, qtype)
            w.add_tensor(gname, quantize(a, own), raw_dtype=own)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False)).eval()


@pytest.fixture(params=[("llama", "Q4_1"), ("llama", "Q8_0"), ("qwen2", "Q4_0")], ids=lambda p: "-".join(p))
def written(request, tmp_path: Path) -> tuple[Path, str]:
    arch, qtype = request.param
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(tiny(arch), path, arch, GGMLQuantizationType[qtype])
    return path, qtype


def test_logits_equal_transformers_gguf_loader(written) -> None:
    path, _ = written
    ours = load_transformer(path)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([1, 5, 9, 33, 70, 2, 14, 95, 3])
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    got = ours(ids, torch.arange(len(ids)))
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    assert ours.args.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight


def test_int4_takes_the_files_own_blocks(written) -> None:
    """Every 4-bit projection computes with exactly the file's dequantised weights (the kernel's q * scale + zero
    is a Q4_0/Q4_1 block): its dequantised weight equals the float one to bf16 rounding of scale and zero."""
    path, qtype = written
    ckpt = GGUFCheckpoint(path)
    fp = load_transformer(path)
    q4 = load_transformer(path, weights="int4")
    lin = q4.model.layers[1].self_attn.qkv_proj
    assert isinstance(lin, Int4Linear)
    want = fp.model.layers[1].self_attn.qkv_proj.weight
    err = (lin.dequantized() - want).abs().max()
    if qtype == "Q8_0":  # no 4-bit blocks in the file: quantised by block minimum and maximum
        assert ckpt.q4_blocks("model.layers.1.self_attn.q_proj.weight") is None
        assert err <= (want.abs().max() / 15 + 1e-6)
    else:  # exactly the file's blocks, through the kernel's bf16 scale and zero
        parts = [ckpt.q4_blocks(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv"]
        q, scale, low = (torch.cat([getattr(b, f) for b in parts]) for f in ("q", "scale", "low"))
        bf = scale.bfloat16().float(), (low + 8 * scale).bfloat16().float()
        exact = (q.float() - 8) * bf[0].repeat_interleave(32, 1) + bf[1].repeat_interleave(32, 1)
        err = (lin.dequantized() - exact).abs()  # the kernel's bf16 output: within half a bf16 step of each
        assert bool((err <= exact.abs() * 2**-8 + 1e-6).all()), float((err - exact.abs() * 2**-8).max())


def test_weight_formats_stay_close_to_fp32(written) -> None:
    path, _ = written
    ids = torch.tensor([1, 5, 9, 33, 70, 2, 14, 95, 3])
    ref = load_transformer(path)(ids, torch.arange(len(ids)))
    for fmt, dtype in (("bf16", torch.bfloat16), ("int8", torch.bfloat16), ("int4", torch.bfloat16)):
        model = load_transformer(path, weights=fmt)
        assert model.dtype == dtype and model.weights == fmt
        got = model(ids, torch.arange(len(ids)))
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 0.15, (fmt, rel)
    assert isinstance(load_transformer(path, weights="int8").lm_head, Int8Linear)


def test_native_keeps_each_weight_in_the_layout_nearest_its_storage(tmp_path: Path) -> None:
    """lm.weights = native on a file that mixes storages as a Q4_K_M file does: a projection whose parts are all
    4-bit is int4 on the file's own blocks (what the int4 format builds), any other is int8 (what the int8 format
    builds from the same dequantised weights); a fused q/k/v with one finer part is int8 whole."""
    path = tmp_path / "mixed.gguf"
    q = GGMLQuantizationType
    write_gguf(tiny("qwen2"), path, "qwen2", q.Q4_0, tie=False, types={"attn_v": q.Q8_0, "ffn_down": q.Q5_0,
                                                                      "output": q.Q8_0})
    native = load_transformer(path, weights="native")
    int4 = load_transformer(path, weights="int4")
    int8 = load_transformer(path, weights="int8")
    assert native.weights == "native" and native.dtype == torch.bfloat16
    for name, module in native.named_modules():
        if not isinstance(module, (Int4Linear, Int8Linear)):
            continue
        four_bit = name.endswith(("gate_up_proj", "o_proj"))
        assert isinstance(module, Int4Linear if four_bit else Int8Linear), name
        same = (int4 if four_bit else int8).get_submodule(name)
        assert all(torch.equal(a, b) for a, b in zip(module.buffers(), same.buffers(), strict=True)), name
    ids = torch.tensor([1, 5, 9, 33, 70, 2, 14, 95, 3])
    ref = load_transformer(path)(ids, torch.arange(len(ids)))
    got = native(ids, torch.arange(len(ids)))
    assert float((got - ref).norm() / ref.norm()) < 0.15


def test_dequantising_a_few_rows_at_a_time_equals_all_at_once(tmp_path: Path) -> None:
    """`tensor_as` dequantises big tensors (the vocabulary) in row chunks to bound the float copy: same values."""
    path = tmp_path / "mixed.gguf"
    q = GGMLQuantizationType
    write_gguf(tiny("qwen2"), path, "qwen2", q.Q4_0, tie=False, types={"attn_v": q.Q8_0, "ffn_down": q.Q5_0})
    ckpt = open_gguf(path)
    for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.0.attn_v.weight", "blk.1.attn_q.weight"):
        whole = torch.from_numpy(ckpt.tensor(name))
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(ckpt.tensor_as(name, dtype, rows=7), whole.to(dtype)), (name, dtype)


def test_quantisers_round_trip() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 96)
    b = q4_blocks_of(w)
    back = (b.q.float() * b.scale.repeat_interleave(32, 1) + b.low.repeat_interleave(32, 1))
    assert (back - w).abs().max() <= b.scale.max() / 2 + 1e-6
    i8 = Int8Linear.quantize(w, None, torch.float32)
    assert (i8.dequantized() - w).abs().max() <= w.abs().max() / 127
    with pytest.raises(ConfigError, match="divisible by 32"):
        q4_blocks_of(torch.randn(8, 40))


def test_unsupported_architecture_and_types_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"architecture 'gpt2' is not supported .*supported: llama, qwen2"):
        GGUFCheckpoint(path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointNotFound, match="not a readable GGUF file"):
        GGUFCheckpoint(tmp_path / "junk.gguf")
    good = tmp_path / "good" / "tiny.gguf"
    good.parent.mkdir()
    write_gguf(tiny("llama"), good, "llama", GGMLQuantizationType.Q8_0)
    with pytest.raises(ConfigError, match="lm.weights 'int3' is not one of auto, fp32, bf16, int8, int4"):
        load_transformer(good, weights="int3")


def test_an_unsupported_tensor_type_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 36), dtype=np.uint8), raw_dtype=GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"GGUF tensor types IQ4_NL are not supported \(supported: F32, "):
        GGUFCheckpoint(path)


def test_a_gguf_file_path_loads_through_the_profile_path(written) -> None:
    from runtime.config import LMConfig
    from runtime.models.lm.engine import LMEngine
    from runtime.models.loading import resolve_checkpoint

    path, _ = written
    assert resolve_checkpoint(str(path), role="lm") == path
    engine = LMEngine.load(LMConfig(backend="engine", model=str(path), weights="int8"), device="cpu",
                           dtype="float32")
    assert engine.model.weights == "int8" and engine.eos_ids == frozenset({2})


def test_gguf_file_is_found_in_a_folder(tmp_path: Path) -> None:
    assert gguf_file(tmp_path) is None
    (tmp_path / "a.gguf").write_bytes(b"")
    assert gguf_file(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(CheckpointNotFound, match="holds 2 GGUF files"):
        gguf_file(tmp_path)


def random_q4_k(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K rows [rows, k / 256 * 144]: random nibbles and 6-bit scales, finite float16 d and dmin (gguf's
    writer cannot quantise to Q4_K, and any such bytes are a valid tensor)."""
    n = k // 256
    b = rng.integers(0, 256, size=(rows, n, 144), dtype=np.uint8)
    b[..., 0:2] = (rng.random((rows, n)) * 0.02 + 1e-4).astype(np.float16).view(np.uint8).reshape(rows, n, 2)
    b[..., 2:4] = (rng.random((rows, n)) * 0.02).astype(np.float16).view(np.uint8).reshape(rows, n, 2)
    return b.reshape(rows, n * 144)


def test_q4_k_groups_are_exactly_the_files_weights(tmp_path: Path) -> None:
    """A Q4_K tensor (Qwen2.5-Coder-1.5B's 4-bit storage) handed to the int4 format as 32-value groups: q * scale +
    low is bit for bit what gguf's own dequantiser reads, and the kernel's weight is that to bf16 rounding."""
    path = tmp_path / "q4k.gguf"
    w = GGUFWriter(str(path), "qwen2")
    w.add_tensor("blk.0.attn_q.weight", random_q4_k(32, 512, np.random.default_rng(0)),
                 raw_dtype=GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GGUFCheckpoint(path)
    b = ckpt.q4_blocks("model.layers.0.self_attn.q_proj.weight")
    assert b is not None and b.q.shape == (32, 512) and int(b.q.min()) >= 0 and int(b.q.max()) <= 15
    mine = b.q.float() * b.scale.repeat_interleave(32, 1) + b.low.repeat_interleave(32, 1)
    assert torch.equal(mine, torch.from_numpy(ckpt.tensor("blk.0.attn_q.weight")))
    lin = Int4Linear.from_blocks(b, None, torch.bfloat16)
    bf = b.scale.bfloat16().float(), (b.low + 8 * b.scale).bfloat16().float()
    exact = (b.q.float() - 8) * bf[0].repeat_interleave(32, 1) + bf[1].repeat_interleave(32, 1)
    err = (lin.dequantized() - exact).abs()
    assert bool((err <= exact.abs() * 2**-8 + 1e-6).all()), float((err - exact.abs() * 2**-8).max())


def test_transformers_conversion_kept_reads_back_as_converted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's conversion of a GGUF file, kept in the cache (`transformers_model(keep=True)`), is the model
    transformers converts from the file; a folder that does not read is converted again."""
    from runtime.models.lm.generate_answerer import transformers_model

    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(tiny("qwen2"), path, "qwen2", GGMLQuantizationType.Q8_0)
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    first = transformers_model(path, torch.float32, keep=True)
    kept = list((tmp_path / "cache" / "transformers-gguf").iterdir())
    assert len(kept) == 1 and (kept[0] / "config.json").is_file()
    again = transformers_model(path, torch.float32, keep=True).eval()
    assert Path(again.config._name_or_path) == kept[0]  # read from the cache, not the file
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 14]])
    with torch.inference_mode():
        want = fresh(ids).logits
        assert torch.equal(first.eval()(ids).logits, want) and torch.equal(again(ids).logits, want)
    (kept[0] / "config.json").write_text("{not json")
    repaired = transformers_model(path, torch.float32, keep=True).eval()
    with torch.inference_mode():
        assert torch.equal(repaired(ids).logits, want)
    assert transformers_model(path, torch.float32, keep=True).config._name_or_path == str(kept[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_tokenizer_is_the_one_autotokenizer_converts(arch: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_tokenizer` picks the tokenizer class from the file's architecture instead of letting AutoTokenizer parse
    the whole file for a model config (tokenizer.py, `_convert`): the result, saved to and read back from the cache,
    is the tokenizer AutoTokenizer converts from the same file, class and files alike."""
    import json

    from transformers import AutoTokenizer

    from runtime.models.lm.tokenizer import ALONE_FILE, load_tokenizer

    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(tiny(arch), path, arch, GGMLQuantizationType.Q8_0)
    want = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    want.save_pretrained(tmp_path / "want")
    for _ in range(2):  # converted, then read back from the cache
        ours, eos = load_tokenizer(path)
        assert type(ours) is type(want) and eos == [2]
        ours.save_pretrained(tmp_path / "ours")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (json.loads((tmp_path / "ours" / name).read_text())
                    == json.loads((tmp_path / "want" / name).read_text())), name
    saved = [p for p in (tmp_path / "cache" / "gguf-tokenizers").iterdir() if p.is_dir()]
    assert len(saved) == 1
    # read back by its class alone where that is the saved tokenizer: the generic class reads it as saved; Qwen2's
    # adds an NFC normalizer (dropped: the file's has none) and puts its own pre-tokenizer in place of this file's
    # ("default"), so this one is handed over whole (the real Qwen2.5 files' is Qwen2's own: test_qwen_coder.py)
    assert json.loads((saved[0] / ALONE_FILE).read_text()) == {"same": arch == "llama",
                                                               "drop_normalizer": arch == "qwen2"}
