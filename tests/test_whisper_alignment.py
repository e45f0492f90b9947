"""Token times from Whisper's alignment heads (`models/asr/whisper_alignment.py`): the DTW against brute force,
and the alignment against CTranslate2's own `Whisper.align` on the real tiny.en."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from speech_dev import dev_clips, has_dev_clips
from weights_common import packaged_or_skip

from runtime.chunks import SAMPLE_RATE
from runtime.io.sample import demo_speech
from runtime.models.asr.whisper_alignment import TokenAligner, dtw_path


def _paths(n: int, m: int):
    """Every monotonic path from (0, 0) to (n-1, m-1) stepping right, down or diagonally."""
    def walk(i: int, j: int, path: list[tuple[int, int]]):
        if (i, j) == (n - 1, m - 1):
            yield path
            return
        for di, dj in ((1, 1), (1, 0), (0, 1)):
            if i + di < n and j + dj < m:
                yield from walk(i + di, j + dj, [*path, (i + di, j + dj)])
    yield from walk(0, 0, [(0, 0)])


@pytest.mark.parametrize(("n", "m", "seed"), [(1, 4, 0), (3, 3, 1), (3, 5, 2), (4, 6, 3), (2, 7, 4)])
def test_dtw_path_is_the_cheapest_monotonic_path(n: int, m: int, seed: int) -> None:
    cost = np.random.default_rng(seed).standard_normal((n, m))
    tokens, frames = dtw_path(cost)
    path = list(zip(tokens.tolist(), frames.tolist(), strict=True))
    assert path[0] == (0, 0) and path[-1] == (n - 1, m - 1)
    assert all((b[0] - a[0], b[1] - a[1]) in {(1, 1), (1, 0), (0, 1)} for a, b in itertools.pairwise(path))
    best = min(sum(cost[i, j] for i, j in p) for p in _paths(n, m))
    assert sum(cost[i, j] for i, j in path) == pytest.approx(best)


def test_token_starts_equal_ctranslate2_align_on_tiny_en() -> None:
    """openai-whisper's alignment (heads, normalisation, median filter, DTW) as CTranslate2 implements it:
    the same start frame for every token and for end-of-text, on the demo sample and the human dev clips."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from transformers import WhisperFeatureExtractor

    from runtime.models.asr.whisper_checkpoint import load_whisper, transcript_prompt
    from runtime.train.causal_whisper import encode_text

    folder = packaged_or_skip("whisper-tiny.en")
    engine = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="float32", intra_threads=1)
    model, tokenizer, path = load_whisper(str(folder))
    features = WhisperFeatureExtractor.from_pretrained(path)
    prompt = transcript_prompt(tokenizer, model.config, "en")
    timer = TokenAligner.load(path, prompt, tokenizer.eos_token_id)
    demo = demo_speech()[: 12 * SAMPLE_RATE]
    mel = features(demo, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
    spoken = engine.generate(ctranslate2.StorageView.from_array(mel), [prompt], beam_size=1)[0].sequences_ids[0]
    clips = [("demo", demo, spoken)]
    clips += [(name, audio, encode_text(tokenizer, text)) for name, audio, text in (dev_clips() if has_dev_clips()
                                                                                    else [])]
    for name, audio, ids in clips:
        mel = features(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
        # CTranslate2 appends <|notimestamps|> to the start sequence itself
        result = engine.align(ctranslate2.StorageView.from_array(mel), prompt[:-1], [ids],
                              -(-len(audio) // 160))[0]
        rows, steps = (np.array(x) for x in zip(*result.alignments, strict=True))
        theirs = [int(steps[rows == k].min()) for k in range(len(ids) + 1)]
        assert timer.starts(audio, ids) == theirs, name
        ends = timer.end_frames(audio, ids)
        assert ends == sorted(ends) and all(e > s for e, s in zip(ends, theirs[:-1], strict=True)), name
