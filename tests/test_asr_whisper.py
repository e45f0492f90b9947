"""The buffered Whisper slice: cached greedy decoding and the LocalAgreement-2 stream policy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr import TranscriptUpdate
from runtime.models.asr.registry import load_asr
from runtime.models.asr.whisper_buffered import WhisperBuffered
from runtime.models.asr.whisper_buffered_stream import WhisperBufferedStream

CFG = ASRConfig(step_s=0.5, segment_s=2.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def asr() -> WhisperBuffered:
    model = load_asr(CFG, device="cpu", dtype="float32")
    assert isinstance(model, WhisperBuffered)
    return model


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """5 s of a rising tone in noise: the random model's output depends on it."""
    t = np.arange(5 * SAMPLE_RATE) / SAMPLE_RATE
    noise = np.random.default_rng(0).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t / 5)) + 0.05 * noise).astype(np.float32)


def run_stream(stream: WhisperBufferedStream, audio: np.ndarray, sizes: Sequence[int]) -> list[TranscriptUpdate]:
    updates, pos = [], 0
    for size in sizes:
        updates += stream.accept(AudioChunk(audio[pos : pos + size], pos))
        pos += size
    assert pos == len(audio)
    return updates + stream.finish()


def chunk_sizes(total: int, kind: str) -> list[int]:
    if kind == "whole":
        return [total]
    if kind == "100ms":
        return [1600] * (total // 1600) + ([total % 1600] if total % 1600 else [])
    rng = np.random.default_rng(1)
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(int(rng.integers(1, 12_000)), total - sum(sizes)))
    return sizes


def test_load_reports_progress_and_prompt() -> None:
    lines: list[str] = []
    model = load_asr(ASRConfig(language=""), device="cpu", dtype="float32", progress=lines.append)
    assert lines[0] == "loading asr tiny:whisper on cpu/float32 ..."
    assert lines[-1].startswith("asr loaded in ") and lines[-1].endswith(" s")
    vocab = model.tokenizer.get_vocab()
    # the tiny vocabulary is English-only by Whisper's rule (below 51865): no language or task token; English
    # (given, or "" to detect) is all it takes (tests/test_whisper_ct2.py covers the multilingual prompt)
    assert model.prompt_ids == [vocab[t] for t in ("<|startoftranscript|>", "<|notimestamps|>")]
    for refused in (ASRConfig(language="de"), ASRConfig(task="translate")):
        with pytest.raises(ConfigError, match="English-only"):
            load_asr(refused, device="cpu", dtype="float32")


def test_prompt_of_an_english_only_checkpoint(asr: WhisperBuffered) -> None:
    vocab = asr.tokenizer.get_vocab()
    assert asr.prompt_ids == [vocab[t] for t in ("<|startoftranscript|>", "<|notimestamps|>")]


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown asr.backend 'nope'"):
        load_asr(ASRConfig(backend="nope"), device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="segment_s"):
        load_asr(ASRConfig(segment_s=31.0), device="cpu", dtype="float32")


def test_cached_greedy_equals_uncached(asr: WhisperBuffered, audio: np.ndarray) -> None:
    hypotheses = []
    for n, forced in [(4000, ()), (16000, ()), (len(audio), ()), (0, ()), (12000, (5, 6, 7))]:
        clip = audio[:n] if n else np.zeros(SAMPLE_RATE, np.float32)
        cached = asr.hypothesis(clip, forced)
        assert cached == asr.hypothesis_uncached(clip, forced)
        assert cached[: len(forced)] == list(forced)
        assert asr.eos_id not in cached and len(cached) <= CFG.max_new_tokens
        hypotheses.append(tuple(cached))
    # The comparison means something only if the output is varied and depends on the audio.
    assert len(set(hypotheses)) == len(hypotheses)
    assert all(len(set(h)) >= 3 for h in hypotheses)


def test_stream_is_chunking_invariant_and_deltas_prefix_transcript(asr: WhisperBuffered, audio: np.ndarray) -> None:
    runs = {}
    for kind in ("whole", "100ms", "random"):
        updates = run_stream(asr.open_stream(), audio, chunk_sizes(len(audio), kind))
        runs[kind] = updates
        items: dict[str, list[TranscriptUpdate]] = {}
        for update in updates:
            items.setdefault(update.item_id, []).append(update)
        for item_updates in items.values():
            *partial, last = item_updates
            assert last.completed and not any(u.completed for u in partial)
            stable = ""
            for update in partial:
                stable += update.delta
                assert last.transcript.startswith(stable)
            assert stable + last.delta == last.transcript

    # Decode points sit at exact sample positions: every chunking gives the same updates.
    def strip(updates: list[TranscriptUpdate]) -> list[tuple]:
        return [(u.delta, u.unstable, u.start, u.end, u.completed, u.transcript) for u in updates]

    assert strip(runs["whole"]) == strip(runs["100ms"]) == strip(runs["random"])
    updates = runs["100ms"]
    assert any(u.delta and not u.completed for u in updates), "no text ever became stable: test is vacuous"
    assert [(u.start, u.end) for u in updates if u.completed] == [(0.0, 2.0), (2.0, 4.0), (4.0, 5.0)]
    assert [u.end for u in updates] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.0]
    assert len({u.item_id for u in updates}) == 3


