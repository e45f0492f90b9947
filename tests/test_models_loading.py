"""Checkpoint resolution and the tiny random models: they must load through the real from_pretrained path."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoFeatureExtractor,
    AutoModelForCausalLM,
    AutoTokenizer,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
)

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models import loading, tiny
from runtime.models.loading import cache_dir, is_path_like, resolve_checkpoint, torch_dtype


@pytest.fixture(scope="module", autouse=True)
def runtime_cache(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("runtime-cache")
        mp.setenv("RUNTIME_CACHE", str(path))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield path


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_torch_dtype_and_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert torch_dtype("float32") is torch.float32
    assert torch_dtype("float16") is torch.float16
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ConfigError, match="float64"):
        torch_dtype("float64")
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("RUNTIME_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "runtime"


def test_tiny_whisper_loads_with_from_pretrained() -> None:
    path = resolve_checkpoint("tiny:whisper", role="asr")
    assert path.parent == cache_dir() / "tiny" and path.name.startswith("whisper-")
    assert (path / "model.safetensors").stat().st_size < 2_000_000
    model, info = WhisperForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.decoder_start_token_id == tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(AutoFeatureExtractor.from_pretrained(path), WhisperFeatureExtractor)
    assert WhisperProcessor.from_pretrained(path).feature_extractor.feature_size == 80
    # The standard 30 s mel (3000 frames) from a default feature extractor goes through the encoder.
    mel = WhisperFeatureExtractor()(np.zeros(16000, np.float32), sampling_rate=16000, return_tensors="pt")
    assert mel.input_features.shape == (1, 80, 3000)
    with torch.inference_mode():
        states = model.model.encoder(mel.input_features).last_hidden_state
    assert states.shape == (1, 1500, 64)


def test_tiny_qwen2_loads_with_from_pretrained() -> None:
    path = resolve_checkpoint("tiny:qwen2", role="lm")
    assert (path / "model.safetensors").stat().st_size < 2_000_000
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings and model.config.max_position_embeddings == 4096
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer)
    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert set(model.generation_config.eos_token_id) == eos
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("name", "specials"),
    [("whisper", tiny.WHISPER_SPECIAL), ("qwen2", tiny.CHAT_SPECIAL)],
)
def test_tiny_tokenizers_round_trip(name: str, specials: list[str]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(f"tiny:{name}", role="test"))
    assert 800 <= len(tokenizer) <= 1000
    for text in ["The quick brown fox.", " Hello, world!  Two  spaces\nnew line", "café — 日本語 🙂"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    for token in specials:  # each special token is one id and is never split
        ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_tokens_to_ids(token) in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_tiny_builds_are_reproducible(tmp_path: Path) -> None:
    tiny.build_tiny("qwen2", tmp_path / "a", seed=0)
    tiny.build_tiny("qwen2", tmp_path / "b", seed=0)
    tiny.build_tiny("qwen2", tmp_path / "c", seed=1)
    a, b, c = (_files(tmp_path / d) for d in "abc")
    assert a == b  # byte-identical: config, tokenizer, weights
    assert a["tokenizer.json"] == c["tokenizer.json"]
    wa, wc = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    assert wa.keys() == wc.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


def test_tiny_cache_is_reused_and_keyed_by_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    first = resolve_checkpoint("tiny:whisper", role="asr")
    before = _files(first)

    def fail(out_dir: Path, seed: int) -> None:
        raise AssertionError("rebuilt a cached tiny model")

    monkeypatch.setitem(tiny.TINY_MODELS, "whisper", fail)
    assert resolve_checkpoint("tiny:whisper", role="asr") == first
    assert _files(first) == before
    monkeypatch.undo()
    other = resolve_checkpoint("tiny:whisper", role="asr", seed=3)
    assert other != first and other.is_dir()
    hidden = [p for p in first.parent.iterdir() if p.name.startswith(".")]
    assert all(p.name.endswith(".lock") and p.is_file() for p in hidden)  # no temp dirs left: the builds' lock files


def test_tiny_build_survives_losing_a_race(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another process finishing the same build first: ours is discarded, theirs is used."""
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    final = tmp_path / "tiny" / f"qwen2-{loading.tiny_hash('qwen2', 0)}"
    real = tiny.TINY_MODELS["qwen2"]

    def racing(out_dir: Path, seed: int) -> None:
        real(out_dir, seed)
        final.mkdir(parents=True)
        (final / "theirs").write_text("x")
        (final / "theirs2").write_text("y")  # non-empty: rename over it fails as it would on a real race

    monkeypatch.setitem(tiny.TINY_MODELS, "qwen2", racing)
    assert resolve_checkpoint("tiny:qwen2", role="lm") == final
    assert sorted(p.name for p in final.iterdir()) == ["theirs", "theirs2"]
    assert sorted(p.name for p in final.parent.iterdir()) == [f".{final.name}.lock", final.name]  # our temp dir removed


def test_unknown_tiny_model_lists_known_names(tmp_path: Path) -> None:
    for call in (lambda: tiny.build_tiny("gpt9", tmp_path), lambda: resolve_checkpoint("tiny:gpt9", role="lm")):
        with pytest.raises(ConfigError, match="gpt9.*qwen2, whisper"):
            call()


def test_local_directory_is_used_as_is(tmp_path: Path) -> None:
    assert resolve_checkpoint(str(tmp_path), role="lm") == tmp_path
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(CheckpointNotFound, match="not a directory"):
        resolve_checkpoint(str(file), role="lm")


