"""The VLM path: a LLaVA-OneVision checkpoint's language model in the engine and its vision half in the
VisionEncoder, each equal to transformers' own model over the same checkpoint; video-memory suffixes prefilled
with the longest-common-prefix rule and still exact."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlavaOnevisionForConditionalGeneration

from runtime.config import LMConfig
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.pieces import Visual
from runtime.models.lm.prompt import EMPTY_CONTEXT
from runtime.models.lm.transformer_build import load_transformer
from runtime.models.lm.weights import is_vlm, read_config
from runtime.models.loading import resolve_checkpoint
from runtime.models.vlm.llava_onevision import VisionEncoder
from runtime.models.vlm.prompt import memory_pieces

TOL = 1e-4


@pytest.fixture(scope="module")
def vlm_path():
    return resolve_checkpoint("tiny:llava-onevision", role="lm")


@pytest.fixture(scope="module")
def hf_vlm(vlm_path):
    return LlavaOnevisionForConditionalGeneration.from_pretrained(vlm_path, attn_implementation="sdpa").eval()


def frames(n, seed=0, shape=(48, 80)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (*shape, 3), dtype=np.uint8) for _ in range(n)]


def hf_logits(hf_vlm, ids, visual):
    """transformers' logits over `ids`, with the rows of negative ids replaced by `visual[id]`."""
    emb = hf_vlm.get_input_embeddings()
    x = emb(torch.tensor([max(i, 0) for i in ids]))
    for pos, i in enumerate(ids):
        if i < 0:
            x[pos] = visual[i]
    with torch.no_grad():
        return hf_vlm(inputs_embeds=x[None]).logits[0]


def test_vlm_checkpoint_is_read_as_its_language_model(vlm_path, hf_vlm):
    assert is_vlm(vlm_path)
    assert read_config(vlm_path).model_type == "qwen2"
    ours = load_transformer(vlm_path)
    ids = torch.tensor([5, 17, 99, 3, 250, 7])
    with torch.no_grad():
        ref = hf_vlm(input_ids=ids[None]).logits[0]
    got = ours(ids, torch.arange(len(ids)))
    assert (got - ref).abs().max().item() < TOL


def test_vision_encoder_equals_the_family_video_features(vlm_path, hf_vlm):
    enc = VisionEncoder.load("tiny:llava-onevision", grid=4, device="cpu", dtype="float32")
    assert enc.dim == hf_vlm.config.text_config.hidden_size
    images = frames(3)
    pixels = enc.preprocess(images)
    assert pixels.shape == (3, 3, 64, 64)
    with torch.no_grad():
        ref = hf_vlm.model.get_video_features(pixel_values_videos=pixels[None], vision_feature_layer=-1,
                                              vision_feature_select_strategy="full").pooler_output
    ours = hf_vlm.model.apply_pooling(enc.project(pixels)).reshape(1, -1, enc.dim)
    assert (ours - ref[:, :-1]).abs().max().item() < TOL  # the family appends one newline token
    feats = enc.encode(images)
    assert feats.shape == (3, 16, enc.dim)
    # pooling is an average over the patch grid: the mean over tokens survives it
    full = enc.project(pixels)
    assert torch.allclose(feats.mean(1), full.mean(1), atol=1e-5)


def test_hub_layout_weights_load_the_same(vlm_path, tmp_path):
    """llava-hf's hub checkpoints name weights `language_model.model.*` and `vision_tower.vision_model.*`."""
    hub = tmp_path / "hub-layout"
    shutil.copytree(vlm_path, hub)
    state = load_file(str(hub / "model.safetensors"))
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        renamed[name] = tensor
    save_file(renamed, str(hub / "model.safetensors"))
    a = VisionEncoder.load(str(vlm_path), grid=4, device="cpu", dtype="float32")
    b = VisionEncoder.load(str(hub), grid=4, device="cpu", dtype="float32")
    images = frames(2, seed=1)
    assert torch.equal(a.encode(images), b.encode(images))
    ids = torch.tensor([1, 2, 3, 4])
    assert torch.equal(load_transformer(vlm_path)(ids, torch.arange(4)),
                       load_transformer(hub)(ids, torch.arange(4)))


