"""Beam search (`whisper_beam.py`) on decoders whose next-token log probabilities come from a table indexed by the
last token, so every score is known in advance and the search's choices can be followed by hand."""

import math

import numpy as np
import pytest
import torch

from runtime.models.asr.whisper_beam import beam_search

EOS, A, B, C = 0, 1, 2, 3
NEG = float("-inf")


class TableDecoder:
    """Next-token log probabilities depend only on the last token: `table[last]`; counts the rows it decodes."""

    def __init__(self, table: dict[int, list[float]]) -> None:
        self.table = {k: torch.tensor(v, dtype=torch.float32) for k, v in table.items()}
        self.rows = 0
        self.batches: list[int] = []  # rows per decoder call

    def start(self, prefix):
        self.rows += 1
        self.batches.append(1)
        return self.table[prefix[-1]][None]

    def extend(self, sources, tokens):
        assert len(sources) == len(tokens)
        self.rows += len(tokens)
        self.batches.append(len(tokens))
        return torch.stack([self.table[int(t)] for t in tokens])


def log(*p: float) -> list[float]:
    return [math.log(x) if x > 0 else NEG for x in p]


# After the prompt (9): a .5, b .4, c .1. Greedy takes a, then c (.4 beats end-of-text's .3), then ends (.6): "a c",
# log(.5 .4 .6) / 2 = -1.06 per token. "b" then end-of-text scores log(.4 .9) / 1 = -1.02: better, and beams find it.
STORY = {
    9: log(0, 0.5, 0.4, 0.1),
    A: log(0.3, 0.2, 0.1, 0.4),
    B: log(0.9, 0, 0, 0.1),
    C: log(0.6, 0.4, 0, 0),
}


def greedy(table: dict[int, list[float]], prefix: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    last = prefix[-1]
    while len(out) < max_tokens:
        token = int(np.argmax(table[last]))
        if token == EOS:
            break
        out.append(token)
        last = token
    return out


def test_beams_find_the_sentence_greedy_decoding_misses() -> None:
    assert greedy(STORY, [9], 10) == [A, C]
    assert beam_search(TableDecoder(STORY), [9], beams=1, eos=EOS, max_tokens=10) == [A, C]
    assert beam_search(TableDecoder(STORY), [9], beams=2, eos=EOS, max_tokens=10) == [B]


def test_hypotheses_are_ranked_per_token_not_by_their_sum() -> None:
    # "a" then end-of-text sums log(.5 .45) = -1.49; "b c" then end-of-text log(.45 .9 .55) = -1.50, which is -0.75
    # per token: the longer sentence wins, as openai-whisper ranks them
    table = {9: log(0, 0.5, 0.45, 0.05), A: log(0.45, 0.2, 0.2, 0.15), B: log(0.1, 0, 0, 0.9), C: log(0.55, 0.45, 0, 0)}
    assert beam_search(TableDecoder(table), [9], beams=2, eos=EOS, max_tokens=10) == [B, C]


def test_the_length_a_hypothesis_is_ranked_by_leaves_out_its_end_of_text() -> None:
    # "a" + end sums -1.00, "b c" + end -1.90: per token -1.00 against -0.95, so "b c" wins; counting the end-of-text
    # in the length (-0.50 against -0.63) would pick "a"
    table = {9: log(0, 0.55, 0.45, 0), A: log(0.669, 0.2, 0.131, 0), B: log(0.05, 0, 0, 0.95),
             C: log(0.35, 0.65, 0, 0)}
    assert beam_search(TableDecoder(table), [9], beams=2, eos=EOS, max_tokens=10) == [B, C]


def test_each_beam_proposes_one_candidate_more_than_there_are_beams() -> None:
    # end-of-text is the likeliest first token: with beams + 1 = 3 candidates, two live beams are still kept
    decoder = TableDecoder({9: log(0.5, 0.3, 0.2, 0), A: log(0.9, 0.1, 0, 0), B: log(0.9, 0, 0.1, 0)})
    assert beam_search(decoder, [9], beams=2, eos=EOS, max_tokens=10) == []
    assert decoder.batches == [1, 2]


def test_the_search_stops_once_as_many_hypotheses_as_beams_have_finished() -> None:
    # step 1 keeps a and b; step 2 finishes "b" and "a" (its end-of-text comes before the second live beam is
    # kept): two finished hypotheses for two beams, so no third decoder call
    decoder = TableDecoder(STORY)
    beam_search(decoder, [9], beams=2, eos=EOS, max_tokens=10)
    assert decoder.rows == 1 + 2


@pytest.mark.parametrize("seed", range(20))
def test_one_beam_is_greedy_decoding(seed: int) -> None:
    rng = np.random.default_rng(seed)
    table = {k: torch.log_softmax(torch.tensor(rng.normal(0, 2, 6)), -1).tolist() for k in range(6)}
    table[9] = table[1]
    assert beam_search(TableDecoder(table), [9], beams=1, eos=EOS, max_tokens=12) == greedy(table, [9], 12)


def test_at_the_token_limit_the_live_beams_count_as_finished() -> None:
    never_ends = {9: log(0.01, 0.5, 0.49, 0), A: log(0.01, 0.5, 0.49, 0), B: log(0.01, 0.49, 0.5, 0)}
    out = beam_search(TableDecoder(never_ends), [9], beams=3, eos=EOS, max_tokens=4)
    assert len(out) == 4 and out[0] == A


def test_every_token_suppressed_but_the_end_gives_an_empty_transcript() -> None:
    silent = {9: log(1, 0, 0, 0)}
    assert beam_search(TableDecoder(silent), [9], beams=5, eos=EOS, max_tokens=10) == []
    assert beam_search(TableDecoder(STORY), [9], beams=5, eos=EOS, max_tokens=0) == []
    with pytest.raises(ValueError, match="beams"):
        beam_search(TableDecoder(STORY), [9], beams=0, eos=EOS, max_tokens=10)
