"""The attention-sink KV cache driven by our Transformer, checked against transformers' own forward.

Before the window overflows, cached logits (prefill in arbitrary pieces, token-by-token decoding) equal the
transformers model over the same tokens. After it, each token's logits equal a from-scratch forward over
[sinks + the window it saw] at positions 0..n-1 (StreamingLLM's reference), with constant memory. Trees score
like plain forwards over committed + path, and commit keeps exactly that path.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from lm_common import save_random_model
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from runtime.models.lm.kv_cache import Attend, SinkKVCache
from runtime.models.lm.transformer import Transformer, apply_rope
from runtime.models.lm.transformer_build import load_transformer

TOL = 1e-4
VOCAB = 211


def build(kind: str, path: Path, layers: int = 2) -> PreTrainedModel:
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=4096)
    if kind == "llama":
        cfg, cls = LlamaConfig(**common, attention_bias=True, rope_theta=300.0), LlamaForCausalLM
    else:
        cfg, cls = Qwen2Config(**common, rope_theta=300.0), Qwen2ForCausalLM
    return save_random_model(cls, cfg, path)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory) -> tuple[PreTrainedModel, Transformer]:
    path = tmp_path_factory.mktemp(request.param)
    ref = build(request.param, path)
    return ref, load_transformer(path)


def new_cache(model: Transformer, sink: int = 4, window: int = 512, reserve: int = 16, target: int = 64) -> SinkKVCache:
    a = model.args
    return SinkKVCache(layers=a.num_layers, kv_heads=a.num_kv_heads, head_dim=a.head_dim, sink=sink, window=window,
                       reserve=reserve, target=target)


def run(model: Transformer, cache: SinkKVCache, ids: list[int], attend: Attend) -> torch.Tensor:
    return model(torch.tensor(ids), attend.q_pos, attend.k_pos, attend.mask, cache=cache.buffers, slot=attend.slot)


@torch.no_grad()
def reference(ref: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0]


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def pieces(n: int, seed: int, most: int) -> list[int]:
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, most), n - sum(sizes)))
    return sizes


def test_prefill_in_pieces_and_decoding_equal_transformers(pair) -> None:
    ref, model = pair
    ids = tokens(120)
    expected = reference(ref, ids)
    for seed, most in ((0, 1), (1, 9), (2, 40)):  # token by token, small and large pieces
        cache, done, got = new_cache(model), 0, []
        for size in pieces(len(ids), seed, most):
            got.append(run(model, cache, ids[done : done + size], cache.append_source(size)))
            done += size
        assert (torch.cat(got) - expected).abs().max() <= TOL
        assert cache.evicted == 0 and cache.source_len == len(ids)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def one_layer(request, tmp_path_factory) -> tuple[PreTrainedModel, Transformer]:
    """With one layer a token's K/V depend on the token alone, so after overflow the sink cache must equal a
    from-scratch forward over [sinks + window] at positions 0..n-1 exactly (StreamingLLM's reference)."""
    path = tmp_path_factory.mktemp(f"{request.param}-1")
    ref = build(request.param, path, layers=1)
    return ref, load_transformer(path)


def test_after_overflow_logits_equal_sinks_plus_window(one_layer) -> None:
    """10k+ tokens through a 4 + 32 window: every chunk's rows equal a fresh forward over the sinks and the
    window those tokens saw, positions stay below sink + window, and the cache never grows or moves."""
    ref, model = one_layer
    sink, window = 4, 32
    cache = new_cache(model, sink=sink, window=window)
    ids = tokens(10_050, seed=3)
    before = (cache.nbytes(), cache.k.data_ptr(), cache.v.data_ptr(), cache.kr.data_ptr())
    done, checked, worst = 0, 0, 0.0
    for i, size in enumerate(pieces(len(ids), 4, 24)):
        got = run(model, cache, ids[done : done + size], cache.append_source(size))
        done += size
        assert cache.source_len == min(done, sink + window) and cache.evicted == max(0, done - sink - window)
        assert int(cache.pos[: cache.source_len].max()) < sink + window
        if i % 5 == 0 or done == len(ids):
            visible = ids[:sink] + ids[max(sink, done - window) : done]  # the live cache after this chunk
            worst = max(worst, float((got - reference(ref, visible)[-size:]).abs().max()))
            checked += 1
    assert worst <= TOL and checked > 100 and cache.evicted > 10_000
    assert (cache.nbytes(), cache.k.data_ptr(), cache.v.data_ptr(), cache.kr.data_ptr()) == before


def rerotate(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move rotated keys `shift` positions (RoPE composes: R(p + shift) = R(shift) R(p))."""
    freqs = torch.full((keys.shape[-2], 1), float(shift)) * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    half = keys.shape[-1] // 2
    rotated = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    return keys * emb.cos() + rotated * emb.sin()


@torch.no_grad()
def test_after_overflow_deep_models_equal_a_streaming_reference(pair) -> None:
    """With several layers a window token's deeper K/V keep what it saw when computed (that is StreamingLLM);
    the independent reference is transformers' own cache, evicted the same way with its kept keys re-rotated
    to their new positions."""
    ref, model = pair
    sink, window = 4, 24
    cache, hf = new_cache(model, sink=sink, window=window), DynamicCache()
    inv_freq = model.inv_freq
    ids, done, worst = tokens(700, seed=12), 0, 0.0
    for size in pieces(len(ids), 13, 9):
        got = run(model, cache, ids[done : done + size], cache.append_source(size))
        held = hf.get_seq_length()
        evict = max(0, held + size - sink - window)
        if evict:
            for layer in hf.layers:
                kept = rerotate(layer.keys[:, :, sink + evict :], -evict, inv_freq)
                layer.keys = torch.cat([layer.keys[:, :, :sink], kept], dim=-2)
                layer.values = torch.cat([layer.values[:, :, :sink], layer.values[:, :, sink + evict :]], dim=-2)
        held -= evict
        out = ref(torch.tensor([ids[done : done + size]]), past_key_values=hf, use_cache=True,
                  position_ids=torch.arange(held, held + size)[None])
        worst = max(worst, float((got - out.logits[0]).abs().max()))
        done += size
    assert cache.evicted == len(ids) - sink - window and worst <= TOL


def test_update_mode_truncation_then_reprefill(pair) -> None:
    ref, model = pair
    ids = tokens(60, seed=5)
    cache = new_cache(model)
    run(model, cache, ids, cache.append_source(len(ids)))
    cache.truncate_source(41)  # the tail was revised: keep the common prefix, prefill the new suffix
    revised = ids[:41] + tokens(13, seed=6)
    got = run(model, cache, revised[41:], cache.append_source(13))
    assert (got - reference(ref, revised)[41:]).abs().max() <= TOL


def random_tree(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(-1, i) if rng.random() < 0.3 else rng.randrange(max(0, i - 3), i) for i in range(1, n)]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_scores_and_commit_keep_exactly_the_path(pair) -> None:
    """The target group: prompt tail, then trees; each node's logits equal a plain forward over committed + its
    path; after commit, the next tree scores as if the path had been decoded one token at a time."""
    ref, model = pair
    source, tail = tokens(30, seed=7), tokens(6, seed=8)
    cache = new_cache(model)
    run(model, cache, source, cache.append_source(len(source)))
    cache.begin_target()
    run(model, cache, tail, cache.append_target(len(tail)))
    committed = source + tail
    for step in range(4):
        parents = random_tree(12, seed=step)
        nodes = tokens(12, seed=20 + step)
        got = run(model, cache, nodes, cache.score_tree(parents))
        for i in range(len(nodes)):
            path = [nodes[j] for j in path_to(parents, i)]
            assert (got[i] - reference(ref, committed + path)[-1]).abs().max() <= TOL
        keep = path_to(parents, max(range(12), key=lambda i: len(path_to(parents, i))))  # the deepest path
        cache.commit(keep)
        committed += [nodes[j] for j in keep]
    with pytest.raises(ValueError, match="not a root-to-node path"):
        cache.score_tree([-1, 0, 0])
        cache.commit([0, 2, 1])
    # a plain continuation after the commits equals a forward over everything committed
    last = run(model, cache, [5], cache.score_tree([-1]))
    assert (last[0] - reference(ref, committed + [5])[-1]).abs().max() <= TOL


def test_source_during_an_answer_is_a_separate_group(pair) -> None:
    """Source tokens added during an answer (even a revision of tokens the answer sees) do not change the
    answer's logits; after end_target they sit in order, equal to a fresh prefill."""
    ref, model = pair
    source, tail = tokens(40, seed=9), tokens(5, seed=10)
    cache = new_cache(model, window=64, reserve=24)
    run(model, cache, source, cache.append_source(len(source)))
    cache.begin_target()
    run(model, cache, tail, cache.append_target(len(tail)))
    cache.truncate_source(33)  # revise the last 7 source tokens the answer sees: they become stale
    revised = source[:33] + tokens(20, seed=11)
    got_src = run(model, cache, revised[33:], cache.append_source(20))
    assert (got_src - reference(ref, revised)[33:]).abs().max() <= TOL
    got = run(model, cache, [7, 8], cache.score_tree([-1, 0]))
    assert (got - reference(ref, source + tail + [7, 8])[-2:]).abs().max() <= TOL
    assert cache.source_room() == 24 - 20
    cache.end_target()
    assert cache.source_len == 53 and cache.evicted == 0
    cache.begin_target()
    got = run(model, cache, tail, cache.append_target(len(tail)))
    assert (got - reference(ref, revised + tail)[-len(tail) :]).abs().max() <= TOL


def test_overflow_during_an_answer_is_evicted_after_it(one_layer) -> None:
    """No eviction while an answer runs (it must keep its view); end_target evicts the overflow."""
    ref, model = one_layer
    source, tail = tokens(30, seed=13), tokens(4, seed=14)
    cache = new_cache(model, sink=4, window=28, reserve=16)
    for piece in (source[:16], source[16:]):  # 30 < sink + window: nothing evicted
        run(model, cache, piece, cache.append_source(len(piece)))
    cache.begin_target()
    run(model, cache, tail, cache.append_target(len(tail)))
    more = tokens(10, seed=15)
    run(model, cache, more, cache.append_source(10))
    got = run(model, cache, [3], cache.score_tree([-1]))
    assert cache.evicted == 0 and (got[0] - reference(ref, source + tail + [3])[-1]).abs().max() <= TOL
    cache.end_target()
    assert cache.evicted == 8 and cache.source_len == 32
    cache.begin_target()
    got = run(model, cache, tail, cache.append_target(len(tail)))
    visible = source[:4] + (source + more)[12:]  # 40 tokens, 8 evicted after the sinks
    assert (got - reference(ref, visible + tail)[-len(tail) :]).abs().max() <= TOL


def test_target_group_is_bounded() -> None:
    cache = SinkKVCache(layers=1, kv_heads=1, head_dim=2, sink=2, window=8, reserve=4, target=6)
    cache.append_source(8)
    cache.begin_target()
    cache.append_target(4)
    with pytest.raises(RuntimeError, match="target group full"):
        cache.score_tree([-1, 0, 1])
    assert cache.source_room() == 4
    cache.append_source(4)
    assert cache.source_room() == 0
    with pytest.raises(ValueError, match="cannot append"):
        cache.append_source(1)
    assert cache.nbytes() == 3 * (2 + 8 + 4 + 6) * 2 * 4 + 2 * (2 + 8 + 4 + 6) * 8  # K, V, rotated K; pos, rot_pos


def rotated_right(model: Transformer, cache: SinkKVCache, size: int) -> bool:
    """The rotated-key buffer holds slots [0, size) rotated at their current positions, exactly as rotating
    every stored key again would."""
    cos, sin = model.rope(cache.pos[:size])
    k = cache.k[:, :, :, :size]
    return bool((cache.rot_pos[:size] == cache.pos[:size]).all()) and torch.equal(
        cache.kr[:, :, :, :size], apply_rope(k, cos, sin))


def test_rotated_keys_are_reused_and_follow_every_move(pair) -> None:
    """Each forward rotates only new keys and keys whose position changed: a tree step finds nothing stale
    below its own slots, and after every forward and every move (eviction, truncation, commit with
    compaction, end_target) the rotated keys equal a full re-rotation (the logits are checked above)."""
    _, model = pair
    cache = new_cache(model, sink=4, window=24, reserve=16)
    ids, done = tokens(70, seed=30), 0
    for size in pieces(len(ids), 31, 7):  # evicts as it goes
        attend = cache.append_source(size)
        run(model, cache, ids[done : done + size], attend)
        done += size
        assert rotated_right(model, cache, attend.mask.shape[1])
    assert cache.evicted > 0
    cache.truncate_source(cache.source_len - 3)
    run(model, cache, [1, 2], cache.append_source(2))
    cache.begin_target()
    run(model, cache, [3, 4, 5], cache.append_target(3))
    for step in range(4):
        parents = random_tree(8, seed=40 + step)
        attend = cache.score_tree(parents)
        assert torch.equal(cache.rot_pos[: attend.slot], cache.pos[: attend.slot])  # nothing to re-rotate
        run(model, cache, tokens(8, seed=50 + step), attend)
        assert rotated_right(model, cache, attend.mask.shape[1])
        cache.commit(path_to(parents, max(range(8), key=lambda i: len(path_to(parents, i)))))
        assert rotated_right(model, cache, cache.t0 + cache.tc)
        run(model, cache, [6 + step], cache.append_source(1))  # source arriving during the answer
    cache.end_target()  # moves those 4 back after the window, then evicts the overflow
    assert cache.evicted > 0 and bool((cache.rot_pos[cache.sink : cache.a] == -1).all())  # stale until used
    attend = cache.append_source(3)
    run(model, cache, [7, 8, 9], attend)
    assert rotated_right(model, cache, attend.mask.shape[1])
