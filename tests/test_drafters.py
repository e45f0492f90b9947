"""Drafters propose what their method says: n-gram copies, the recycling adjacency walk, a draft model's chain
(kept in sync with what the target accepted), DySpec's tree grown best first, and `make_drafter` maps the config
to them."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from runtime.config import LMConfig
from runtime.errors import ConfigError
from runtime.models.lm.drafter_choice import AutoDrafter, greedy_accepted, make_drafter, matched_path
from runtime.models.lm.drafters import (
    Draft,
    DraftModelDrafter,
    NgramDrafter,
    TokenRecyclingDrafter,
    TrigramDrafter,
    static_tree,
)
from runtime.models.lm.dynamic_tree import DynamicTreeDrafter
from runtime.models.lm.reference_target import RecomputeTarget
from runtime.models.lm.speculative import SpeculativeDecoder


def tiny_lm(vocab: int = 32, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


# -- n-gram lookup -----------------------------------------------------------------------------------------------


def test_ngram_copies_after_the_longest_most_recent_match():
    d = NgramDrafter(n_max=3, max_copy=4)
    ctx = [9, 1, 2, 3, 50, 51, 7, 2, 3, 60, 61, 62, 63, 64, 1, 2]
    # with pending 3 the tail is (1, 2, 3): the trigram (-> 50) beats the more recent bigram (2, 3) (-> 60)
    draft = d.propose(ctx, 3, budget=8)
    assert draft.tokens == [50, 51, 7, 2] and draft.parents == [-1, 0, 1, 2] and draft.q is None  # max_copy 4
    assert d.propose(ctx, 3, budget=2).tokens == [50, 51]  # the depth budget caps the copy
    assert d.propose([*ctx, 7, 2], 3, budget=3).tokens == [60, 61, 62]  # grown context: (7, 2, 3) -> 60
    # unigram 5: of its two earlier occurrences the most recent one (followed by 9) is copied
    assert d.propose([5, 8, 5, 9], 5, budget=3).tokens == [9, 5]  # ...and the pending token after it


def test_ngram_without_a_match_proposes_nothing_and_rebuilds_on_a_new_context():
    d = NgramDrafter(n_max=3, max_copy=10, n_min=2)
    assert d.propose([1, 2, 3, 4], 5, 4).tokens == []
    assert d.propose([1, 2, 3, 4, 5, 6, 4], 5, 4).tokens == [6, 4, 5]  # (4, 5) matched; grown incrementally
    assert d.propose([7, 7, 7, 1], 2, 4).tokens == []  # not an extension: the old index is gone
    assert d.propose([7, 7, 7], 7, 2).tokens == [7, 7]


def test_ngram_copies_from_the_longest_match_not_the_question_that_shares_its_last_words():
    """The answer quotes the transcript, and the question, the most recent text, shares its last words: "Kofi will
    lead the rollout," is followed by "starting" in the transcript and by "and" in the question. Matched on three
    tokens the copy runs on into the question; on the longest match, into the transcript line."""
    kofi, will, lead, the, rollout, comma, starting, with_, who, and_, when = range(10, 21)
    transcript = [kofi, will, lead, the, rollout, comma, starting, with_, the]
    question = [who, will, lead, the, rollout, comma, and_, when]
    answer = [1, kofi, will, lead, the, rollout]
    ctx = [*transcript, 2, *question, 3, *answer]
    assert NgramDrafter(n_max=3).propose(ctx, comma, budget=3).tokens == [and_, when, 3]
    draft = NgramDrafter().propose(ctx, comma, budget=3)
    assert draft.tokens == [starting, with_, the]
    assert draft.kind == 2  # a match of several tokens: a kind of its own for the depth controller
    assert NgramDrafter().propose([*ctx, comma, starting, 4], who, budget=2).kind == 1  # matched on one token


def test_ngram_stops_at_the_end_of_the_line_it_copies():
    """What follows a transcript line is the next line's time stamp and speaker, which no answer quotes: the copy
    ends with the token that ends the line (`line_ends`), however deep it may go."""
    nl = 99
    ctx = [5, 6, 7, 8, nl, 40, 41, 5, 6, 7, 8, nl, 42, 43]
    assert NgramDrafter(line_ends={nl}).propose([*ctx, 1], 6, budget=8).tokens == [7, 8, nl]
    assert NgramDrafter().propose([*ctx, 1], 6, budget=8).tokens == [7, 8, nl, 42, 43, 1, 6]  # the pending too
    assert NgramDrafter(line_ends={nl}).propose([*ctx, 1], 8, budget=8).tokens == [nl]
    assert NgramDrafter(line_ends={nl}).propose([*ctx, 1, 8], nl, budget=8).tokens == [42, 43, 1, 8, nl]


def test_line_end_ids_are_the_tokens_whose_text_holds_a_newline():
    """Read from the token strings (fast), they are the ids whose decoded text holds a newline (slow: each decoded)."""
    from transformers import AutoTokenizer

    from runtime.models.lm.tokenizer import line_end_ids
    from runtime.models.loading import resolve_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint("tiny:qwen2", role="test"))
    decoded = {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}
    assert decoded and line_end_ids(tokenizer) == decoded


# -- token recycling ----------------------------------------------------------------------------------------------


def test_static_tree_shape():
    parent, rank, depth = static_tree((8, 6, 4, 3, 2, 2))
    assert len(parent) == 77 and max(depth) == 6 and depth == sorted(depth)  # BFS order
    assert [depth.count(d) for d in range(1, 7)] == [8, 21, 20, 15, 6, 7]
    assert all(-1 <= p < i for i, p in enumerate(parent))
    siblings = {}
    for i, p in enumerate(parent):
        siblings.setdefault(p, []).append(rank[i])
    assert all(r == list(range(len(r))) for r in siblings.values())  # ranks 0..b-1 under each parent


def test_recycling_adjacency_is_refreshed_from_observed_logits():
    vocab = 50
    d = TokenRecyclingDrafter(vocab)
    assert d.nbytes == vocab * 8 * 4 and d.adjacency.dtype == torch.int32
    assert d.propose([], 3, 6).tokens == []  # cold: nothing seen yet
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    d.observe([3, 10, 3], [-1, 0, 1], logits)
    # token 3 appears twice: the later row wins; 10 gets its own top-8
    assert d.adjacency[3].tolist() == logits[2].topk(8).indices.tolist()
    assert d.adjacency[10].tolist() == logits[1].topk(8).indices.tolist()
    assert bool(d.seen[3]) and bool(d.seen[10]) and int(d.seen.sum()) == 2
    fresh = torch.randn(1, vocab, generator=gen)
    d.observe([10], [-1], fresh)
    assert d.adjacency[10].tolist() == fresh[0].topk(8).indices.tolist()


def test_recycling_walks_the_adjacency_along_the_static_tree():
    vocab = 40
    d = TokenRecyclingDrafter(vocab)
    gen = torch.Generator().manual_seed(1)
    d.observe(list(range(vocab)), [-1] * vocab, torch.randn(vocab, vocab, generator=gen))  # every row warm
    adj = d.adjacency
    draft = d.propose([], 7, budget=6)
    assert len(draft.tokens) == 77 and draft.q is None
    parent, rank, _ = static_tree((8, 6, 4, 3, 2, 2))
    for i, (tok, par) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
        src = 7 if par < 0 else draft.tokens[par]
        assert par == parent[i] and tok == int(adj[src, rank[i]])
    assert len(d.propose([], 7, budget=2).tokens) == 8 + 21  # the budget is a depth
    # a row never observed prunes its subtree
    d.seen[int(adj[7, 0])] = False
    assert len(d.propose([], 7, budget=6).tokens) < 77


def test_recycling_stays_warm_across_answers_and_learns_from_decoding():
    model = tiny_lm()
    drafter = TokenRecyclingDrafter(32)
    for prompt in ([1, 2, 3, 4], [5, 6, 7, 8]):  # two "answers" with one drafter (no reset between)
        target = RecomputeTarget(model, prompt)
        dec = SpeculativeDecoder(target, drafter, max_draft_tokens=6)
        dec.start(target.next_logits(), prompt)
        for _ in range(6):
            dec.step()
    assert int(drafter.seen.sum()) > 4
    seen_before = drafter.seen.clone()
    target = RecomputeTarget(model, [9, 10])
    dec = SpeculativeDecoder(target, drafter, max_draft_tokens=6)
    dec.start(target.next_logits(), [9, 10])
    assert bool((drafter.seen & seen_before).eq(seen_before).all())  # nothing forgotten


# -- draft model ------------------------------------------------------------------------------------------------


def test_draft_model_follows_what_the_target_accepted():
    target_lm, draft_lm = tiny_lm(seed=0), tiny_lm(seed=0)  # a perfect drafter: every draft is accepted
    prompt = [3, 1, 4, 1, 5]
    draft_target = RecomputeTarget(draft_lm, prompt)
    drafter = DraftModelDrafter(draft_target, fed=prompt)
    target = RecomputeTarget(target_lm, prompt)
    dec = SpeculativeDecoder(target, drafter, max_draft_tokens=4, adapt=False)
    dec.start(target.next_logits(), prompt)
    for _ in range(4):
        before = dec.stats.accepted
        dec.step()
        # the draft session committed the context and the root, never a tentative draft; the drafts the target
        # just accepted are fed at the next propose
        assert target.ids[: len(draft_target.ids)] == draft_target.ids
        assert len(target.ids) - len(draft_target.ids) == dec.stats.accepted - before == 4
    with pytest.raises(RuntimeError, match="out of sync"):
        drafter.propose([9, 9, 9, 9, 9, 9], 1, 3)
    with pytest.raises(ValueError):
        DraftModelDrafter(RecomputeTarget(draft_lm, prompt), fed=prompt[:2])


def test_draft_model_reports_q_only_when_sampling():
    model = tiny_lm()
    greedy = DraftModelDrafter(RecomputeTarget(model, [1, 2]), fed=[1, 2]).propose([1, 2], 3, 3)
    assert greedy.q is None and greedy.parents == [-1, 0, 1]
    want = RecomputeTarget(model, [1, 2, 3]).next_logits().argmax()
    assert greedy.tokens[0] == int(want)
    gen = torch.Generator().manual_seed(0)
    sampled = DraftModelDrafter(RecomputeTarget(model, [1, 2]), fed=[1, 2], temperature=0.9, top_p=0.7,
                                generator=gen).propose([1, 2], 3, 3)
    assert sampled.q is not None and len(sampled.q) == 3
    for tok, q in zip(sampled.tokens, sampled.q, strict=True):
        assert q.sum().item() == pytest.approx(1.0) and q[tok] > 0
        assert (q == 0).any()  # top_p 0.7 cut the tail off


# -- DySpec: a dynamic tree ------------------------------------------------------------------------------------


class ShiftTarget:
    """A model-free draft target: after token t it gives t+1, t+2 and t+3 the probabilities `probs`."""

    vocab_size = 24

    def __init__(self, committed: list[int], probs: tuple[float, float, float] = (0.6, 0.3, 0.1)) -> None:
        self.ids, self.forwards, self._tree, self.probs = list(committed), 0, ([], []), probs

    def score(self, tokens, parents) -> torch.Tensor:
        self.forwards += 1
        self._tree = (list(tokens), list(parents))
        rows = torch.full((len(tokens), self.vocab_size), -1e9)
        for i, t in enumerate(tokens):
            for step, p in enumerate(self.probs, start=1):
                rows[i, (t + step) % self.vocab_size] = torch.tensor(p).log()
        return rows

    def commit(self, nodes) -> None:
        self.ids += [self._tree[0][i] for i in nodes]

    def committed_tokens(self) -> int:
        return len(self.ids)


def test_dyspec_grows_the_most_probable_paths_first():
    draft = ShiftTarget([5])
    tree = DynamicTreeDrafter(draft, fed=[5], per_round=2, children=2).propose([5], 0, 3)
    # round 1: 1 (0.6) and 2 (0.3) below the pending 0; round 2: 2 (0.36) and 3 (0.18) below node 0 (1), where 3
    # (0.18) below node 1 (2) ties and was found later; round 3: 3 (0.216) below node 2, then the tie's other half
    assert tree.tokens == [1, 2, 2, 3, 3, 3]
    assert tree.parents == [-1, -1, 0, 0, 2, 1]
    assert tree.q is None  # chosen deterministically
    assert draft.forwards == 3 and draft.ids == [5, 0]  # a forward a level; only the pending token is committed
    one = DynamicTreeDrafter(ShiftTarget([5]), fed=[5], per_round=1, children=2).propose([5], 0, 4)
    assert one.tokens == [1, 2, 2, 3] and one.parents == [-1, 0, -1, 1]  # 0.36, then the root's 0.3 over 0.216
    sure = ShiftTarget([5], probs=(0.9, 0.08, 0.02))
    deep = DynamicTreeDrafter(sure, fed=[5], per_round=1, children=2).propose([5], 0, 4)
    assert deep.tokens == [1, 2, 3, 4] and deep.parents == [-1, 0, 1, 2]  # sure enough to stay a chain
    assert DynamicTreeDrafter(ShiftTarget([5]), fed=[5]).propose([5], 0, 0).tokens == []


def test_dyspec_verified_answers_equal_plain_greedy():
    target_lm, draft_lm = tiny_lm(seed=0), tiny_lm(seed=1)
    prompt = [3, 1, 4, 1, 5]
    want = SpeculativeDecoder(RecomputeTarget(target_lm, prompt), None, adapt=False)
    got = SpeculativeDecoder(RecomputeTarget(target_lm, prompt),
                             DynamicTreeDrafter(RecomputeTarget(draft_lm, prompt), fed=prompt), max_draft_tokens=4)
    outs = []
    for dec in (want, got):
        out = [dec.start(dec.target.next_logits(), prompt)]
        while len(out) < 16:
            out += dec.step(16 - len(out))
        outs.append(out)
    assert outs[0] == outs[1]


# -- auto and the factory --------------------------------------------------------------------------------------


def test_auto_prefers_an_ngram_match_else_recycling():
    d = AutoDrafter(20)
    d.observe([4], [-1], torch.arange(20, dtype=torch.float32)[None])  # row 4: 19, 18, ...
    assert d.propose([1, 4, 6, 7, 2], 4, 3).tokens == [6, 7, 2]  # n-gram copy
    tree = d.propose([1, 2, 3], 4, 1)
    assert tree.tokens == [19, 18, 17, 16, 15, 14, 13, 12]  # recycling candidates after 4


def test_auto_on_a_cpu_falls_back_to_trigram_chains():
    d = AutoDrafter(20, wide_trees=False)
    assert d.propose([1, 4, 6, 7, 2], 4, 3).tokens == [6, 7, 2]  # n-gram copy first
    assert d.propose([8, 2], 4, 4).tokens == []  # no copy, and the tri-gram table knows nothing yet
    d.observe([4, 9], [-1, 0], torch.stack([torch.arange(20.0), torch.arange(20.0).flip(0)]))
    draft = d.propose([8, 2], 4, 4)  # the tri-gram table learned (2, 4) from that tree (its root 4 followed 2)
    assert draft.tokens[:1] == [19] and draft.parents[0] == -1


def test_trigram_keys_a_root_only_when_it_knows_the_token_before_it():
    d = TrigramDrafter(k=2)
    d.propose([1, 2, 3], 4, 3)  # proposes below 4, after 3
    d.observe([9], [-1], torch.arange(12.0)[None])  # a tree it did not propose (a new answer's first token)
    assert (3, 9) not in d.table
    assert d.propose([7, 8, 9], 5, 0) is not None and d.propose([7, 8, 9], 5, 0).tokens == []  # budget 0: none
    d.observe([5, 6], [-1, 0], torch.stack([torch.arange(12.0), torch.arange(12.0).flip(0)]))
    assert d.table[(9, 5)] == [11, 10] and d.table[(5, 6)] == [0, 1]


def test_trigram_follows_context_and_target_predictions():
    d = TrigramDrafter(k=2, width=2)
    ctx = [1, 2, 3, 4, 1, 2, 3, 5]
    assert d.propose(ctx, 1, 3).tokens == []  # (5, 1) never seen
    d2 = TrigramDrafter(k=2, width=2)
    d2.propose([7, 1, 2, 3, 4, 7, 1], 2, 0)  # ingest: (7,1)->2, (1,2)->3, (2,3)->4, (3,4)->7, (4,7)->1
    chain = d2.propose([7, 1, 2, 3, 4, 7, 1], 2, 3)  # pending 2 after (1): (1,2)->3, (2,3)->4, (3,4)->7
    assert chain.tokens == [3, 4, 7] and chain.parents == [-1, 0, 1]
    # the scored tree (root = the pending 2, after context token 1) adapts the table with the target's top-k
    d2.observe([2, 3], [-1, 0], torch.stack([torch.arange(12.0).flip(0), torch.arange(12.0)]))
    assert d2.table[(1, 2)] == [0, 1] and d2.table[(2, 3)] == [11, 10]
    sib = d2.propose([1, 2], 3, 2)  # width 2: the runner-up is a sibling at the first level
    assert sib.tokens == [11, 10] and sib.parents == [-1, -1]


def test_make_drafter_follows_the_config():
    assert make_drafter(LMConfig(drafter="none"), vocab_size=10) is None
    assert isinstance(make_drafter(LMConfig(drafter="ngram"), vocab_size=10), NgramDrafter)
    assert isinstance(make_drafter(LMConfig(drafter="recycling"), vocab_size=10), TokenRecyclingDrafter)
    assert isinstance(make_drafter(LMConfig(drafter="auto"), vocab_size=10), AutoDrafter)
    target = RecomputeTarget(tiny_lm(), [1])
    made = make_drafter(LMConfig(drafter="draft-model", temperature=0.5), vocab_size=32, draft_target=target,
                        draft_fed=[1])
    assert isinstance(made, DraftModelDrafter) and made.temperature == 0.5
    tree = make_drafter(LMConfig(drafter="dyspec"), vocab_size=32, draft_target=RecomputeTarget(tiny_lm(), [1]),
                        draft_fed=[1])
    assert isinstance(tree, DynamicTreeDrafter)
    with pytest.raises(ConfigError):
        make_drafter(LMConfig(drafter="draft-model"), vocab_size=10)
    with pytest.raises(ConfigError):
        make_drafter(LMConfig(drafter="eagle"), vocab_size=10)


def test_greedy_acceptance_of_a_scored_tree():
    logits = torch.zeros(4, 10)
    logits[0, 5] = logits[1, 6] = logits[2, 1] = 1  # after the root 5; after node 1 (5) 6; after node 2 (6) 1
    assert greedy_accepted([9, 5, 6, 7], [-1, 0, 1, 1], logits) == 2  # 5 then 6 accepted; 7 is not the argmax
    assert greedy_accepted([9, 4], [-1, 0], logits) == 0


class Scripted:
    """A candidate that knows the answer (`ANSWER`) and drafts it right, or wrong from a given step on."""

    def __init__(self, right: bool, quiet_after: int | None = None, right_for: int = 200) -> None:
        """`right_for`: the levels of a right draft that are right (the deeper ones are not)."""
        self.right, self.quiet_after, self.right_for, self.asked = right, quiet_after, right_for, 0

    def propose(self, context, pending, budget):
        self.asked += 1
        if self.quiet_after is not None and self.asked > self.quiet_after:
            return Draft([], [])
        at = len(context) + 1
        guess = ANSWER[at : at + min(budget, self.right_for)] if self.right else []
        guess = [*guess, *[99] * (budget - len(guess))]
        return Draft(guess, list(range(-1, len(guess) - 1)))

    def observe(self, tokens, parents, logits):
        pass

    def reset(self):
        pass


ANSWER = list(range(1, 200))


def test_auto_learns_which_candidate_the_target_accepts_from_what_was_decoded():
    """Each candidate's proposals are scored against the tokens decoded after them, chosen or not: a candidate
    whose drafts the answer never follows loses its turn to one whose drafts it does, even from behind."""
    wrong, right = Scripted(right=False), Scripted(right=True)
    auto = AutoDrafter(200, candidates={"wrong": wrong, "right": right})  # "wrong" starts first (optimistic)
    picks = []
    for i in range(1, 40):
        draft = auto.propose(ANSWER[:i], ANSWER[i], 3)
        picks.append("right" if draft.tokens == ANSWER[i + 1 : i + 4] else "wrong")
    assert picks[0] == "wrong" and picks[-10:] == ["right"] * 10
    assert auto.gain["right"] > 2.5 and auto.gain["wrong"] < 0.5
    assert auto.scored["wrong"] > 30 and auto.scored["right"] > 30  # the unchosen one was scored all along


def test_auto_uses_the_next_best_when_the_best_has_nothing_and_forgets_other_contexts():
    copy, table = Scripted(right=True, quiet_after=19), Scripted(right=False)
    auto = AutoDrafter(200, candidates={"copy": copy, "table": table})
    for i in range(1, 20):
        assert auto.propose(ANSWER[:i], ANSWER[i], 3).tokens == ANSWER[i + 1 : i + 4]
    assert auto.propose(ANSWER[:30], ANSWER[30], 3).tokens == [99, 99, 99]  # the copy is quiet: the table's turn
    gain = dict(auto.gain)
    auto.propose([7, 7], 7, 3)  # another answer: the waiting proposals cannot be scored against it
    assert auto.gain == gain and not any(auto._waiting[name] and auto._waiting[name][0].start < 3
                                         for name in auto.candidates)


class Taught(Scripted):
    """A Scripted candidate that counts the trees it is taught (`observe`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.taught = 0

    def observe(self, tokens, parents, logits):
        self.taught += 1


def test_auto_asks_only_the_copy_while_it_earns_and_wakes_the_others_when_it_stops():
    """`wake_below` (a CPU's `auto`): the other candidates cost every step and never win while the copy earns, so
    they are neither asked nor taught until the copy earns less than a token a step (proposing nothing counts 0)."""
    copy, table = Scripted(right=True, quiet_after=30), Taught(right=True, right_for=1)
    auto = AutoDrafter(200, candidates={"copy": copy, "table": table}, wake_below=1.0)
    logits = torch.zeros(1, 200)
    for i in range(1, 31):
        assert auto.propose(ANSWER[:i], ANSWER[i], 3).tokens == ANSWER[i + 1 : i + 4]
        auto.observe([ANSWER[i]], [-1], logits)
    assert table.asked == table.taught == 0 and auto.asked == ["copy"] and auto.lead_rate > 2.0
    woke = next(i for i in range(31, 60) if auto.propose(ANSWER[:i], ANSWER[i], 3).tokens)  # the copy is quiet now
    assert 31 < woke < 50 and auto.asked == ["copy", "table"]  # after some steps of nothing, not at the first
    auto.observe([ANSWER[woke]], [-1], logits)
    assert table.asked == 1 and table.taught == 1 and auto.chosen["table"] == 1


def test_auto_with_a_copy_that_never_earns_wakes_the_others_and_takes_the_better():
    wrong, right = Scripted(right=False), Scripted(right=True)
    auto = AutoDrafter(200, candidates={"wrong": wrong, "right": right}, wake_below=1.0)
    picks = ["right" if auto.propose(ANSWER[:i], ANSWER[i], 3).tokens == ANSWER[i + 1 : i + 4] else "wrong"
             for i in range(1, 40)]
    assert picks[0] == "wrong" and picks[-10:] == ["right"] * 10 and right.asked < wrong.asked


def test_make_drafter_wakes_autos_others_on_demand_on_a_cpu_only():
    cpu = make_drafter(LMConfig(drafter="auto"), vocab_size=10, wide_trees=False)
    gpu = make_drafter(LMConfig(drafter="auto"), vocab_size=10, wide_trees=True)
    assert isinstance(cpu, AutoDrafter) and isinstance(gpu, AutoDrafter)
    assert cpu.asked == ["ngram"] and cpu.wake_below == 1.0
    assert gpu.asked == ["ngram", "trigram", "recycling"] and gpu.wake_below is None


class Kinds:
    """A copy whose drafts of kind 2 are right and of kind 1 wrong, alternating step by step."""

    def propose(self, context, pending, budget):
        at = len(context) + 1
        kind = 1 + at % 2
        guess = ANSWER[at : at + budget] if kind == 2 else [99] * budget
        return Draft(list(guess), list(range(-1, len(guess) - 1)), kind=kind)

    def observe(self, tokens, parents, logits):
        pass


def test_auto_judges_each_kind_of_a_candidates_drafts_apart():
    """The copy's one-token matches are right far less often than its longer ones (`Draft.kind`): `auto` learns each
    kind's worth apart, and takes the table's guess (one token right) where the copy offers only the weaker kind."""
    auto = AutoDrafter(200, candidates={"copy": Kinds(), "table": Scripted(right=True, right_for=1)})
    picks = []
    for i in range(1, 60):
        draft = auto.propose(ANSWER[:i], ANSWER[i], 3)
        picks.append((draft.kind, draft.tokens == ANSWER[i + 1 : i + 4]))
    assert set(picks[-20:]) == {(2, True), (0, False)}  # the copy's kind 2; the table's (one right) for kind 1
    assert auto.kind_gain["copy", 1] < 0.5 < 2.5 < auto.kind_gain["copy", 2]


def test_a_proposal_is_scored_by_the_levels_the_decoded_tokens_follow():
    tree = Draft([5, 6, 7, 8], [-1, 0, 0, 2])  # 5, then 6 or 7, and 8 below 7
    assert matched_path(tree, [5, 7, 8, 1]) == (3, True)  # down to the leaf
    assert matched_path(tree, [5, 9]) == (1, True)  # the tree has no 9 below 5
    assert matched_path(tree, [5, 7]) == (2, False)  # 8 may still come: not decided yet
    assert matched_path(tree, [4]) == (0, True)
    assert matched_path(Draft([], []), []) == (0, True)