def test_text_only_checkpoint_is_refused_for_video(tiny_path):
    from runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="not a vision-language model"):
        VisionEncoder.load(str(tiny_path), grid=4, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine():
    cfg = LMConfig(backend="engine", model="tiny:llava-onevision", window_tokens=512, prefill_chunk_tokens=64,
                   max_new_tokens=8, drafter="none")
    return LMEngine.load(cfg, device="cpu", dtype="float32")


def visual_map(session):
    return dict(session._visual)


def assert_answer_sees_the_context(s, hf_vlm) -> None:
    """The prefilled KV is the reference's: an answer's first logits over it equal transformers' over the same ids
    (the prefill computes no logits of its own)."""
    s.begin_answer("what is shown?")
    ref = hf_logits(hf_vlm, s.answer_ids(), visual_map(s))
    assert (s.next_logits() - ref[-1]).abs().max().item() < TOL
    s.end_answer()


def test_visual_suffix_prefill_is_exact_and_keeps_the_common_prefix(engine, hf_vlm):
    g = torch.Generator().manual_seed(0)
    dim = engine.model.args.hidden_size
    blocks = [Visual(1, torch.randn(6, dim, generator=g)), Visual(2, torch.randn(4, dim, generator=g))]
    s = engine.open_session()
    s.set_context("hello there", ["\n\nVideo:", blocks[0], " [0:03]", blocks[1]])
    while s.prefill_step():
        pass
    assert sum(i < 0 for i in s.source_ids()) == 10
    assert_answer_sees_the_context(s, hf_vlm)

    # a new latest frame (new key): only it is recomputed
    before = s.stats.prefilled
    newer = Visual(3, torch.randn(4, dim, generator=g))
    s.set_context("hello there", ["\n\nVideo:", blocks[0], " [0:04]", newer])
    while s.prefill_step():
        pass
    assert s.stats.prefilled - before < 4 + 8  # the changed label and block, not the transcript or block 1
    assert_answer_sees_the_context(s, hf_vlm)

    # the transcript grows: the suffix after it is recomputed, and the answer sees all of it
    s.set_context("hello there, how are you", None)
    s.begin_answer("what is shown?")
    ids = s.answer_ids()
    ref = hf_logits(hf_vlm, ids, visual_map(s))
    assert (s.next_logits() - ref[-1]).abs().max().item() < TOL
    s.end_answer()


def test_same_key_same_content_is_not_recomputed(engine):
    dim = engine.model.args.hidden_size
    block = Visual(7, torch.ones(5, dim))
    s = engine.open_session()
    s.set_context("", ["\n\nVideo:", block])
    while s.prefill_step():
        pass
    done = s.stats.prefilled
    s.set_context("", ["\n\nVideo:", Visual(7, torch.ones(5, dim))])
    assert s.prefill_step() == 0 and s.stats.prefilled == done
    assert EMPTY_CONTEXT  # an empty transcript still frames the suffix


def test_memory_pieces_and_embed_text(engine):
    from runtime.memory.video import MemoryBlock

    dim = engine.model.args.hidden_size
    blocks = [MemoryBlock("temporal", 1, 0.0, 12.0, torch.zeros(4, dim)),
              MemoryBlock("abstract", 2, 0.0, 20.0, torch.zeros(2, dim)),
              MemoryBlock("spatial", 3, 20.0, 20.0, torch.zeros(16, dim))]
    pieces = memory_pieces(blocks)
    text = "".join(p for p in pieces if isinstance(p, str))
    assert "[0:00-0:12]" in text and "[0:20]" in text and "Overview" in text
    assert [p.key for p in pieces if isinstance(p, Visual)] == [1, 2, 3]
    assert memory_pieces([]) == []
    q = engine.embed_text("what color is the ball?")
    assert q.shape == (dim,) and q.dtype == torch.float32
    assert engine.embed_text("") is None


def test_tiny_vlm_preprocessor_config_is_read(vlm_path):
    cfg = json.loads((vlm_path / "video_preprocessor_config.json").read_text())
    enc = VisionEncoder.load("tiny:llava-onevision", grid=4, device="cpu", dtype="float32")
    assert enc.mean.flatten().tolist() == pytest.approx(cfg["image_mean"])
