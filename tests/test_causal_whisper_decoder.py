"""Causal streaming Whisper, decoder side: incremental cross-attention, the look-back rule, resets, and the
exactness requirement (streaming over any chunking == the cache-free offline reference)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr import TranscriptUpdate
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.carry import plan_reset
from runtime.models.asr.causal_whisper.decoder import IncrementalDecoder, RecomputeDecoder, context_ids
from runtime.models.asr.causal_whisper.emission import ItemDecoder, Token, argmax, keep_count, loops
from runtime.models.asr.causal_whisper.reference import offline_transcript
from runtime.models.asr.causal_whisper.stream import CausalWhisperStream


def load(**kw) -> CausalWhisperASR:
    return CausalWhisperASR.load(ASRConfig(**kw), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def asr40() -> CausalWhisperASR:
    """Blocks of 2 encoder frames; 3 s resets, a token budget that the random model spends first."""
    return load(chunk_ms=40, reset_s=3.0, max_new_tokens=40)


@pytest.fixture(scope="module")
def asr40_refresh() -> CausalWhisperASR:
    """asr40, and a block that stops on eos or a loop re-feeds positions fed 200 ms or more before."""
    return load(chunk_ms=40, reset_s=3.0, max_new_tokens=40, refresh_ms=200)


@pytest.fixture(scope="module")
def asr300() -> CausalWhisperASR:
    """Blocks of 15 encoder frames; the 3 s time limit triggers the resets. The random model loops at once, so
    the loop rule is off here (asr40 keeps it on) for transcripts long enough to cross resets."""
    return load(chunk_ms=300, reset_s=3.0, max_new_tokens=60, loop_repeats=0)


def make_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """A rising tone in noise: the random model's output depends on it."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t / 5)) + 0.05 * noise).astype(np.float32)


def chunk_sizes(total: int, kind: str) -> list[int]:
    if kind == "whole":
        return [total]
    if kind == "one-sample":
        return [1] * total
    if kind == "big":  # 0.7 s: several blocks per chunk
        return [11_200] * (total // 11_200) + ([total % 11_200] if total % 11_200 else [])
    rng = np.random.default_rng(7)
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(int(rng.integers(1, 5_000)), total - sum(sizes)))
    return sizes


def run_stream(stream: CausalWhisperStream, audio: np.ndarray, sizes: Sequence[int]) -> list[TranscriptUpdate]:
    updates, pos = [], 0
    for size in sizes:
        updates += stream.accept(AudioChunk(audio[pos : pos + size], pos))
        pos += size
    return updates + stream.finish()


def check_structure(updates: list[TranscriptUpdate]) -> str:
    """Each item: its deltas concatenate to its transcript, it completes once, times never go back."""
    done = [u for u in updates if u.completed]
    assert len({u.item_id for u in done}) == len(done)
    for item in done:
        mine = [u for u in updates if u.item_id == item.item_id]
        assert mine[-1] is item and sum(u.completed for u in mine) == 1
        assert "".join(u.delta for u in mine) == item.transcript
        assert all(u.start <= u.end for u in mine)
    ends = [u.end for u in updates]
    assert ends == sorted(ends)
    return "".join(u.transcript for u in done)


def test_prompt_and_previous_text(asr40: CausalWhisperASR) -> None:
    vocab = asr40.tokenizer.get_vocab()
    sot = [vocab[t] for t in ("<|startoftranscript|>", "<|notimestamps|>")]  # English-only (tiny vocabulary)
    assert asr40.sot == sot
    # The tiny vocabulary has no <|startofprev|>: previous text follows the SOT sequence as a forced prefix.
    assert context_ids(asr40.tokenizer, sot, [7, 8]) == [*sot, 7, 8]
    assert context_ids(asr40.tokenizer, sot, []) == sot

    class WithPrev:
        def get_vocab(self) -> dict[str, int]:
            return {**vocab, "<|startofprev|>": 999}

    assert context_ids(WithPrev(), sot, [7, 8]) == [999, 7, 8, *sot]  # type: ignore[arg-type]