def test_gap_or_overlap_raises(asr: WhisperBuffered, audio: np.ndarray) -> None:
    stream = asr.open_stream()
    stream.accept(AudioChunk(audio[:1600], 16000))  # a stream may start at any sample
    with pytest.raises(ValueError, match="expected 17600 \\(gap\\)"):
        stream.accept(AudioChunk(audio[:1600], 17700))
    with pytest.raises(ValueError, match="overlap"):
        stream.accept(AudioChunk(audio[:1600], 17500))
    assert stream.accept(AudioChunk(audio[:8000], 17600))[0].start == 1.0


def test_finish_completes_the_open_item(asr: WhisperBuffered, audio: np.ndarray) -> None:
    stream = asr.open_stream()
    updates = stream.accept(AudioChunk(audio[:40_000], 0))  # 2.5 s: one item done at 2.0 s
    assert [u.completed for u in updates] == [False, False, False, True, False]
    (last,) = stream.finish()  # no audio since the decode at 2.5 s: its hypothesis completes the item
    assert last.completed and (last.start, last.end) == (2.0, 2.5)
    assert last.item_id == updates[-1].item_id != updates[3].item_id
    assert last.transcript == last.delta == asr.text(asr.hypothesis(audio[32_000:40_000]))
    assert stream.finish() == []
    with pytest.raises(RuntimeError, match="finished"):
        stream.accept(AudioChunk(audio[:10], 40_000))
    empty = asr.open_stream()
    assert empty.finish() == []
    empty.close()
    with pytest.raises(RuntimeError, match="closed"):
        empty.accept(AudioChunk(audio[:10], 0))


class ScriptedDecoder:
    """Hypotheses from a script; checks the stream forces the stable prefix and grows the buffer."""

    def __init__(self, script: list[bytes]) -> None:
        self.script = script
        self.calls: list[tuple[int, bytes]] = []
        self.previous: list[bytes] = []  # the previous text of each hypothesis

    def hypothesis(self, audio: np.ndarray, forced: Sequence[int] = (), previous: Sequence[int] = ()) -> list[int]:
        hyp = self.script[len(self.calls)]
        self.calls.append((len(audio), bytes(forced)))
        self.previous.append(bytes(previous))
        assert hyp.startswith(bytes(forced))
        return list(hyp)

    def text(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")  # byte-level, like Whisper's tokenizer

    def context_ids(self, previous: str, vocabulary: str = "") -> list[int]:
        return list((vocabulary + "|" + previous).encode())


def test_the_buffered_peer_decodes_every_hypothesis_after_the_turns_context() -> None:
    decoder = ScriptedDecoder([b"a", b"ab", b"abc"])
    stream = WhisperBufferedStream(decoder, step_s=0.25, segment_s=10.0)
    stream.set_context("one two", "Boz")
    for i in range(2):
        stream.accept(AudioChunk(np.zeros(4000, np.float32), 4000 * i))
    stream.finish()
    assert decoder.previous == [b"Boz|one two"] * 2  # a hypothesis at each step; the finish reuses the last
    with pytest.raises(RuntimeError, match="before the stream's first chunk"):
        stream.set_context("late")


def test_local_agreement_commits_common_prefix_of_last_two() -> None:
    script = [b"hel", b"help", b"hello", b"hello w", b"hello world"]
    decoder = ScriptedDecoder(script)
    stream = WhisperBufferedStream(decoder, step_s=0.25, segment_s=10.0)
    updates = [u for i in range(4) for u in stream.accept(AudioChunk(np.zeros(4000, np.float32), 4000 * i))]
    updates += stream.accept(AudioChunk(np.zeros(2000, np.float32), 16000))  # less than a step: no decode
    updates += stream.finish()
    assert [(u.delta, u.unstable, u.completed) for u in updates] == [
        ("", "hel", False),  # one hypothesis: nothing agreed yet
        ("hel", "p", False),  # LCP(hel, help)
        ("", "lo", False),  # LCP(help, hello) = hel, already stable
        ("lo", " w", False),  # LCP(hello, hello w)
        (" world", "", True),  # finish: a last hypothesis over all audio completes the item
    ]
    assert updates[-1].transcript == "hello world"
    assert [c[0] for c in decoder.calls] == [4000, 8000, 12000, 16000, 18000]
    assert [c[1] for c in decoder.calls] == [b"", b"", b"hel", b"hel", b"hello"]


def test_incomplete_utf8_is_held_back() -> None:
    decoder = ScriptedDecoder([b"caf\xc3", b"caf\xc3\xa9 x", b"caf\xc3\xa9 y", b"caf\xc3\xa9 yz"])
    stream = WhisperBufferedStream(decoder, step_s=0.25, segment_s=1.0)
    updates = stream.accept(AudioChunk(np.zeros(16000, np.float32), 0))
    assert [u.delta for u in updates] == ["", "caf", "é ", "yz"]  # "caf\ufffd" is never emitted
    assert updates[-1].completed and updates[-1].transcript == "café yz"
