"""Greedy decoding that checks a draft (transcript_draft.py) against plain greedy decoding of the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.chunks import SAMPLE_RATE
from runtime.config import ASRConfig
from runtime.models.asr.registry import load_asr
from runtime.models.asr.transcript_draft import MAX_GUESS, follow, greedy
from runtime.models.asr.whisper_buffered import WhisperBuffered

CFG = ASRConfig(step_s=0.5, segment_s=2.0, max_new_tokens=24)


def test_follow_continues_the_draft_after_the_longest_matching_tail() -> None:
    draft = [10, 11, 12, 13, 14, 15]
    assert follow([], draft, 0) == 0 and follow([10, 11], draft, 0) == 2
    assert follow([10, 99, 12], draft, 2) == 3  # a changed word: picked up after the next one
    assert follow([10, 11, 12, 13, 14, 15], draft, 0) == 6  # the draft is used up
    assert follow([7], draft, 1) == 1 and follow([10], [], 3) == 3  # no match: where the last guess left off
    # a repeated word: the occurrence nearest to where the transcript stands
    repeated = [1, 2, 3, 1, 2, 4]
    assert follow([9, 9, 9, 1, 2], repeated, 0) == 5
    assert follow([9, 2], repeated, 0) == 2
    # the longest tail wins over a nearer short one
    assert follow([5, 6, 1], [5, 6, 1, 7, 0, 0, 0, 1, 8], 0) == 3


class Table:
    """A fake decoder: the greedy choice after a transcript is `script[len]`, then eos; counts its calls and keeps
    the 'cache' as the list of fed ids, so a rejected draft token left in it derails the rest."""

    def __init__(self, script: list[int], prompt: list[int], eos: int = 0, vocab: int = 50) -> None:
        self.script, self.prompt, self.eos, self.vocab = script, prompt, eos, vocab
        self.fed: list[int] = []
        self.calls = 0

    def score(self, ids: list[int], rows: int) -> torch.Tensor:
        self.calls += 1
        self.fed += ids
        logits = torch.zeros(rows, self.vocab)
        for r in range(rows):
            made = len(self.fed) - rows + r + 1 - len(self.prompt)  # transcript tokens before this row's choice
            right = self.fed[: len(self.prompt) + made] == self.prompt + self.script[:made]
            # after a wrong history (a rejected draft token, or a cache not cut back) any choice: a wrong one
            logits[r, (self.script[made] if made < len(self.script) else self.eos) if right else self.vocab - 1] = 1.0
        return logits

    def drop(self, n: int) -> None:
        del self.fed[-n:]


@pytest.mark.parametrize("draft", [[], [5, 6, 7, 8, 9], [5, 6, 3, 8, 9], [5, 7, 8, 9], [5, 6, 1, 7, 8, 9],
                                   [9, 9, 9], [5, 6, 7, 0, 8], [5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4] * 10])
def test_greedy_with_any_draft_is_plain_greedy(draft: list[int]) -> None:
    script, prompt = [5, 6, 7, 8, 9], [40, 41]
    for max_tokens in (3, 5, 8):
        table = Table(script, prompt)
        out = greedy(table.score, table.drop, prompt, [], eos=0, max_tokens=max_tokens, draft=draft)
        assert out == script[:max_tokens]
        assert table.fed[: len(prompt) + len(out) - 1] == prompt + out[:-1]
    forced = Table(script, prompt)
    assert greedy(forced.score, forced.drop, prompt, [5, 6], eos=0, max_tokens=8, draft=draft) == script


def test_a_right_draft_takes_fewer_calls() -> None:
    prompt = [40]
    script = list(range(1, MAX_GUESS + 1))
    plain, drafted = Table(script, prompt), Table(script, prompt)
    assert greedy(plain.score, plain.drop, prompt, [], eos=0, max_tokens=60) == script
    assert greedy(drafted.score, drafted.drop, prompt, [], eos=0, max_tokens=60, draft=script) == script
    assert (plain.calls, drafted.calls) == (MAX_GUESS + 1, 1)  # the eos comes with the draft's check
    changed = [1, 2, 30, *script[3:]]  # a changed token (no match after it): the draft goes on past it
    redrafted = Table(script, prompt)
    assert greedy(redrafted.score, redrafted.drop, prompt, [], eos=0, max_tokens=60, draft=changed) == script
    assert redrafted.calls == 2
    # a long draft: MAX_GUESS tokens checked a call, and the token after them found by the same call
    long = Table(list(range(1, 41)), prompt)
    assert greedy(long.score, long.drop, prompt, [], eos=0, max_tokens=60, draft=list(range(1, 41))) == long.script
    assert long.calls == -(-41 // (MAX_GUESS + 1))


@pytest.fixture(scope="module")
def whisper() -> WhisperBuffered:
    model = load_asr(CFG, device="cpu", dtype="float32")
    assert isinstance(model, WhisperBuffered)
    return model


def test_drafted_decoding_equals_plain_on_a_whisper_model(whisper: WhisperBuffered) -> None:
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    audio = (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t / 3))).astype(np.float32)
    encoded = whisper.encode(audio)
    plain = whisper.hypothesis_uncached(audio)
    assert len(set(plain)) >= 3  # a varied transcript, or the comparison means little
    changed = [*plain[:3], 7, *plain[4:]]
    for draft in ([], plain, changed, plain[:4] + plain[5:], plain[:2] + [9, 9] + plain[2:], plain[::-1],
                  [whisper.eos_id, *plain], plain * 3):
        assert whisper.decode(encoded, draft=draft) == plain, draft
    assert whisper.decode(encoded, forced=plain[:2], draft=changed) == plain  # forced + draft