def test_decoder_matches_whisper_and_cache_free_reference(asr40: CausalWhisperASR) -> None:
    model = asr40.model
    enc = torch.randn(30, model.config.d_model, generator=torch.Generator().manual_seed(0))
    ids = [*asr40.sot, 20, 30, 40, 50, 60, 70][:8]  # 8 ids whatever the prompt's length
    with torch.no_grad():
        hidden = model.model.decoder(input_ids=torch.tensor([ids]), encoder_hidden_states=enc[None]).last_hidden_state
        whisper = model.proj_out(hidden)[0].log_softmax(-1)
    full = RecomputeDecoder(model)
    full.add_frames(enc)
    torch.testing.assert_close(full.feed(ids), whisper, atol=1e-4, rtol=0)

    # Per-position frames: positions fed before frames 10..29 arrive keep their keys; roll back and re-feed.
    inc, ref = IncrementalDecoder(model), RecomputeDecoder(model)
    for frames, feed, cut in ((enc[:10], ids[:5], None), (enc[10:24], ids[5:7], 4), (enc[24:], [9, 9, 9], None)):
        outs = []
        for d in (inc, ref):
            if cut is not None:
                d.truncate(cut)
            d.add_frames(frames)
            outs.append(d.feed(feed))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
        assert inc.length == ref.length and inc.n_frames == ref.n_frames
    assert inc.length == 9
    # Frames matter: the same ids fed with all 30 frames from the start give other distributions.
    at_once = RecomputeDecoder(model)
    at_once.add_frames(enc)
    assert not torch.allclose(outs[0], at_once.feed([*ids[:4], *ids[5:7], 9, 9, 9])[-3:], atol=1e-3)


