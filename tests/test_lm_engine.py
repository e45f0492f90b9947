"""The language engine: streaming prefill (append and update mode), source/target position groups, tree scoring
through the session (the Target protocol), the attention-sink window, and the answerer adapter, each checked
against transformers' own forward or generate() on the same token ids."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from lm_common import PROMPTS, N
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from runtime.config import LMConfig
from runtime.errors import ConfigError
from runtime.models.lm.engine import LMEngine
from runtime.models.lm.engine_session import EngineSession
from runtime.models.lm.generate_answerer import GenerateAnswerer
from runtime.models.lm.source_tokens import SourceTokens

TOL = 1e-4
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "cat", "watches", "from", "window",
    "good", "morning", "everyone", "today", "we", "talk", "about", "speech", "text", "real", "time", "budget",
    "grow", "ten", "percent", "finance", "team",
]


def transcript(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines, words = [], []
    for i in range(n_words):
        words.append(rng.choice(WORDS))
        if len(words) == 9 or i == n_words - 1:
            lines.append(f"[{len(lines) // 6:02d}:{(len(lines) * 7) % 60:04.1f}] " + " ".join(words) + ".")
            words = []
    return "\n".join(lines)


@pytest.fixture(scope="module")
def engine() -> LMEngine:
    return LMEngine.load(LMConfig(max_new_tokens=N, prefill_chunk_tokens=16), device="cpu", dtype="float32")


@torch.no_grad()
def forward(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def drain(session: EngineSession) -> int:
    total = 0
    while n := session.prefill_step():
        total += n
    return total


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOL


def test_load_reports_progress_and_checks_config() -> None:
    lines: list[str] = []
    LMEngine.load(LMConfig(), device="cpu", dtype="float32", progress=lines.append)
    assert lines[0] == "loading lm tiny:qwen2 on cpu/float32 ..." and lines[-1].startswith("lm loaded in ")
    lines.clear()
    LMEngine.load(LMConfig(weights="int8"), device="cpu", dtype="float32", progress=lines.append)
    assert lines[0] == "loading lm tiny:qwen2 on cpu/float32, int8 weights ..."
    with pytest.raises(ConfigError, match="window_tokens"):
        LMEngine.load(LMConfig(window_tokens=0), device="cpu", dtype="float32")


def test_prompt_layout_is_the_answerers_prompt(engine: LMEngine, hf: PreTrainedModel) -> None:
    answerer = GenerateAnswerer(hf, engine.tokenizer, engine.cfg, name="plain")
    for context, question in PROMPTS:
        head, tail = engine.prompt_parts(question)
        assert head == engine.head and head + (context or "(nothing yet)") + tail == answerer.prompt_text(context,
                                                                                                          question)
    session = engine.open_session()
    session.set_context("she said hello")
    session.begin_answer("What did she say?")
    text = engine.tokenizer.decode(session.answer_ids())
    assert text == answerer.prompt_text("she said hello", "What did she say?")
    assert session.source_ids()[: engine.sink] == engine.encode(engine.head)[: engine.sink]


def test_streaming_prefill_equals_a_fresh_forward(engine: LMEngine, hf: PreTrainedModel) -> None:
    """Words arrive one by one with an unstable tail the ASR revises; prefill runs between some of them."""
    final = transcript(60, seed=1)
    words = final.split(" ")
    session, rng = engine.open_session(), random.Random(2)
    for i in range(1, len(words) + 1):
        session.set_context(" ".join(words[:i]) + (" (unsure" if i < len(words) else ""))
        if rng.random() < 0.6:
            session.prefill_step()
    session.set_context(final)
    session.begin_answer("What was said?")
    ids = session.answer_ids()
    assert ids[: session.cache.source_len] == engine.encode(engine.head + final)
    assert close(session.next_logits(), forward(hf, ids)[-1])
    assert session.stats.truncated > 0  # the unstable tails were cut back and re-prefilled


def test_update_mode_recomputes_only_the_changed_suffix(engine: LMEngine, hf: PreTrainedModel) -> None:
    before = transcript(40, seed=3) + " and the budget will grow by ten"
    after = transcript(40, seed=3) + " and the finance team will manage it"
    old, new = engine.encode(engine.head + before), engine.encode(engine.head + after)
    common = next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b)
    session = engine.open_session()
    session.set_context(before)
    assert drain(session) == len(old)
    session.set_context(after)
    assert session.pending_tokens() == len(new) - common and session.stats.truncated == len(old) - common
    assert drain(session) == len(new) - common  # only the changed suffix is recomputed
    session.begin_answer("Who manages it?")
    fresh = engine.open_session()
    fresh.set_context(after)
    fresh.begin_answer("Who manages it?")
    assert session.answer_ids() == fresh.answer_ids()
    assert close(session.next_logits(), fresh.next_logits())
    assert close(session.next_logits(), forward(hf, session.answer_ids())[-1])


def greedy(session: EngineSession, steps: int) -> list[torch.Tensor]:
    """Decode through the Target protocol: the one-node tree, then commit it."""
    rows = [session.next_logits()]
    for _ in range(steps):
        session.score([int(rows[-1].argmax())], [-1])
        session.commit([0])
        rows.append(session.next_logits())
    return rows


def test_source_during_an_answer_is_invisible_to_it_and_visible_to_the_next(engine: LMEngine,
                                                                             hf: PreTrainedModel) -> None:
    first = transcript(30, seed=4) + " the budget will grow"
    later = transcript(30, seed=4) + " the budget will shrink, said the finance team, by ten percent"
    session = engine.open_session()
    session.set_context(first)
    drain(session)
    session.begin_answer("What about the budget?")
    prompt = session.answer_ids()
    rows = greedy(session, 2)
    session.set_context(later)  # the ASR revised the tail the answer sees, and more words came
    assert drain(session) > 0 and session.stats.truncated > 0
    rows += greedy(session, 3)[1:]
    answer = session.answer_ids()
    assert answer[: len(prompt)] == prompt and session.committed_tokens() == len(answer)
    reference = forward(hf, answer)[len(prompt) - 1 :]
    assert all(close(row, ref) for row, ref in zip(rows, reference, strict=True))
    session.end_answer()
    session.begin_answer("And now?")
    fresh = engine.encode(engine.head + later) + engine.encode(engine.prompt_parts("And now?")[1])
    assert session.answer_ids() == fresh and close(session.next_logits(), forward(hf, fresh)[-1])


def test_source_waits_when_the_reserve_is_full(tiny_path: Path) -> None:
    cfg = LMConfig(prefill_chunk_tokens=4, max_new_tokens=4)
    engine = LMEngine.load(cfg, device="cpu", dtype="float32", reserve_tokens=6)
    session = engine.open_session()
    session.set_context("one two")
    session.begin_answer("Why?")
    session.set_context("one two three four five six seven eight nine ten")
    assert session.prefill_step() == 4 and session.prefill_step() == 2 and session.prefill_step() == 0
    assert session.pending_tokens() > 0
    session.end_answer()
    assert drain(session) > 0 and session.pending_tokens() == 0


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_scoring_through_the_session(engine: LMEngine, hf: PreTrainedModel) -> None:
    session = engine.open_session()
    session.set_context(transcript(20, seed=5))
    session.begin_answer("Summarise.")
    parents = [-1, 0, 0, 1, 1, 2, 3, -1, 7, 8]
    nodes = [5, 17, 99, 3, 250, 42, 7, 11, 12, 13]
    committed = session.answer_ids()
    logits = session.score(nodes, parents)
    for i in range(len(nodes)):
        assert close(logits[i], forward(hf, committed + [nodes[j] for j in path_to(parents, i)])[-1])
    session.commit([0, 1, 3, 6])
    assert session.answer_ids() == committed + [5, 17, 3, 7] and session.committed_tokens() == len(committed) + 4
    assert close(session.next_logits(), forward(hf, session.answer_ids())[-1])
    session.score([1, 2], [-1, 0])
    session.commit([])  # drop the whole tree: nothing changes
    assert session.committed_tokens() == len(committed) + 4
    assert close(session.score([9], [-1])[0], forward(hf, session.answer_ids() + [9])[-1])


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory, tiny_path: Path) -> tuple[Path, PreTrainedModel]:
    """The tiny tokenizer beside a one-layer Qwen2: after overflow it must equal a fresh forward over
    [sinks + window] (a deeper model's window keeps what its tokens saw when computed: see test_kv_cache)."""
    path = tmp_path_factory.mktemp("qwen2-1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.3,
                      eos_token_id=tokenizer.eos_token_id)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def test_window_overflow_keeps_sinks_and_bounded_memory(one_layer) -> None:
    path, hf1 = one_layer
    cfg = LMConfig(model=str(path), window_tokens=48, prefill_chunk_tokens=16, max_new_tokens=N)
    engine = LMEngine.load(cfg, device="cpu", dtype="float32")
    session = engine.open_session()
    nbytes = session.cache.nbytes()
    assert nbytes == engine.cache_bytes()
    text = transcript(400, seed=6)
    lines = text.split("\n")
    for i in range(1, len(lines) + 1):
        session.set_context("\n".join(lines[:i]))
        drain(session)
    assert session.cache.evicted > 500 and session.cache.source_len == engine.sink + 48
    assert int(session.cache.pos.max()) < engine.sink + engine.window + engine.reserve + engine.target
    session.set_context(text + " and one more")  # update mode still works inside the window
    session.begin_answer("What came last?")
    ids = session.answer_ids()
    assert ids[: engine.sink] == engine.encode(engine.head)  # the whole head is pinned as sinks
    assert close(session.next_logits(), forward(hf1, ids)[-1])
    assert session.cache.nbytes() == nbytes


def test_llama_checkpoint_streams_like_qwen2(tmp_path: Path, tiny_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = LMEngine.load(LMConfig(model=str(tmp_path), prefill_chunk_tokens=5), device="cpu", dtype="float32")
    session = engine.open_session()
    for n in (10, 25, 40):
        session.set_context(transcript(n, seed=7))
        session.prefill_step()
    session.begin_answer("Which words?")
    assert close(session.next_logits(), forward(model, session.answer_ids())[-1])


def test_incremental_tokens_equal_a_full_tokenisation(engine: LMEngine) -> None:
    """Random ASR-like edits (append words, revise the tail, multi-byte text): the spliced ids always equal a
    fresh tokenisation, and the whole text is rarely re-tokenised."""
    tokens, rng = SourceTokens(engine.tokenizer), random.Random(8)
    text = engine.head
    extras = ["café", "日本語", "—", "🙂", "\n[00:01.5]", "  ", "percent.", "s'il"]
    for step in range(400):
        if rng.random() < 0.3 and len(text) > len(engine.head) + 10:
            text = text[: len(text) - rng.randint(1, 10)]
        text += " " + rng.choice(WORDS + extras) if rng.random() < 0.8 else rng.choice(extras)
        tokens.update(text)
        if step % 10 == 0 or step == 399:
            assert tokens.ids == engine.encode(text)
    assert tokens.ids == engine.encode(text) and tokens.full_encodes < 40


def test_int4_on_torchs_kernel_refuses_layers_it_cannot_pack_and_the_runtimes_takes_them() -> None:
    with pytest.raises(ConfigError, match="divisible by 16 .* use lm.weights = int8 or bf16"):
        LMEngine.load(LMConfig(weights="int4", kernels="torch"), device="cpu", dtype="float32")  # odd sizes
    from runtime.models.lm import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the runtime's CPU kernels do not build here")
    ours = LMEngine.load(LMConfig(weights="int4", kernels="runtime"), device="cpu", dtype="float32").model
    ref = LMEngine.load(LMConfig(weights="fp32"), device="cpu", dtype="float32").model
    for name, module in ours.named_modules():  # the reference computes in float with the weights ours holds
        if hasattr(module, "q4"):
            ref.get_submodule(name).weight = torch.nn.Parameter(module.dequantized())  # the tied head untied
    ids = torch.tensor([3, 7, 11, 2, 9])
    want, got = ref(ids, torch.arange(5)), ours(ids, torch.arange(5))
    assert float((got - want).norm() / want.norm()) < 0.05  # bf16 activations rounded to 8 bits per group of 32



def test_layer_skip_view_shares_weights_and_leaves_the_model_whole(engine: LMEngine) -> None:
    from runtime.models.lm.layer_skip import kept_layers, layer_skip_view

    model = engine.model
    layers = list(model.model.layers)
    view = layer_skip_view(model, [len(layers) - 1])
    assert len(layers) >= 2
    assert list(model.model.layers) == layers and model.args.num_layers == len(layers)  # untouched
    assert view.args.num_layers == 1 and view.model.layers[0] is layers[-1]
    assert view.model.embed_tokens is model.model.embed_tokens and view.lm_head is model.lm_head
    ids = torch.tensor([5, 9, 13, 2])
    full = model(ids, torch.arange(4))
    skipped = view(ids, torch.arange(4))
    assert full.shape == skipped.shape and not torch.allclose(full, skipped)
    assert [i for i in range(30) if i not in kept_layers(30)] == [4, 9, 14, 19, 24]
    with pytest.raises(ValueError, match="subset"):
        layer_skip_view(model, [len(layers)])


def test_the_generate_backend_refuses_engine_weight_formats() -> None:
    with pytest.raises(ConfigError, match="lm.weights = int4 is a format of the engine's own model"):
        GenerateAnswerer.load(LMConfig(backend="generate", weights="int4"), device="cpu", dtype="float32")


def test_a_question_over_the_limit_is_refused_before_the_pending_context_is_prefilled(engine: LMEngine) -> None:
    """An answer that cannot be given fails before the session's pending context costs a prefill."""
    from runtime.errors import PromptTooLong

    session = engine.open_session()
    session.set_context(transcript(200, seed=3))
    long_question = "why " * (engine.max_question_tokens + 1)
    with pytest.raises(PromptTooLong, match="shorten them"):
        session.begin_answer(long_question)
    assert session.stats.prefilled == 0 and not session.cache.answering
    session.begin_answer("What was said?")  # the session still answers, and prefills what it holds then
    assert session.stats.prefilled > 0


def test_a_context_longer_than_the_window_at_once_costs_one_window_of_prefill(one_layer) -> None:
    """A pasted document: what the window would evict before the text's end lands is never run. The one-layer
    model's keys depend on their own token only, so the answer still equals a fresh forward over what is live."""
    path, hf1 = one_layer
    engine = LMEngine.load(LMConfig(model=str(path), window_tokens=48, prefill_chunk_tokens=16, max_new_tokens=N),
                           device="cpu", dtype="float32")
    session = engine.open_session()
    session.set_context("good morning")
    drain(session)
    run = session.stats.prefilled
    text = transcript(400, seed=7)
    session.set_context(text)
    assert drain(session) == 48 and session.stats.prefilled - run == 48  # the window, not ~1,000 tokens
    assert session.stats.skipped > 800 and session.cache.source_len == engine.sink + 48
    session.begin_answer("What came last?")
    ids = session.answer_ids()
    assert ids[: engine.sink] == engine.encode(engine.head)
    full = engine.encode(engine.head + text)
    assert ids[engine.sink : engine.sink + 48] == full[-48:]  # the live window is the text's end
    assert close(session.next_logits(), forward(hf1, ids)[-1])
    session.end_answer()
    session.set_context(text + " and one more")  # it streams on from there as usual
    assert 0 < drain(session) < 16 and session.stats.skipped > 800


def test_a_fresh_session_runs_its_sinks_before_skipping(engine: LMEngine) -> None:
    session = engine.open_session()
    session.set_context(transcript(3000, seed=8))
    prefilled = drain(session)
    assert session.stats.skipped > 0 and prefilled <= engine.sink + engine.chunk + engine.window
    assert session.source_ids()[: engine.sink] == engine.encode(engine.head)[: engine.sink]


def test_an_edit_before_the_window_makes_the_window_the_new_texts_end(one_layer) -> None:
    """A long pasted item deleted: the old history held nothing of the short context left (the window stayed empty
    until the context outgrew the deleted one). The source starts again from the sinks, as a fresh session would;
    during an answer that waits for its end."""
    path, hf1 = one_layer
    engine = LMEngine.load(LMConfig(model=str(path), window_tokens=48, prefill_chunk_tokens=16, max_new_tokens=N),
                           device="cpu", dtype="float32")
    session = engine.open_session()
    talk = transcript(30, seed=9)
    session.set_context(transcript(300, seed=10) + "\n" + talk)  # a long item first, then the talk
    drain(session)
    assert session.cache.evicted > 0
    session.set_context(talk)  # the long item deleted
    assert drain(session) > 0 and session.stats.restarts == 1
    live = engine.encode(engine.head + talk)
    assert session.source_ids() == live[: engine.sink] + live[max(engine.sink, len(live) - 48):]
    session.begin_answer("What was said?")
    assert close(session.next_logits(), forward(hf1, session.answer_ids())[-1])
    # during an answer the answer keeps its view; the restart comes once it has ended
    session.end_answer()
    session.set_context(transcript(300, seed=11) + "\n" + talk)  # (an edit before the window too)
    drain(session)
    session.begin_answer("What was said?")
    before, prefilled = session.stats.restarts, session.stats.prefilled
    edited = transcript(400, seed=13) + "\n" + talk  # another long item in place of the first: longer still
    session.set_context(edited)
    drain(session)
    assert session.stats.restarts == before and session.stats.prefilled == prefilled  # nothing run to be dropped
    session.end_answer()
    drain(session)
    assert session.stats.restarts == before + 1
    live = engine.encode(engine.head + edited)
    assert session.source_ids() == live[: engine.sink] + live[max(engine.sink, len(live) - 48):]


def test_a_deferred_restart_keeps_only_the_sinks_that_are_still_the_same() -> None:
    """Sinks past the head hold context: an edit of them during an answer must not survive the restart after it
    (found by a reviewer's random sequences)."""
    engine = LMEngine.load(LMConfig(window_tokens=48, prefill_chunk_tokens=16, sink_tokens=60), device="cpu",
                           dtype="float32")
    assert engine.sink > len(engine.encode(engine.head))
    session = engine.open_session()
    session.set_context(transcript(300, seed=12))
    drain(session)
    session.begin_answer("What?")
    new = "totally different words here now"
    session.set_context(new)
    session.prefill_step()
    session.end_answer()
    drain(session)
    assert session.source_ids() == engine.encode(engine.head + new) and session.stats.restarts == 1
