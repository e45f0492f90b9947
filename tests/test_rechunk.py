"""AudioRechunker: however audio is cut on the way in, chunks out are fixed-size, contiguous and exact."""

import numpy as np
import pytest

from runtime.chunks import SAMPLE_RATE
from runtime.io.rechunk import AudioRechunker, to_mono_float32


def random_cuts(rng: np.random.Generator, total: int, chunk: int) -> list[int]:
    """Block sizes mixing empty pushes, single samples, ragged sizes and blocks bigger than a chunk."""
    sizes = []
    while sum(sizes) < total:
        kind = rng.integers(4)
        size = [0, 1, int(rng.integers(2, max(chunk, 3))), int(rng.integers(chunk, 4 * chunk + 1))][kind]
        sizes.append(min(size, total - sum(sizes)))
    return sizes


@pytest.mark.parametrize("seed", range(12))
def test_random_splits_lose_and_duplicate_nothing(seed: int) -> None:
    rng = np.random.default_rng(seed)
    chunk = int(rng.choice([1, 7, 160, 1600]))
    start = int(rng.integers(0, 50_000))
    audio = rng.standard_normal(int(rng.integers(0, 20_000))).astype(np.float32)
    rechunker = AudioRechunker(chunk, start_sample=start)
    chunks, offset = [], 0
    for size in random_cuts(rng, len(audio), chunk):
        chunks += rechunker.push(audio[offset : offset + size])
        offset += size
    full = len(chunks)
    chunks += rechunker.flush()

    assert all(len(c.samples) == chunk for c in chunks[:full])
    assert len(chunks) - full <= 1 and all(0 < len(c.samples) < chunk for c in chunks[full:])
    joined = np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)
    np.testing.assert_array_equal(joined, audio)
    if chunks:
        assert chunks[0].start_sample == start
        assert chunks[-1].end_sample == start + len(audio)
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert before.end_sample == after.start_sample
        assert before.end == after.start
    assert rechunker.next_sample == start + len(audio) and rechunker.pending == 0
    assert rechunker.flush() == []


def test_chunk_times_are_sample_accurate() -> None:
    rechunker = AudioRechunker(1600, start_sample=8000)
    chunks = rechunker.push(np.zeros(4800, np.float32))
    assert [c.start for c in chunks] == [0.5, 0.6, 0.7]
    assert chunks[-1].end == pytest.approx(0.8)
    assert chunks[0].duration == 1600 / SAMPLE_RATE


def test_chunks_never_alias_the_input() -> None:
    audio = np.ones(100, np.float32)
    rechunker = AudioRechunker(10)
    chunks = rechunker.push(audio)
    tail = rechunker.push(audio[:5]) + rechunker.flush()
    audio[:] = 7.0
    assert all((c.samples == 1.0).all() for c in chunks + tail)


def test_push_validates() -> None:
    with pytest.raises(ValueError):
        AudioRechunker(0)
    with pytest.raises(ValueError):
        AudioRechunker(10, start_sample=-1)
    with pytest.raises(ValueError):
        AudioRechunker(10).push(np.zeros((2, 5), np.float32))
    assert AudioRechunker(10).push(np.zeros(0, np.float32)) == []


def test_push_converts_dtype() -> None:
    chunks = AudioRechunker(2).push(np.array([0.5, -0.5, 0.25], dtype=np.float64))
    assert chunks[0].samples.dtype == np.float32
    np.testing.assert_array_equal(chunks[0].samples, [0.5, -0.5])


def test_to_mono_float32() -> None:
    pcm = np.array([0, 16384, -32768], dtype=np.int16)
    np.testing.assert_allclose(to_mono_float32(pcm), [0.0, 0.5, -1.0])
    np.testing.assert_allclose(to_mono_float32(np.array([128, 255, 0], dtype=np.uint8)), [0, 127 / 128, -1])
    planar = np.array([[1.0, 0.0], [0.0, 0.0]], dtype=np.float32)  # (channels, samples)
    np.testing.assert_allclose(to_mono_float32(planar), [0.5, 0.0])
    np.testing.assert_allclose(to_mono_float32(planar, channels_last=True), [0.5, 0.0])
    interleaved = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], dtype=np.float32)  # (samples, channels)
    np.testing.assert_allclose(to_mono_float32(interleaved, channels_last=True), [0.5, 1.0, 0.0])
    assert to_mono_float32(np.zeros(3, np.float64)).dtype == np.float32
    with pytest.raises(ValueError):
        to_mono_float32(np.zeros((1, 2, 3)))


def test_a_chunk_a_few_samples_short_is_sent_at_once_with_short_by():
    """A client's 100 ms messages after the resampler's look-ahead (1583 samples, then 1600 each): each goes out as
    it arrives, every sample once, in order; without `short_by` each waited for the next message."""
    audio = np.arange(1583 + 3 * 1600 + 700, dtype=np.float32)
    pieces = [1583, 1600, 1600, 1600, 700]
    held, sent = AudioRechunker(1600), AudioRechunker(1600, short_by=64)
    out_held, out_sent, pos = [], [], 0
    for n in pieces:
        out_held.append(held.push(audio[pos : pos + n]))
        out_sent.append(sent.push(audio[pos : pos + n]))
        pos += n
    assert [len(c) for c in out_held] == [0, 1, 1, 1, 1]  # each message's chunk out only with the next one
    assert [[len(ch.samples) for ch in c] for c in out_sent] == [[1583], [1600], [1600], [1600], []]
    chunks = [ch for c in out_sent for ch in c] + sent.flush()
    assert [ch.start_sample for ch in chunks] == [0, 1583, 3183, 4783, 6383]
    np.testing.assert_array_equal(np.concatenate([ch.samples for ch in chunks]), audio)
    with pytest.raises(ValueError):
        AudioRechunker(16, short_by=16)
