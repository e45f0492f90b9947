"""Speculative decoding is lossless: greedy output equals `generate(do_sample=False)` token for token, sampled
output has exactly the target's distribution (chi-square against the exact joint of two tokens), rejected
branches never reach the target, and the draft depth follows acceptance and cost."""

from __future__ import annotations

import math
import weakref
from collections import Counter

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from runtime.models.lm.drafter_choice import AutoDrafter
from runtime.models.lm.drafters import (
    Draft,
    DraftModelDrafter,
    NgramDrafter,
    TokenRecyclingDrafter,
    chain,
)
from runtime.models.lm.dynamic_tree import DynamicTreeDrafter
from runtime.models.lm.reference_target import CachedHFTarget, RecomputeTarget
from runtime.models.lm.speculative import SpeculativeDecoder

VOCAB = 64
PROMPTS = [
    [5, 17, 33, 2, 41, 8, 60, 12, 9, 27],
    [7, 3, 11, 7, 3, 11, 7, 3, 11, 7, 3],  # repetitive: n-gram lookup has something to copy
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1],
]


def tiny_lm(vocab: int, seed: int, scale: float = 8.0, noise: float = 0.0) -> Qwen2ForCausalLM:
    """A random Qwen2; a scaled-up head makes its distributions peaked (random inits are near uniform), and
    `noise` perturbs a copy of the same seed into a draft model whose q differs from p."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        gen = torch.Generator().manual_seed(seed + 1000)
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def lm() -> Qwen2ForCausalLM:
    return tiny_lm(VOCAB, 0)


@pytest.fixture(scope="module")
def draft_lm() -> Qwen2ForCausalLM:
    return tiny_lm(VOCAB, 0, noise=0.05)


# Each model's logits by token sequence, kept for the module (`RecomputeTarget`'s memo: a model is a pure function of
# the sequence, so a memo changes nothing but speed). A draft model proposing k tokens scores its chain of 1, 2, ...,
# k tokens, a forward a depth each time: without a memo each prefix is computed again at every depth, in every run;
# and the greedy tests' targets score the same prompts' continuations in each of the 16 tests (the greedy tests took
# 24 CPU s without memos, 9 with).
MEMOS: weakref.WeakKeyDictionary[Qwen2ForCausalLM, dict[tuple[int, ...], torch.Tensor]] = weakref.WeakKeyDictionary()


def memo_of(model: Qwen2ForCausalLM) -> dict[tuple[int, ...], torch.Tensor]:
    return MEMOS.setdefault(model, {})


def recompute(model: Qwen2ForCausalLM, prompt: list[int]) -> RecomputeTarget:
    """The slow ground-truth target over the module's memo of the model: a target to verify, or a draft model's own
    (the drafter's view of it)."""
    return RecomputeTarget(model, prompt, memo=memo_of(model))


def plain_greedy(model: Qwen2ForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def decode(dec: SpeculativeDecoder, target, prompt: list[int], n: int, first_logits=None) -> list[int]:
    """Decode n tokens, checking after every step that exactly prompt + emitted[:-1] is committed."""
    out = [dec.start(target.next_logits() if first_logits is None else first_logits, prompt)]
    while len(out) < n and not dec.done:
        new = dec.step(n - len(out))
        assert 1 <= len(new) <= n - len(out)
        out += new
        assert target.committed_tokens() == len(prompt) + len(out) - 1
        assert target.ids == prompt + out[:-1]
    return out


DRAFTERS = {
    "none": lambda lm, dlm, p: None,
    "ngram": lambda lm, dlm, p: NgramDrafter(),
    "recycling": lambda lm, dlm, p: TokenRecyclingDrafter(VOCAB),
    "auto": lambda lm, dlm, p: AutoDrafter(VOCAB),
    "draft-same": lambda lm, dlm, p: DraftModelDrafter(recompute(lm, p), fed=p),
    "draft-perturbed": lambda lm, dlm, p: DraftModelDrafter(recompute(dlm, p), fed=p),
    "dyspec-same": lambda lm, dlm, p: DynamicTreeDrafter(recompute(lm, p), fed=p),
    "dyspec-perturbed": lambda lm, dlm, p: DynamicTreeDrafter(recompute(dlm, p), fed=p),
}


@pytest.mark.parametrize("target_kind", ["recompute", "cached"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_is_token_identical_to_generate(lm, draft_lm, name, target_kind):
    make_target = recompute if target_kind == "recompute" else CachedHFTarget
    n, accepted, steps = 24, 0, 0
    for prompt in PROMPTS:
        want = plain_greedy(lm, prompt, n)
        for adapt in (False, True):
            target = make_target(lm, prompt)
            dec = SpeculativeDecoder(target, DRAFTERS[name](lm, draft_lm, prompt), max_draft_tokens=6, adapt=adapt)
            assert decode(dec, target, prompt, n) == want
            accepted, steps = accepted + dec.stats.accepted, steps + dec.stats.steps
            assert dec.stats.accepted_per_step >= 1.0
            assert dec.stats.emitted == n - 1
    if name == "none":
        assert accepted == 0 and steps == len(PROMPTS) * 2 * (n - 1)
    else:  # the comparison is only meaningful if drafts were accepted (and rejected) along the way
        assert accepted > 0 and steps < len(PROMPTS) * 2 * (n - 1)
    if name == "draft-same":
        assert accepted >= len(PROMPTS) * 2 * (n - 1) * 0.5
    if name == "dyspec-same":  # a tree spends nodes on siblings where the draft is unsure: shallower than a chain
        assert accepted >= len(PROMPTS) * 2 * (n - 1) * 0.3


def test_stop_token_inside_an_accepted_draft_is_not_committed(lm):
    prompt = PROMPTS[0]
    want = plain_greedy(lm, prompt, 12)
    j = next(i for i in range(3, 12) if want[i] not in want[:i])
    target = RecomputeTarget(lm, prompt)
    drafter = DraftModelDrafter(RecomputeTarget(lm, prompt), fed=prompt)
    dec = SpeculativeDecoder(target, drafter, max_draft_tokens=8, adapt=False, stop_ids={want[j]})
    out = [dec.start(target.next_logits(), prompt)]
    out += dec.step()  # one forward accepts all 8 drafts; the stop token is among them
    assert out == want[: j + 1] and dec.done and dec.stats.steps == 1
    assert target.ids == prompt + want[:j]
    with pytest.raises(RuntimeError):
        dec.step()


def test_cached_target_scores_trees_like_recompute(lm):
    prompt = PROMPTS[0]
    slow, fast = RecomputeTarget(lm, prompt), CachedHFTarget(lm, prompt)
    assert torch.allclose(slow.next_logits(), fast.next_logits(), atol=1e-4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        n = int(torch.randint(1, 12, (), generator=gen))
        tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)]
        assert torch.allclose(slow.score(tokens, parents), fast.score(tokens, parents), atol=1e-4)
        leaf = int(torch.randint(0, n, (), generator=gen))
        path = [leaf]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        for t in (slow, fast):
            t.commit(path)
        assert slow.ids == fast.ids and fast.cache.get_seq_length() == len(fast.ids)
    fast.score([1, 2], [-1, 0])
    fast.commit([])  # drops the whole tree
    assert fast.cache.get_seq_length() == len(slow.ids)
    for t in (slow, fast):
        t.score([1, 2], [-1, -1])  # two roots
        with pytest.raises(ValueError):
            t.commit([0, 1])  # 1 is not a child of 0


# -- sampling: exact distribution ----------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x): the regularized upper incomplete gamma Q(df/2, x/2) (series / Lentz continued fraction)."""
    s, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = s * math.log(z) - z - math.lgamma(s)
    if z < s + 1:
        term = total = 1.0 / s
        a = s
        while term > total * 1e-15:
            a += 1
            term *= z / a
            total += term
        return max(0.0, 1.0 - math.exp(log_front) * total)
    b, c, d = z + 1 - s, 1e300, 1.0 / (z + 1 - s)
    h = d
    for i in range(1, 1000):
        an = -i * (i - s)
        b += 2
        d = an * d + b
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def test_chi2_sf_is_exact_where_closed_forms_exist():
    for x in (0.1, 1.0, 3.84, 10.0, 30.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)  # the textbook 5% point


def chi2_pvalue(counts: Counter, probs: dict, n: int) -> float:
    """Pearson chi-square of observed counts against exact cell probabilities; cells expected < 5 are pooled."""
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        exp = n * p
        if exp < 5:
            pool_obs, pool_exp = pool_obs + counts.get(cell, 0), pool_exp + exp
            continue
        stat, df = stat + (counts.get(cell, 0) - exp) ** 2 / exp, df + 1
    if pool_exp > 0:
        stat, df = stat + (pool_obs - pool_exp) ** 2 / max(pool_exp, 1e-9), df + 1
    assert sum(counts.values()) == n and set(counts) <= set(probs)
    return chi2_sf(stat, df)


SV = 8  # small vocabulary: the joint of two tokens has 64 cells
SPROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
FIRST = 3  # the first token is forced, so the joint of the next two tokens is exact and fully speculative


def warped(model, seq: list[int], temperature: float, top_p: float) -> torch.Tensor:
    """The target's next-token distribution as transformers' own warpers define it (independent reference)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq])).logits[:, -1].float()
    ids = torch.tensor([seq])
    logits = TopPLogitsWarper(top_p)(ids, TemperatureLogitsWarper(temperature)(ids, logits))
    return logits.softmax(-1)[0].double()


def exact_joint(model, temperature: float, top_p: float) -> dict:
    p2 = warped(model, SPROMPT + [FIRST], temperature, top_p)
    joint = {}
    for a in range(SV):
        if p2[a] > 0:
            p3 = warped(model, SPROMPT + [FIRST, a], temperature, top_p)
            joint.update({(a, b): float(p2[a] * p3[b]) for b in range(SV) if p3[b] > 0})
    return joint


@pytest.fixture(scope="module")
def small_models():
    models = tiny_lm(SV, 1, scale=3.0), tiny_lm(SV, 1, scale=3.0, noise=0.25)
    for model in models:  # what the samples score: the prompt, the forced token and up to 4 more, in 5 forwards
        prefix = RecomputeTarget(model, SPROMPT + [FIRST], memo=memo_of(model))
        tokens, parents = tree_of_every_sequence(SV, 4)
        prefix.next_logits()
        prefix.score(tokens, parents)
    return models


def tree_of_every_sequence(vocab: int, depth: int) -> tuple[list[int], list[int]]:
    """A draft tree (tokens, parents) holding every sequence of 1 to `depth` tokens of the vocabulary."""
    tokens, parents, level = [], [], [-1]
    for _ in range(depth):
        nxt = []
        for parent in level:
            for token in range(vocab):
                nxt.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
        level = nxt
    return tokens, parents


def sample_pairs(small_models, kind: str, n: int, temperature: float, top_p: float, seed: int = 0) -> Counter:
    target_lm, draft_lm = small_models
    memo, dmemo = memo_of(target_lm), memo_of(draft_lm)  # shared by every test of the module: the same short prefixes
    gen = torch.Generator().manual_seed(seed)
    recycling = TokenRecyclingDrafter(SV)  # shared: it learns across samples, as it does across answers
    first = torch.full((SV,), -1e9)
    first[FIRST] = 0.0
    counts: Counter = Counter()
    for _ in range(n):
        target = RecomputeTarget(target_lm, SPROMPT, memo=memo)
        if kind == "draft-model":
            drafter = DraftModelDrafter(RecomputeTarget(draft_lm, SPROMPT, memo=dmemo), fed=SPROMPT,
                                        temperature=temperature, top_p=top_p, generator=gen)
        elif kind == "dyspec":  # a deterministic tree of the draft's top tokens: q = None at any temperature
            drafter = DynamicTreeDrafter(RecomputeTarget(draft_lm, SPROMPT, memo=dmemo), fed=SPROMPT)
        else:
            drafter = recycling if kind == "recycling" else NgramDrafter()
        dec = SpeculativeDecoder(target, drafter, temperature=temperature, top_p=top_p, max_draft_tokens=3,
                                 generator=gen, adapt=False)
        out = [dec.start(first, SPROMPT)]
        while len(out) < 3:
            out += dec.step()
            assert target.ids == SPROMPT + out[:-1]
        counts[tuple(out[1:3])] += 1
    return counts


@pytest.mark.parametrize(
    ("kind", "temperature", "top_p", "n"),
    [("draft-model", 1.0, 1.0, 4000), ("draft-model", 0.7, 0.8, 3000), ("recycling", 1.0, 1.0, 4000),
     ("ngram", 1.0, 1.0, 3000), ("dyspec", 0.7, 0.8, 3000)],
)
def test_sampled_tokens_follow_the_target_distribution(small_models, kind, temperature, top_p, n):
    counts = sample_pairs(small_models, kind, n, temperature, top_p)
    joint = exact_joint(small_models[0], temperature, top_p)
    assert chi2_pvalue(counts, joint, n) > 1e-3


def accept_first_child(self, p, tokens, kids, qs):
    return kids[0] if kids else None


def forget_the_residual(self, p, tokens, kids, qs):
    before = p.clone()
    child = GOOD_ACCEPT(self, p, tokens, kids, qs)
    if child is None:
        p.copy_(before)  # resample from p instead of norm(max(0, p - q)): the classic bias
    return child


GOOD_ACCEPT = SpeculativeDecoder._accept


@pytest.mark.parametrize(("kind", "bug"), [("recycling", accept_first_child), ("draft-model", forget_the_residual)])
def test_the_chi_square_check_catches_a_biased_verifier(small_models, monkeypatch, kind, bug):
    """The same harness with a broken verifier must fail, so the test above has power."""
    monkeypatch.setattr(SpeculativeDecoder, "_accept", bug)
    counts = sample_pairs(small_models, kind, 1000, 1.0, 1.0)
    assert chi2_pvalue(counts, exact_joint(small_models[0], 1.0, 1.0), 1000) < 1e-6


# -- adaptive draft depth --------------------------------------------------------------------------------------


class CountingTarget:
    """A model-free target whose next token is always (last + 1) mod V: drafts are right or wrong at will."""

    vocab_size = 16

    def __init__(self, prompt: list[int]) -> None:
        self.ids, self._tree = list(prompt), None

    def score(self, tokens, parents):
        self._tree = (list(tokens), list(parents))
        logits = torch.full((len(tokens), self.vocab_size), -10.0)
        logits[torch.arange(len(tokens)), (torch.tensor(tokens) + 1) % self.vocab_size] = 10.0
        return logits

    def commit(self, nodes):
        self.ids += [self._tree[0][n] for n in nodes]

    def committed_tokens(self):
        return len(self.ids)


class PrefixDrafter:
    """Proposes a chain whose first `right` tokens are correct and the rest wrong."""

    def __init__(self, right: int) -> None:
        self.right = right

    def propose(self, context, pending, budget):
        toks = [(pending + i + 1 + (0 if i < self.right else 7)) % 16 for i in range(budget)]
        return Draft(toks, chain(toks))

    def observe(self, tokens, parents, logits):
        pass

    def reset(self):
        pass


class FreePrefixDrafter(PrefixDrafter):
    """`PrefixDrafter` as a table lookup: asked for the deepest tree, cut by the decoder (`Drafter.free`)."""

    free = True


def run_counting(right: int, steps: int = 60, free: bool = False) -> tuple[SpeculativeDecoder, list[int]]:
    target = CountingTarget([0])
    drafter = FreePrefixDrafter(right) if free else PrefixDrafter(right)
    dec = SpeculativeDecoder(target, drafter, max_draft_tokens=8, cost_model=lambda nodes: 1 + 0.1 * nodes)
    dec.start(torch.nn.functional.one_hot(torch.tensor(1), 16).float(), [0])
    ks = []
    for _ in range(steps):
        out = dec.step()
        ks.append(dec.stats.k)
        assert len(out) == min(dec.stats.k, right) + 1  # the bonus token follows every accepted prefix
    assert target.ids == [i % 16 for i in range(len(target.ids))]  # counting, with nothing rejected leaking in
    return dec, ks


@pytest.mark.parametrize("free", [False, True])
def test_draft_depth_grows_with_full_acceptance(free: bool):
    dec, ks = run_counting(right=100, free=free)
    assert ks[-20:] == [8] * 20
    assert dec.stats.accepted_per_step > 7


@pytest.mark.parametrize("free", [False, True])
def test_draft_depth_shrinks_without_acceptance(free: bool):
    dec, ks = run_counting(right=0, free=free)
    assert ks[0] >= 1  # the prior (0.5 per depth) makes drafting worth a try
    assert max(ks[-30:]) <= 1 and ks[-30:].count(0) >= 20  # mostly off, probing depth 1 now and then
    assert dec.stats.depth_acceptance[0] < 0.1


@pytest.mark.parametrize("free", [False, True])
def test_draft_depth_settles_where_acceptance_ends(free: bool):
    _, ks = run_counting(right=3, free=free)
    tail = ks[-30:]
    assert set(tail) <= {3, 4} and tail.count(3) >= 26  # depth 4 is re-probed now and then, rarely


def test_a_plain_step_is_tried_after_a_costly_tree():
    """A first step that drafted deep with a draft model (16 nodes verified in 116 ms, 209 ms of drafting, 3 of 8
    accepted) must not price a plain step at that tree's cost: smaller sizes are priced optimistically until
    measured, and a plain step measured at 37 ms then stays the choice."""
    from runtime.models.lm.draft_depth import DraftController

    ctl = DraftController(8)
    ctl.record_cost(8, 16, 0.116, 0.209)
    ctl.record_acceptance(3, True)
    assert ctl.choose(8) == 0
    ctl.record_cost(0, 0, 0.037, 0.0)
    assert ctl.choose(8) == 0
    assert ctl.step_cost(1) < ctl.step_cost(8)  # priced between what was measured, not at the deep tree's cost


def test_a_streams_next_answer_starts_from_the_costs_its_last_one_measured():
    """An answer's first drafted step is priced with what the stream's earlier answers measured (`StepCosts`): a
    nine-node tree measured at 2.3 times a plain step is not the first step's choice; with nothing measured the
    prior's 0.5 acceptance a level makes every depth look free, and the first step drafts at full depth."""
    from runtime.models.lm.draft_depth import DraftController, StepCosts

    assert DraftController(8).choose(8) == 8
    costs = StepCosts()
    first = DraftController(8, costs=costs)
    for k, nodes, seconds in ((0, 0, 0.060), (8, 8, 0.140), (2, 2, 0.068)):
        first.record_cost(k, nodes, seconds, 0.0)
    nxt = DraftController(8, costs=costs)
    assert nxt.alphas() == DraftController(8).alphas()  # nothing was drafted: the prior's acceptances still
    assert 1 <= nxt.choose(8) < 8


def test_acceptance_is_counted_apart_after_a_full_acceptance_and_after_a_rejection():
    """Acceptance comes in runs: a copy followed to its end is likely to go on fitting, one rejected is likely to
    be followed by more rejections. Three fully accepted six-token chains, then five rejections, ten times over:
    after a rejection the first level is accepted about one time in five (a plain step pays, at these prices),
    after a full acceptance two in three (a deep chain pays)."""
    from runtime.models.lm.draft_depth import DraftController

    ctl = DraftController(8, cost_model=lambda rows: 1 + 0.3 * rows)
    for _ in range(10):
        for _ in range(3):
            ctl.record_acceptance(6, False)
        for _ in range(5):
            ctl.record_acceptance(0, True)
    assert ctl.state == 0 and ctl.alphas()[0] < 0.3
    assert ctl.choose_cut(list(range(9))) == 0
    ctl.record_acceptance(6, False)
    assert ctl.state == 1 and ctl.alphas()[0] > 0.6
    assert ctl.choose_cut(list(range(9))) >= 5


def test_acceptance_is_counted_apart_per_kind_of_draft_and_shared_by_an_answerers_answers():
    """A copy matched on one token is right about one time in four, one matched on several most of the time
    (`Draft.kind`): counted together, the one-token copies would hold the others to shallow trees; apart, each kind is
    priced by its own rate. The counts are the answerer's (`Acceptance`): the next answer starts from them."""
    from runtime.models.lm.draft_depth import Acceptance, DraftController

    shared = Acceptance()
    ctl = DraftController(8, cost_model=lambda rows: 1 + 0.5 * rows, acceptance=shared)
    offered = list(range(9))
    for _ in range(10):
        for kind, accepted in ((1, 0), (1, 0), (1, 0), (2, 6), (1, 1), (2, 5)):
            ctl.choose_cut(offered, kind)
            ctl.record_acceptance(accepted, True)
            ctl.state = 0  # the kinds alone, in the state after a rejection
    assert ctl.choose_cut(offered, 1) == 0
    assert ctl.choose_cut(offered, 2) >= 4
    together = DraftController(8, cost_model=lambda rows: 1 + 0.5 * rows)
    for _ in range(10):
        for accepted in (0, 0, 0, 6, 1, 5):
            together.choose_cut(offered)
            together.record_acceptance(accepted, True)
            together.state = 0
    assert together.choose_cut(offered) <= 2  # one count for both: the long copies are cut short
    nxt = DraftController(8, cost_model=lambda rows: 1 + 0.5 * rows, acceptance=shared)
    assert nxt.choose_cut(offered, 1) == 0 and nxt.choose_cut(offered, 2) >= 4
    assert DraftController(8, cost_model=lambda rows: 1 + 0.5 * rows).choose_cut(offered, 2) >= 1  # the prior


def test_a_proposed_tree_is_cut_where_its_real_size_pays():
    """A copy drafter offers nothing at most steps and a full chain at the rest. Priced before proposing, depth 8
    looks cheap (about no node offered on average) and the rare chain is scored whole at the prior's acceptance,
    eight rows for about two tokens; cut after proposing, at its real size, the chain is scored to a shallow depth."""
    from runtime.models.lm.draft_depth import DraftController

    ctl = DraftController(8)
    for _ in range(10):
        for k, nodes in ((8, 0), (8, 0), (8, 0), (2, 2), (4, 4)):
            ctl.record_cost(k, nodes, 0.030 + 0.005 * (nodes + 1), 0.0)
    assert ctl.choose(8) == 8  # the average proposal at depth 8 is under one node
    assert 1 <= ctl.choose_cut(list(range(9))) <= 3  # eight nodes offered: scored to a depth that pays
    assert ctl.choose_cut([0]) == 0  # nothing offered: a plain step


def test_top_k_ids_are_torch_topk_s():
    from runtime.models.lm.sampling import top_k_ids

    gen = torch.Generator().manual_seed(0)
    for vocab, rows, k in ((151_936, 4, 4), (49_152, 1, 2), (50_001, 3, 4), (300, 2, 4)):
        logits = torch.randn(rows, vocab, generator=gen)
        logits[0, vocab - 1] = 9.0  # in the last, partial block where there is one
        got = top_k_ids(logits, k)
        assert got.shape == (rows, k) and torch.equal(got, logits.topk(k, dim=-1).indices)
    assert torch.equal(top_k_ids(logits[0], 3), logits[0].topk(3).indices[None])


def test_fixed_depth_without_adaptation():
    target = CountingTarget([0])
    dec = SpeculativeDecoder(target, PrefixDrafter(0), max_draft_tokens=5, adapt=False)
    dec.start(torch.zeros(16), [0])
    for _ in range(5):
        dec.step()
        assert dec.stats.k == 5
    assert dec.step(max_tokens=2) and dec.stats.k == 1  # a length limit caps the depth


def test_a_shared_forward_is_priced_by_all_its_rows():
    """A tree scored in one forward with other answers' trees (`rows` given) records the forward's time under the
    forward's size, not under the tree's own: two five-node trees that took 0.140 s together do not make a
    five-node tree look like it costs 0.140 s alone."""
    from runtime.models.lm.draft_depth import DraftController

    ctl = DraftController(8)
    ctl.record_cost(4, 4, 0.140, 0.0, rows=10)
    assert ctl.verify_cost == {10: 0.140} and ctl.nodes == {4: 4}
    ctl.record_cost(4, 4, 0.070, 0.0)
    assert ctl.verify_cost == {10: 0.140, 5: 0.070}


def test_a_size_measured_in_a_slow_moment_is_not_priced_by_it_for_ever():
    """Verification times on a CPU lie near a line in the rows scored (here 30 ms plus 5 ms a row). One four-row
    tree met a slow moment (90 ms) and was not drafted again: priced by its own measurement it would stay at 90 ms
    and keep the depth from it; fitted to every size's measurements since, it is priced near the line."""
    from runtime.models.lm.draft_depth import DraftController

    ctl = DraftController(8)
    ctl.record_cost(3, 3, 0.090, 0.0)  # 4 rows, in a slow moment
    for _ in range(30):
        for k in (0, 1, 2, 5):
            ctl.record_cost(k, k, 0.030 + 0.005 * k, 0.0)
    assert ctl.verify_cost[4] == 0.090  # the per-size table never saw four rows again
    assert abs(ctl.step_cost(3) - 0.045) < 0.002
    assert ctl.step_cost(1) < ctl.step_cost(2) < ctl.step_cost(3) < ctl.step_cost(5)


def test_the_cost_line_waits_for_two_sizes_and_never_slopes_down():
    from runtime.models.lm.draft_depth import CostLine

    line = CostLine()
    assert line.price(3) is None
    for _ in range(5):
        line.add(4, 0.050)
    assert line.price(3) is None  # one size: no slope yet (the per-size prices and their optimism decide)
    line.add(1, 0.060)  # a plain step slower than the trees (a noisy moment)
    assert line.price(1) == line.price(8)  # flat, not cheaper with more rows
