"""The fixed-form decode step (runtime/models/lm/cuda_graph.py) that CUDA graphs record: run eagerly it must
give the engine's ordinary one-token `score()` logits, over a window that has slid (eviction) and when moved
keys still await re-rotation; on a CUDA machine, the recorded graph must decode the same tokens as the
ungraphed engine. The CUDA test is skipped where there is no GPU (CI); the CPU tests hold the math."""

from __future__ import annotations

import pytest
import torch

from runtime.config import LMConfig
from runtime.models.lm.cuda_graph import DecodeGraph
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_session import EngineSession

WORDS = ["the", "team", "talks", "about", "budget", "for", "next", "year", "in", "morning", "meeting", "and"]


def text(n_words: int) -> str:
    return " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n_words))


def streamed(device: str = "cpu", *, cuda_graphs: bool = True, window: int = 64) -> EngineSession:
    cfg = LMConfig(backend="engine", model="tiny:qwen2", window_tokens=window, prefill_chunk_tokens=16,
                   max_new_tokens=48, cuda_graphs=cuda_graphs)
    session = LMEngine.load(cfg, device=device, dtype="float32").open_session()
    session.set_context(text(300))  # far past the window: the cache has evicted and shifted keys
    while session.prefill_step():
        pass
    assert session.cache.evicted > 0
    session.begin_answer("What did the team talk about?")
    return session


def test_the_fixed_step_equals_score_after_the_window_slid():
    session = streamed()
    fixed = DecodeGraph(session.engine.model, session.cache, graph=False)
    token = int(session.next_logits().argmax())
    for _ in range(12):
        got = fixed.run(token, session.cache.score_tree([-1]))
        want = session.score([token], [-1])  # rewrites the same slot the same way
        assert float((got - want).abs().max()) <= 1e-5
        session.commit([0])
        token = int(session.next_logits().argmax())


def test_the_fixed_step_rerotates_keys_that_moved():
    """Keys whose rotation is out of date (as eviction leaves them) are re-rotated before the step."""
    session = streamed()
    fixed = DecodeGraph(session.engine.model, session.cache, graph=False)
    token = int(session.next_logits().argmax())
    want = session.score([token], [-1])
    session.commit([])
    cache = session.cache
    with torch.inference_mode():
        cache.kr[:, :, :, 5:9] = 0.0  # stale rotated keys that must not be used as they are
        cache.rot_pos[5:9] = -1
    got = fixed.run(token, cache.score_tree([-1]))
    assert float((got - want).abs().max()) <= 1e-5
    assert cache.rot_pos[5:9].tolist() == cache.pos[5:9].tolist()


def test_graphs_are_cuda_only():
    session = streamed()
    assert session._decode_graph() is None  # CPU: the ordinary forward
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraph(session.engine.model, session.cache, graph=True)
    with pytest.raises(ValueError, match="one token"):
        DecodeGraph(session.engine.model, session.cache, graph=False).run(1, session.cache.score_tree([-1, 0]))


def greedy_tokens(session: EngineSession, n: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, rows = [], []
    for _ in range(n):
        token = int(session.next_logits().argmax())
        rows.append(session.score([token], [-1]))
        session.commit([0])
        tokens.append(token)
    return tokens, rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recorded_graph_decodes_like_the_ungraphed_engine():
    plain, graphed = streamed("cuda", cuda_graphs=False), streamed("cuda", cuda_graphs=True)
    want, want_rows = greedy_tokens(plain, 24)
    got, got_rows = greedy_tokens(graphed, 24)
    assert got == want
    assert max(float((a - b).abs().max()) for a, b in zip(got_rows, want_rows, strict=True)) <= 1e-4
    assert graphed._graph is not None and graphed._graph.replays >= 23