def test_cross_attention_projects_each_frame_once(asr40: CausalWhisperASR) -> None:
    rows: list[int] = []
    layers = asr40.model.model.decoder.layers
    hooks = [layer.encoder_attn.k_proj.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
             for layer in layers]
    try:
        stream = asr40.open_stream()
        audio = make_audio(0.6)  # one segment: no reset re-feeds audio
        updates = run_stream(stream, audio, chunk_sizes(len(audio), "ragged"))
    finally:
        for h in hooks:
            h.remove()
    assert sum(u.completed for u in updates) == 1
    frames = -(-len(audio) // 320)  # every encoder frame of the stream
    assert sum(rows) == frames * len(layers)
    assert len(rows) >= 10 * len(layers)  # block by block, not once at the end


def logprobs(rows: list[dict[int, float]], vocab: int = 6) -> torch.Tensor:
    """Log-probs [n, vocab] with the given probabilities; the rest of the mass spread evenly."""
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        rest = (1 - sum(row.values())) / (vocab - len(row))
        out[i] = torch.tensor([row.get(t, rest) for t in range(vocab)])
    return out.log()


def test_lookback_rule_keeps_and_cuts() -> None:
    # token 1's probability rose; token 2's fell from 0.5 to 0.4 but it is still the argmax: both stay
    assert keep_count([1, 2], [0.3, 0.5], logprobs([{1: 0.35}, {2: 0.4, 3: 0.3}])) == 2
    # token 2 fell and is no longer the argmax: cut there
    assert keep_count([1, 2], [0.3, 0.5], logprobs([{1: 0.35}, {2: 0.3, 3: 0.4}])) == 1
    # a cut token takes everything after it, even a token that would pass on its own
    assert keep_count([1, 2], [0.6, 0.1], logprobs([{1: 0.3, 4: 0.5}, {2: 0.9}])) == 0
    # a probability that rose stays even when another token is more likely; nothing to check keeps nothing
    assert keep_count([5], [0.19], logprobs([{5: 0.2, 0: 0.5}])) == 1
    assert keep_count([5], [0.21], logprobs([{5: 0.2, 0: 0.5}])) == 0
    assert keep_count([], [], logprobs([{}])) == 0


class ScriptedScorer:
    """A fake decoder: the distribution at a position depends on the frames and the token before it."""

    def __init__(self, script) -> None:
        self.script, self.ids, self.n_frames, self.truncated = script, [], 0, []

    @property
    def length(self) -> int:
        return len(self.ids)

    def add_frames(self, frames: torch.Tensor) -> None:
        self.n_frames += frames.shape[0]

    def feed(self, ids: Sequence[int], last: int | None = None) -> torch.Tensor:
        self.ids += list(ids)
        return torch.stack([logprobs([self.script(self.n_frames, i)])[0] for i in ids])[-(last or len(ids)) :]

    def truncate(self, length: int) -> None:
        self.truncated.append(length)
        del self.ids[length:]


def test_item_decoder_cuts_rolls_back_and_stabilises() -> None:
    # Vocabulary 0..5, eos = 0, context [5]. With 2 frames: 5 -> 1 -> 2 -> eos. With 4 frames the token after
    # 1 becomes 3 (2 loses its probability and the argmax), then 3 -> 4 -> eos.
    def script(frames: int, prev: int) -> dict[int, float]:
        early = frames < 4
        table = {5: {1: 0.9} if early else {1: 0.95}, 1: {2: 0.8} if early else {2: 0.1, 3: 0.8},
                 2: {0: 0.9}, 3: {4: 0.7}, 4: {0: 0.9}}
        return table[prev]

    scorer = ScriptedScorer(script)
    item = ItemDecoder(scorer, [5], eos_id=0, lookback=2, max_tokens=10, block_tokens=5, frame0=100)
    item.step(torch.zeros(2, 1))
    assert [t.id for t in item.tokens] == [1, 2] and item.stable == 0
    assert [t.frame for t in item.tokens] == [102, 102]
    assert math.isclose(item.tokens[1].prob, 0.8, rel_tol=1e-6)
    item.step(torch.zeros(2, 1))
    assert [t.id for t in item.tokens] == [1, 3, 4] and item.stable == 1
    assert math.isclose(item.tokens[0].prob, 0.95, rel_tol=1e-6)  # re-checked: its new probability counts
    assert scorer.truncated[-1] == 2  # rolled back to context + kept token 1 before decoding 3
    assert scorer.ids == [5, 1, 3, 4]  # the cache holds exactly the context and the new tokens
    item.step(torch.zeros(1, 1), final=True)
    assert [t.id for t in item.tokens] == [1, 3, 4] and item.stable == 3


def test_loops_are_phrases_said_three_times_running() -> None:
    assert loops([5, 6, 5, 6, 5], 6)  # "3. 3. 3." : a 2-token phrase the third time
    assert not loops([5, 6, 5, 6], 5) and not loops([9, 6, 5, 6], 5)
    assert loops([7, 7, 7], 7) and not loops([7, 7], 7)  # one token: the fourth time ("very very very" stays)
    assert loops([9, 1, 2, 3, 1, 2, 3, 1, 2], 3) and not loops([9, 1, 2, 3, 1, 2, 3, 1, 2], 4)
    six = [1, 2, 3, 4, 5, 6]
    assert loops([*six, *six, *six[:5]], 6) and not loops([9, *six, 8, *six[:5]], 6)
    long = list(range(1, 17))  # the longest phrase looked for (the runaway one in the model card: 11 tokens)
    assert loops([*long, *long, *long[:15]], 16) and not loops([9, *long, 8, *long[:15]], 16)
    assert not loops([*long, *long, *long[:15]], 16, longest=15)
    seventeen = list(range(1, 18))
    assert not loops([*seventeen, *seventeen, *seventeen[:16]], 17)  # longer phrases are not looked for
    assert not loops([], 3)
    assert not loops([7, 7, 7, 7, 7], 7, repeats=0) and loops([5, 6, 5], 6, repeats=2)


def test_a_loop_ends_what_the_block_says() -> None:
    # The model would say 1 2 1 2 1 2 ... forever: the rule stops before the third "1 2", the block ends there,
    # and the final step ends too (eos never comes).
    scorer = ScriptedScorer(lambda frames, prev: {5: {1: 0.9}, 1: {2: 0.9}, 2: {1: 0.9}}[prev])
    item = ItemDecoder(scorer, [5], eos_id=0, lookback=2, max_tokens=40, block_tokens=10, frame0=0, loop_repeats=3)
    item.step(torch.zeros(2, 1))
    assert [t.id for t in item.tokens] == [1, 2, 1, 2, 1]
    item.step(torch.zeros(2, 1), final=True)
    assert [t.id for t in item.tokens] == [1, 2, 1, 2, 1] and item.stable == 5


def test_argmax_is_torchs_first_largest() -> None:
    rows = torch.randn(200, 51864).log_softmax(-1)
    assert [argmax(r) for r in rows] == rows.argmax(-1).tolist()
    rows[:, [7, 500, 51863]] = 0.0  # ties: the first wins, as in torch
    assert [argmax(r) for r in rows] == [7] * 200 == rows.argmax(-1).tolist()
    assert argmax(torch.tensor([1.0, 3.0, 3.0], dtype=torch.float64)) == 1  # other dtypes take torch's own


def test_suppressed_tokens_are_never_said() -> None:
    # The model's first choice after 5 is 3 (a suppressed "[BLANK_AUDIO]"-like token), then 1; after 1, eos.
    scorer = ScriptedScorer(lambda frames, prev: {5: {3: 0.6, 1: 0.3}, 1: {0: 0.9}}[prev])
    item = ItemDecoder(scorer, [5], eos_id=0, lookback=2, max_tokens=10, block_tokens=5, frame0=0, suppress=[3])
    item.step(torch.zeros(2, 1), final=True)
    assert [t.id for t in item.tokens] == [1]
    assert math.isclose(item.tokens[0].prob, 0.3, rel_tol=1e-6)  # its own probability, not renormalised
    free = ItemDecoder(ScriptedScorer(lambda frames, prev: {5: {3: 0.6, 1: 0.3}, 3: {0: 0.9}}[prev]), [5], eos_id=0,
                       lookback=2, max_tokens=10, block_tokens=5, frame0=0)
    free.step(torch.zeros(2, 1), final=True)
    assert [t.id for t in free.tokens] == [3]


class StaleScorer(ScriptedScorer):
    """A fake decoder whose next token depends on the frames the oldest position was fed with, as a real one's
    prefix fed early says "the sentence is over": eos after 1 while position 0 was fed with under 6 frames."""

    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[int] = []
        self.from_start = 0  # feeds from position 0

    def feed(self, ids: Sequence[int], last: int | None = None) -> torch.Tensor:
        self.from_start += not self.ids
        self.ids += list(ids)
        self.seen += [self.n_frames] * len(ids)
        fresh = self.seen[0] >= 6
        table = {5: {1: 0.9}, 1: {2: 0.8} if fresh else {0: 0.8, 2: 0.1}, 2: {0: 0.9}}
        return logprobs([table[i] for i in ids])[-(last or len(ids)) :]

    def truncate(self, length: int) -> None:
        super().truncate(length)
        del self.seen[length:]

    def drop_frames(self, n_frames: int) -> None:
        self.n_frames = min(self.n_frames, n_frames)


@pytest.mark.parametrize("refresh", [0, 4])
def test_a_stopped_block_refeeds_stale_positions(refresh: int) -> None:
    scorer = StaleScorer()
    item = ItemDecoder(scorer, [5], eos_id=0, lookback=0, max_tokens=10, block_tokens=5, frame0=0, refresh=refresh)
    item.step(torch.zeros(2, 1))  # position 0 fed with 2 frames: 5 -> 1 -> eos
    assert [t.id for t in item.tokens] == [1] and item.stable == 1 and scorer.from_start == 1
    item.step(torch.zeros(2, 1))  # 4 frames, fed 2 frames ago: too soon to re-feed
    assert [t.id for t in item.tokens] == [1] and scorer.from_start == 1
    assert item.preview(torch.zeros(2, 1)) == [1]  # a preview never re-feeds (it could not take it back)
    item.step(torch.zeros(2, 1))  # 6 frames, fed 4 ago: re-fed from position 0, and 1 -> 2 follows
    assert [t.id for t in item.tokens] == ([1, 2] if refresh else [1])
    assert scorer.from_start == (2 if refresh else 1)
    assert scorer.seen == [6] * len(scorer.ids) if refresh else scorer.seen[0] == 2
    item.step(torch.zeros(2, 1))  # stops on eos again, but every position was fed 2 frames ago
    assert scorer.from_start == (2 if refresh else 1)
    item.step(torch.zeros(2, 1), final=True)  # the final step stops on eos 4 frames after the re-feed: again
    assert scorer.from_start == (3 if refresh else 1) and item.stable == len(item.tokens)


def test_a_block_that_stops_on_its_budget_is_not_refed() -> None:
    # 1 2 3 4 1 2 ... never eos: each block ends on its budget of one token, however stale the prefix
    table = {5: {1: 0.9}, 1: {2: 0.9}, 2: {3: 0.9}, 3: {4: 0.9}, 4: {1: 0.9}}
    scorer = ScriptedScorer(lambda frames, prev: table[prev])
    item = ItemDecoder(scorer, [5], eos_id=0, lookback=0, max_tokens=10, block_tokens=1, frame0=0, refresh=2)
    for _ in range(5):
        item.step(torch.zeros(4, 1))
    assert [t.id for t in item.tokens] == [1, 2, 3, 4, 1]
    assert scorer.truncated.count(0) == 1  # fed from position 0 at the first block only

def test_reset_plan() -> None:
    toks = [Token(i, 1.0, f) for i, f in enumerate([10, 20, 120, 130, 140])]
    # last stable emitted at 140: restart 25 frames (0.5 s) before it; tokens emitted after 115 are forced
    plan = plan_reset(toks, 150, 0, margin=25, max_overlap=250)
    assert (plan.restart_frame, plan.previous, plan.forced) == (115, [0, 1], [2, 3, 4])
    # a long silence since the last stable token: the overlap is capped (here by half the segment)
    plan = plan_reset(toks[:2], 150, 0, margin=25, max_overlap=250)
    assert (plan.restart_frame, plan.previous, plan.forced) == (75, [0, 1], [])
    plan = plan_reset([], 150, 100, margin=25, max_overlap=250)
    assert (plan.restart_frame, plan.previous, plan.forced) == (125, [], [])


REFERENCES: dict[str, str] = {}  # the offline transcripts of make_audio(4.5), by fixture: each computed once


def reference_of(fixture: str, request: pytest.FixtureRequest) -> str:
    if fixture not in REFERENCES:
        REFERENCES[fixture] = offline_transcript(request.getfixturevalue(fixture), make_audio(4.5))
    return REFERENCES[fixture]


@pytest.mark.parametrize("fixture", ["asr40", "asr300", "asr40_refresh"])
def test_streaming_equals_offline_reference(fixture: str, request: pytest.FixtureRequest) -> None:
    asr: CausalWhisperASR = request.getfixturevalue(fixture)
    audio = make_audio(4.5)
    reference = reference_of(fixture, request)
    assert len(reference) > 20
    kinds = ("whole", "one-sample", "ragged", "big")
    if fixture == "asr40_refresh":  # the re-feeds must change what is said, or this case could not tell
        assert reference != reference_of("asr40", request)
        # a re-feed is decided per block, whatever the calls: asr40 holds its 40 ms blocks to the reference in all
        # four chunkings; here one call of every block, and ragged calls inside a block and across several (each
        # chunking costs 1.4-1.9 s of CPU)
        kinds = ("whole", "ragged")
    for kind in kinds:
        updates = run_stream(asr.open_stream(), audio, chunk_sizes(len(audio), kind))
        assert check_structure(updates) == reference, kind
        resets = [u for u in updates if u.completed][:-1]
        assert resets, "the stream must cross a reset"
        if fixture == "asr300":  # time resets at the block end nearest below 3 s, then 3 s after each restart
            assert resets[0].end == pytest.approx(3.0)


def test_reset_carries_text_as_context_not_output(asr300: CausalWhisperASR) -> None:
    audio = make_audio(4.0)
    stream = asr300.open_stream()
    updates = stream.accept(AudioChunk(audio, 0))
    first = [u for u in updates if u.completed]
    assert len(first) == 1
    item = stream._item  # the item opened by the reset
    restart = item.frame0
    assert 3.0 - 0.5 * 3.0 <= restart / 50 < 3.0  # re-fed overlap: at most half the segment
    carried = first[0].transcript
    # The whole first item (<= 64 tokens) is carried: it ends the new item's decoder context as a forced
    # prefix (the tiny vocabulary has no <|startofprev|>), so the new item continues after it.
    assert item.context[: len(asr300.sot)] == asr300.sot
    assert asr300.text(item.context[len(asr300.sot) :]) == carried != ""
    rest = check_structure(updates + stream.finish())
    assert rest.startswith(carried) and rest == offline_transcript(asr300, audio)


def test_stream_lifecycle_and_validation(asr300: CausalWhisperASR) -> None:
    stream = asr300.open_stream()
    audio = make_audio(0.5)
    stream.accept(AudioChunk(audio[:1000], 16_000))
    with pytest.raises(ValueError, match="gap"):
        stream.accept(AudioChunk(audio[:10], 17_010))
    done = stream.finish()
    assert len(done) == 1 and done[0].completed and done[0].start == 1.0 and done[0].end == pytest.approx(1.0625)
    assert stream.finish() == []
    with pytest.raises(RuntimeError):
        stream.accept(AudioChunk(audio[:10], 17_000))
    stream.close()
    empty = asr300.open_stream()
    assert empty.finish() == []
    with pytest.raises(ConfigError, match="reset_s"):
        CausalWhisperASR(asr300.model, asr300.tokenizer, ASRConfig(chunk_ms=1000, reset_s=1.5))
    with pytest.raises(ConfigError, match="chunk_ms"):
        CausalWhisperASR(asr300.model, asr300.tokenizer, ASRConfig(chunk_ms=30))
    with pytest.raises(ConfigError, match="asr.refresh_ms must be >= 0, got .* and -100"):
        CausalWhisperASR(asr300.model, asr300.tokenizer, ASRConfig(refresh_ms=-100))