@pytest.mark.parametrize("ref", ["/nonexistent/whisper-base", "./models/missing", "~/no/such/model", "a/b/c"])
def test_missing_local_path_fails_fast(ref: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CheckpointNotFound) as err:
        resolve_checkpoint(ref, role="asr")
    assert time.perf_counter() - start < 0.5
    message = str(err.value)
    assert "\n" not in message and f"{ref!r} does not exist" in message and "--set asr.model=" in message


def test_uncached_hub_id_offline_fails_fast_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = "runtime-tests/no-such-model-1b2e995d"
    start = time.perf_counter()
    with pytest.raises(CheckpointNotFound) as err:
        resolve_checkpoint(ref, role="lm")
    assert time.perf_counter() - start < 2.0
    message = str(err.value)
    assert "\n" not in message
    assert f"lm checkpoint '{ref}' not found locally or in the Hugging Face cache (offline)" in message
    assert f"(hf download {ref})" in message
    assert "--set lm.model=/path/to/no-such-model-1b2e995d" in message


def test_path_like_refs() -> None:
    for ref in ["/abs", "./rel", "../up", ".", "~/home", "~", "a/b/c", "a/b/c/d", "dir/", "owner/name/"]:
        assert is_path_like(ref), ref
    # A hub id is `name` or `owner/name`: one slash at most, not at either end, no leading `.`/`~`.
    for ref in ["openai/whisper-base", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "", "a~b", "a.b/c"]:
        assert not is_path_like(ref), ref


@pytest.mark.parametrize(
    ("sep", "ref", "expected"),
    [
        # POSIX: a backslash is an ordinary character, so these are (odd) hub ids, never paths.
        ("/", "a\\b", False),
        ("/", "dir\\", False),
        ("/", "C:\\models\\x", False),
        ("/", "a/b", False),
        ("/", "a/b/c", True),
        # Windows: a backslash anywhere (or at the end) makes a path; a single forward slash is still a hub id.
        ("\\", "a\\b", True),
        ("\\", "dir\\", True),
        ("\\", "C:\\models\\x", True),
        ("\\", "a/b", False),
        ("\\", "gpt2", False),
        ("\\", "dir/", True),
        ("\\", "a/b/c", True),
    ],
)
def test_path_like_follows_the_platform_separator(monkeypatch, sep: str, ref: str, expected: bool) -> None:
    # Swap the `os` that loading.py sees, not the real one: the rest of the process keeps its own separator.
    monkeypatch.setattr(loading, "os", SimpleNamespace(sep=sep))
    assert is_path_like(ref) is expected


def test_a_session_takes_both_cores_of_two_and_leaves_one_of_more() -> None:
    from runtime.models.loading import session_threads

    assert [session_threads(0, cores=n) for n in (1, 2, 3, 4, 16)] == [1, 2, 2, 3, 15]
    assert session_threads(1, cores=2) == 1 and session_threads(3, cores=2) == 3  # a profile's own count stands


def test_auto_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch) -> None:
    """`resolve_dtype("auto")`: bfloat16 on x86 with AVX-512 BF16 or AMX (and Arm's BF16), float32 on an AVX2-only
    CPU (its flags as an AMD EPYC Zen 3 under KVM lists them), where torch widens bfloat16 and it ran 7.5x slower."""
    zen3 = frozenset(["fpu", "sse2", "avx", "fma", "avx2", "bmi2", "sha_ni", "vaes", "vpclmulqdq"])
    for flags, want in ((zen3, "float32"), (zen3 | {"avx512f", "avx512_vnni", "avx512_bf16"}, "bfloat16"),
                        (zen3 | {"amx_tile", "amx_bf16"}, "bfloat16"), (frozenset({"asimd", "bf16"}), "bfloat16"),
                        (frozenset(), "float32")):
        monkeypatch.setattr(loading, "_cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(loading, "_torch_capability",
                            lambda flags=flags: "AVX512" if flags & {"avx512f", "amx_tile"} else "AVX2")
        assert loading.resolve_dtype("auto") == want, sorted(flags)
        assert loading.resolve_dtype("bfloat16") == "bfloat16" and loading.resolve_dtype("") == ""
    # the same AVX-512 BF16 CPU with torch forced to its AVX2 path runs as an AVX2-only one would
    monkeypatch.setattr(loading, "_cpu_flags", lambda: zen3 | {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(loading, "_torch_capability", lambda: "AVX2")
    assert loading.resolve_dtype("auto") == "float32"
    monkeypatch.undo()
    loading._cpu_flags.cache_clear()
    assert isinstance(loading._cpu_flags(), frozenset)  # this machine's, read from /proc/cpuinfo where it exists
    if Path("/proc/cpuinfo").exists():
        assert "fpu" in loading._cpu_flags() or "fp" in loading._cpu_flags()


def test_final_pass_dtype_takes_auto_and_refuses_the_unknown() -> None:
    from dataclasses import replace

    from runtime.config import validate
    from runtime.profile_files import load_profile

    profile = load_profile("demo")
    assert profile.asr.final_pass_dtype == "auto"
    validate(replace(profile, asr=replace(profile.asr, final_pass_dtype="float32")))
    with pytest.raises(ConfigError, match="auto"):
        validate(replace(profile, asr=replace(profile.asr, final_pass_dtype="bf16")))
