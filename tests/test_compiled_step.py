"""The CPU decode step compiled by torch.compile (runtime/models/lm/compiled_step.py): its logits must be the
eager engine's one-token `score()` logits (float32: to rounding; bf16 activations, as int8/int4 weights run:
bitwise), over a window that has slid (eviction) and keys awaiting re-rotation, and greedy decoding with it
must give the eager engine's tokens. Tiny models only: a compile takes seconds there, a minute on a real one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from runtime.config import LMConfig
from runtime.errors import ConfigError
from runtime.models.lm.compiled_step import CompiledStep, wanted
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_session import EngineSession

# one worker compiles each format's steps for every test here (`--dist loadgroup`): spread over two, the int8 engine's
# compile (its decode and tree steps, 12-17 s in `make test`) ran on both
pytestmark = pytest.mark.xdist_group("compiled_step")

WORDS = ["the", "team", "talks", "about", "budget", "for", "next", "year", "in", "morning", "meeting", "and"]


def session(engine: LMEngine) -> EngineSession:
    s = engine.open_session()
    s.set_context(" ".join(WORDS[(i * 7) % len(WORDS)] for i in range(300)))  # far past the window: evicted
    while s.prefill_step():
        pass
    assert s.cache.evicted > 0
    s.begin_answer("What did the team talk about?")
    return s


@pytest.fixture(scope="module")
def loaded() -> Callable[[str], tuple[LMEngine, LMEngine]]:
    """Weight format -> (eager, compiled) engines of the same tiny model, each format loaded and compiled once for
    the module."""
    made: dict[str, tuple[LMEngine, LMEngine]] = {}

    def load(weights: str) -> tuple[LMEngine, LMEngine]:
        if weights not in made:
            eager, compiled = (LMEngine.load(LMConfig(backend="engine", model="tiny:qwen2", window_tokens=64,
                                                      prefill_chunk_tokens=16, max_new_tokens=48, weights=weights,
                                                      compile=mode), device="cpu", dtype="float32")
                               for mode in ("off", "on"))
            made[weights] = eager, compiled
        return made[weights]

    return load


@pytest.fixture(scope="module", params=["fp32", "int8"])
def engines(request: pytest.FixtureRequest, loaded: Callable[[str], tuple[LMEngine, LMEngine]],
            ) -> tuple[LMEngine, LMEngine]:
    """(eager, compiled) engines of the same tiny model and weight format."""
    return loaded(request.param)


def close(got: torch.Tensor, want: torch.Tensor, weights: str) -> bool:
    if weights == "fp32":
        return float((got - want).abs().max()) <= 1e-5
    return torch.equal(got, want)


def test_compiled_logits_equal_the_eager_step(engines):
    eager, compiled = engines
    assert eager.compiled is None and compiled.compiled is not None
    step = compiled.compiled
    s = session(compiled)
    token = int(s.next_logits().argmax())
    for _ in range(12):
        attend = s.cache.score_tree([-1])
        assert step.fits(attend)
        got = step.run(token, attend, s.cache)
        s.cache.commit([])
        want = s._forward([token], s.cache.score_tree([-1]), last_only=False)  # the eager step, same slot
        assert close(got, want, compiled.model.weights)
        s.commit([])
        s.score([token], [-1])
        s.commit([0])
        token = int(s.next_logits().argmax())


def test_compiled_step_rerotates_keys_that_moved(engines):
    eager, compiled = engines
    s = session(compiled)
    token = int(s.next_logits().argmax())
    want = s._forward([token], s.cache.score_tree([-1]), last_only=False)
    s.cache.commit([])
    cache = s.cache
    with torch.inference_mode():
        cache.kr[:, :, :, 5:9] = 0.0  # stale rotated keys that must not be used as they are
        cache.rot_pos[5:9] = -1
    runs = compiled.compiled.runs
    got = s.score([token], [-1])
    assert compiled.compiled.runs == runs + 1
    assert close(got, want, compiled.model.weights)
    assert cache.rot_pos[5:9].tolist() == cache.pos[5:9].tolist()


def test_greedy_decoding_is_token_identical(engines):
    outputs = []
    for engine in engines:
        s = session(engine)
        tokens = []
        for _ in range(40):
            token = int(s.next_logits().argmax())
            s.score([token], [-1])
            s.commit([0])
            tokens.append(token)
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    assert engines[1].compiled.runs >= 40


def test_trees_compile_where_attention_runs_on_the_kernel_and_equal_the_eager_verification(engines):
    eager, compiled = engines
    step = compiled.compiled
    a, b = session(eager), session(compiled)
    runs, trees = step.runs, step.tree_runs
    tokens, parents = [5, 6, 7, 9, 11], [-1, 0, 0, 1, 3]  # a drafted tree: two branches, depth 3
    want, got = a.score(tokens, parents), b.score(tokens, parents)
    assert step.runs == runs and not CompiledStep.fits(b.cache.score_tree(parents))  # not the one-token step's
    b.score(tokens, parents)
    if not compiled.model.kernel_attention:  # fp32: torch's SDPA a token at a time, eagerly
        assert step.tree_runs == trees and close(got, want, "fp32")
        return
    assert step.tree_runs == trees + 2  # the tree scored twice
    assert torch.equal(got, want)
    # each node's logits are the one-token step's at its place: commit the path 0-1-3 and step it plainly
    a.commit([0, 1, 3])
    c = session(compiled)
    for node, token in ((0, 5), (1, 6), (3, 9)):
        assert torch.equal(c.score([token], [-1])[0], got[node])
        c.commit([0])
    assert torch.equal(c.score([11], [-1])[0], got[4])


def test_which_models_compile():
    eager, compiled = (LMEngine.load(LMConfig(backend="engine", model="tiny:qwen2", window_tokens=64,
                                              weights=w, compile="off"), device="cpu", dtype="float32")
                       for w in ("fp32", "int8"))
    assert not wanted("auto", eager.model) and wanted("auto", compiled.model)
    assert not wanted("auto", compiled.model, "ngram")  # a drafter's verify steps stay eager: no compile
    assert wanted("on", eager.model) and not wanted("off", compiled.model)
    with pytest.raises(ConfigError, match="lm.compile"):
        wanted("always", eager.model)


def test_auto_decodes_eagerly_when_the_step_does_not_compile(monkeypatch):
    """No C++ compiler, an unwritable cache: `auto` warns and runs eager; `on` is a one-line error."""
    import runtime.models.lm.engine as engine_module

    class Broken:
        def __init__(self, model, store) -> None:
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found\n(details)")

    monkeypatch.setattr(engine_module, "CompiledStep", Broken)
    cfg = LMConfig(backend="engine", model="tiny:qwen2", window_tokens=64, weights="int8", drafter="none")
    assert LMEngine.load(cfg, device="cpu", dtype="float32").compiled is None
    with pytest.raises(ConfigError, match="did not compile: InvalidCxxCompiler") as err:
        LMEngine.load(replace(cfg, compile="on"), device="cpu", dtype="float32")
    assert "\n" not in str(err.value)


def test_a_drafter_s_own_engine_does_not_compile_under_auto():
    from runtime.models.lm.engine_answerer import EngineAnswerer

    cfg = LMConfig(backend="engine", model="tiny:qwen2", window_tokens=64, weights="int8", drafter="swift")
    answerer = EngineAnswerer.load(cfg, device="cpu", dtype="float32")
    assert answerer.engine.compiled is None and answerer.draft_engine is not None
    assert answerer.draft_engine.compiled is None  # its steps are drafts, verified in trees: eager


def test_a_changed_thread_count_compiles_its_own_step(loaded):
    """The step runs without dynamo's guards, so its own key must catch what they would: torch bakes the thread
    count into the kernels, and a step compiled for another count must not run. On int8 alone: the key (`_key`)
    and the recompile are the same code for every format, int8's logits must be bitwise the eager step's, and
    each format's recompile cost 4-6 CPU seconds here (fp32's 3.9)."""
    _, compiled = loaded("int8")
    step = compiled.compiled
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    s = session(compiled)
    token = int(s.next_logits().argmax())
    want = s._forward([token], s.cache.score_tree([-1]), last_only=False)
    s.cache.commit([])
    keys = len(step._steps)
    try:
        torch.set_num_threads(other)
        got = s.score([token], [-1])
    finally:
        torch.set_num_threads(before)
    assert len(step._steps) == keys + 1
    assert close(got, want, compiled.model.weights)


def test_inputs_outside_the_compiled_form_never_reach_the_unguarded_step(engines, monkeypatch):
    """Without guards the step must check what they would: an attended length beyond the buffers is an error, a
    cache of other strides is another key, and a key that does not compile decodes eagerly, with the same logits."""
    _, compiled = engines
    step = compiled.compiled
    s = session(compiled)
    cache = s.cache
    cos, sin = compiled.model.rope(torch.tensor([3]))
    with pytest.raises(ValueError, match="attends 2 to"):
        step._step(0, cos[:, None], sin[:, None], cache.k, cache.v, cache.kr, 2, cache.k.shape[3] + 1)
    strided = cache.k.transpose(3, 4).contiguous().transpose(3, 4)  # same shape, other strides
    assert strided.shape == cache.k.shape
    from runtime.models.lm.compiled_step import _key

    assert _key(cos, sin, strided, cache.v, cache.kr) != _key(cos, sin, cache.k, cache.v, cache.kr)

    def broken(key, args):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(step, "_compile", broken)
    token = int(s.next_logits().argmax())
    want = s._forward([token], s.cache.score_tree([-1]), last_only=False)
    s.cache.commit([])
    before, runs = torch.get_num_threads(), step.runs
    try:
        torch.set_num_threads(3 if before != 3 else 4)  # a key never compiled
        got = s.score([token], [-1])
    finally:
        torch.set_num_threads(before)
    assert step.runs == runs  # eager
    assert close(got, want, compiled.model.weights)
    if step._tree_traced is not None:  # the verification step, unguarded too: a tree over too few slots
        attend = cache.score_tree([-1, 0])
        with pytest.raises(ValueError, match="compiled verification"):
            step.run_tree([1, 2], replace(attend, mask=attend.mask[:, :2]), cache)
        cache.commit([])


def test_a_kept_step_is_read_back_by_the_next_engine_and_reads_that_engine_s_weights(tmp_path, caplog):
    """compiled_store.py: a step compiled ahead is written to the store; an engine loaded after it (as another
    process would) reads it back instead of compiling, and its logits are bitwise its own eager step's, with weights
    unlike the first engine's (the step reads them at each call, never baked in). A file that does not read back is
    compiled and written again; a model of another structure is another file."""
    from runtime.models.lm.compiled_step import OPTIONS, _key
    from runtime.models.lm.compiled_store import StepStore, step_key

    cfg = LMConfig(backend="engine", model="tiny:qwen2", window_tokens=64, prefill_chunk_tokens=16,
                   max_new_tokens=48, weights="int8", compile="off")
    first, second = (LMEngine.load(cfg, device="cpu", dtype="float32") for _ in range(2))
    with torch.no_grad():
        second.model.model.embed_tokens.weight.mul_(1.5)  # other weights, the same structure
    a = second.model.args
    geometry = (a.num_layers, a.num_kv_heads, second.capacity(), a.head_dim)
    store = StepStore(tmp_path)
    CompiledStep(first.model, store).warm_up(*geometry)
    assert (store.saved, store.loaded) == (1, 0) and len(list(tmp_path.iterdir())) == 1
    step = CompiledStep(second.model, store)
    step.warm_up(*geometry)
    assert (store.saved, store.loaded) == (1, 1)
    s, other = session(second), session(first)
    token = int(s.next_logits().argmax())
    got = step.run(token, s.cache.score_tree([-1]), s.cache)
    s.cache.commit([])
    want = s._forward([token], s.cache.score_tree([-1]), last_only=False)
    assert step.runs == 1 and torch.equal(got, want)
    assert not torch.equal(want, other._forward([token], other.cache.score_tree([-1]), last_only=False))

    kept = next(tmp_path.iterdir())
    kept.write_bytes(b"torn")
    CompiledStep(first.model, store).warm_up(*geometry)
    assert "did not read back" in caplog.text and store.saved == 2 and kept.stat().st_size > 4
    cache = s.cache
    cos, sin = second.model.rope(torch.tensor([2]))
    key = _key(cos[:, None], sin[:, None], cache.k, cache.v, cache.kr)
    fp32 = LMEngine.load(replace(cfg, weights="fp32"), device="cpu", dtype="float32")
    assert step_key(fp32.model, "decode_step", key, OPTIONS) != step_key(second.model, "decode_step", key, OPTIONS)
    # a file that reads back but does not run (here: the int8 step under the fp32 model's name) is compiled again
    scratch = torch.zeros(a.num_layers, 1, a.num_kv_heads, second.capacity(), a.head_dim, dtype=fp32.model.dtype)
    cos, sin = fp32.model.rope(torch.tensor([2]))
    kept.rename(tmp_path / step_key(fp32.model, "decode_step", _key(cos[:, None], sin[:, None], *[scratch] * 3),
                                    OPTIONS))
    CompiledStep(fp32.model, store).warm_up(*geometry)
    assert "does not run here" in caplog.text and store.saved == 3


def test_the_store_keeps_the_steps_used_last(tmp_path):
    """Each change to the model code names new files: writing one drops all but the `KEEP` used last."""
    import os
    from pathlib import Path

    from runtime.models.lm.compiled_store import KEEP, StepStore

    for i in range(KEEP + 5):
        old = tmp_path / f"old{i}.step"
        old.write_bytes(b"x")
        os.utime(old, (1_000 + i, 1_000 + i))

    class Written:
        def save_compiled_function(self, path: str, external_data: dict) -> None:
            Path(path).write_bytes(b"a step")

    StepStore(tmp_path).save("new.step", Written(), torch.nn.Linear(1, 1))
    left = {p.name for p in tmp_path.iterdir()}
    assert len(left) == KEEP and "new.step" in left and "old5.step" not in left and f"old{KEEP + 4}.step" in left
