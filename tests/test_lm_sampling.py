"""Token choice and the stop rule (runtime/models/lm/sampling.py), checked against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.models.lm.sampling import (
    Sampler,
    StopRule,
    draw,
    eos_ids,
    greedy_token,
    nucleus_probs,
    repeats_itself,
    sampling_probs,
)


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax (temperature 1) is `probs`."""
    return torch.tensor([math.log(p) for p in probs])


def test_greedy_is_argmax_with_the_first_maximum_on_ties() -> None:
    assert greedy_token(torch.tensor([0.1, 3.0, -2.0, 2.9])) == 1
    assert greedy_token(torch.tensor([1.0, 5.0, 5.0, 5.0])) == 1  # first of the tied maxima, as generate
    assert greedy_token(torch.tensor([7.0, 7.0])) == 0
    sampler = Sampler(temperature=0.0, top_p=0.5)
    assert sampler.greedy and sampler.generator(3) is None
    tied = torch.tensor([0.0, 2.0, 2.0])
    assert sampler.choose(tied, torch.Generator().manual_seed(0)) == 1  # greedy ignores any generator
    assert Sampler(temperature=1.0).choose(tied, None) == 1  # no generator: greedy


def test_top_p_keeps_the_smallest_head_reaching_p() -> None:
    probs = [0.1, 0.4, 0.2, 0.3]  # sorted: 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1)
    logits = logits_of(probs)
    kept = lambda p: (nucleus_probs(logits, 1.0, p) > 0).nonzero().flatten().tolist()  # noqa: E731
    assert kept(0.4) == [1]  # the top token alone reaches 0.4
    assert kept(0.41) == [1, 3]  # just above: the next one is needed
    assert kept(0.7) == [1, 3]  # exactly reached by two (0.4 + 0.3 in float32 rounds to >= 0.7)
    assert kept(0.75) == [1, 2, 3]
    assert kept(0.95) == [0, 1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]  # top_p 1: nothing dropped
    assert kept(1e-9) == [1]  # always at least the most likely token
    head = nucleus_probs(logits, 1.0, 0.75)
    assert head[[1, 2, 3]].tolist() == pytest.approx([0.4, 0.2, 0.3], abs=1e-6)  # kept mass unchanged
    assert head.dtype == torch.float32
    renorm = sampling_probs(logits, 1.0, 0.75)
    assert renorm.dtype == torch.float64 and float(renorm.sum()) == pytest.approx(1.0, abs=1e-12)
    assert renorm.tolist() == pytest.approx([0.0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9], abs=1e-6)


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([1.0, 2.0, 4.0])
    for t in (0.5, 1.0, 2.0):
        want = torch.softmax(logits.double() / t, dim=-1)
        assert sampling_probs(logits, t).tolist() == pytest.approx(want.tolist(), abs=1e-6)
    assert float(sampling_probs(logits, 0.5)[2]) > float(sampling_probs(logits, 1.0)[2]) > \
        float(sampling_probs(logits, 2.0)[2])
    # the nucleus is taken after the temperature: at t=0.25 the top token alone holds more than 0.99
    assert (nucleus_probs(logits, 0.25, 0.99) > 0).tolist() == [False, False, True]
    assert (nucleus_probs(logits, 4.0, 0.99) > 0).tolist() == [True, True, True]


def test_sampling_draws_from_the_nucleus_reproducibly() -> None:
    logits = logits_of([0.05, 0.5, 0.15, 0.3])
    sampler = Sampler(temperature=1.0, top_p=0.8)  # keeps tokens 1 and 3
    gen = sampler.generator(11)
    assert gen is not None
    picks = [sampler.choose(logits, gen) for _ in range(400)]
    assert set(picks) == {1, 3}
    assert 0.5 < picks.count(1) / len(picks) < 0.75  # 0.5 / 0.8 = 0.625
    again = sampler.generator(11)
    assert [sampler.choose(logits, again) for _ in range(400)] == picks  # same seed, same draws
    # plain sampling draws from the float32 nucleus, exactly as multinomial does with that generator
    probs = nucleus_probs(logits, 1.0, 0.8)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [sampler.choose(logits, g1) for _ in range(50)] == [draw(probs, g2) for _ in range(50)]


def test_eos_ids_from_generation_config_and_tokenizer() -> None:
    assert eos_ids(None, None) == frozenset()
    assert eos_ids(7, None) == {7}
    assert eos_ids([7, 9], 2) == {2, 7, 9}
    assert eos_ids((3,), 3) == {3}
    assert eos_ids(None, 4) == {4}


def test_stop_rule_eos_stops_and_max_tokens_is_length() -> None:
    rule = StopRule(frozenset({0, 9}), max_new_tokens=4)
    generated: list[int] = []
    assert rule.take([5, 6], generated) is None and generated == [5, 6]
    assert rule.room(len(generated)) == 2
    assert rule.take([7, 9, 8], generated) == "stop"
    assert generated == [5, 6, 7]  # the eos token is not part of the answer, nor anything after it
    generated = [1, 2]
    assert rule.take([3, 4, 5], generated) == "length"
    assert generated == [1, 2, 3, 4]  # the 4th token ends it; the 5th is dropped
    generated = [1, 2, 3]
    assert rule.take([0], generated) == "stop" and generated == [1, 2, 3]  # eos wins on the last slot too
    assert StopRule(frozenset(), 1).take([0], []) == "length"  # not an eos id: an ordinary token
    assert rule.take([], []) is None


def test_an_answer_that_repeats_itself_stops_there() -> None:
    assert repeats_itself([9, 1, 2, 1, 2, 1, 2])  # a two-token phrase three times
    assert not repeats_itself([9, 1, 2, 1, 2])  # twice is still speech ("at ten, at ten")
    assert repeats_itself([5, 5, 5, 5]) and not repeats_itself([5, 5, 5])  # one token: four times
    sentence = list(range(10, 20))
    assert repeats_itself([1, *sentence, *sentence]) and not repeats_itself([*sentence, *sentence[:-1]])
    assert not repeats_itself(list(range(100)))
    rule = StopRule(frozenset({0}), max_new_tokens=50, stop_repeats=True)
    generated: list[int] = []
    assert rule.take([7, 3, 4, 3, 4, 3, 4, 3, 4], generated) == "stop"
    assert generated == [7, 3, 4, 3, 4, 3, 4]  # it ends at the third saying; what came after is dropped
    assert StopRule(frozenset({0}), 50).take([3, 4] * 5, []) is None  # off unless asked (the profile's lm.stop_repeats)


def test_argmax_rows_is_torch_argmax_with_ties_and_nan():
    """The numpy fast path must pick what torch.argmax picks: the first maximum, and NaN as the maximum."""
    from runtime.models.lm.sampling import argmax_rows

    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 1.0, float("nan"), 0.0], [0.0, 0.0, 0.0, 0.0],
                         [-float("inf"), -1.0, -float("inf"), -1.0]])
    noise = torch.randn(64, 1000)
    noise[:, 500] = noise.max() + 1  # many rows, one clear maximum each
    for logits in (rows, noise, rows.double(), rows.to(torch.bfloat16)):
        assert argmax_rows(logits) == logits.argmax(-1).tolist()
