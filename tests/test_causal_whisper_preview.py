"""Previews (`asr.preview_ms`): the partial block encoded and decoded, shown, then taken back.

- The encoder's preview equals `forward_full` over only the frames made so far, and leaves the stream as it was
  (what it emits afterwards is bitwise what a stream never previewed emits).
- What the stream shows after every call, over any chunking and across resets, equals the reference's last
  event by then (`reference.offline_run`: cache-free, one `forward_full` per preview); the transcripts equal the
  same stream's without previews.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from test_causal_whisper_decoder import ScriptedScorer, chunk_sizes, make_audio
from transformers import WhisperForConditionalGeneration

from runtime.bench import asr_systems
from runtime.chunks import AudioChunk
from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.emission import ItemDecoder
from runtime.models.asr.causal_whisper.encoder import CausalWhisperEncoder, block_end
from runtime.models.asr.causal_whisper.features import log_mel
from runtime.models.asr.causal_whisper.reference import offline_run
from runtime.models.loading import resolve_checkpoint

TOL = 1e-4  # fp32 streaming vs forward_full, as the encoder's own tests


def load(**kw) -> CausalWhisperASR:
    return CausalWhisperASR.load(ASRConfig(**kw), device="cpu", dtype="float32")


@pytest.mark.parametrize("gran", [5, 15])
def test_encoder_preview_is_forward_full_of_the_frames_so_far(gran: int) -> None:
    model = WhisperForConditionalGeneration.from_pretrained(resolve_checkpoint("tiny:whisper", role="asr")).eval()
    encoder = CausalWhisperEncoder(model, block_frames=gran)
    mel = log_mel(make_audio(2.0))  # 200 mel frames, 100 encoder frames
    previewed, plain = encoder.open(), encoder.open()
    done, checked = 0, 0
    for m in range(1, mel.shape[1] + 1):  # one mel frame at a time: a preview after every one
        out, ref_out = previewed.accept(mel[:, m - 1 : m]), plain.accept(mel[:, m - 1 : m])
        assert torch.equal(out, ref_out), "a preview changed what the stream emits"
        done += len(out)
        made = previewed.conv2_frames  # frames the front end has made (mel frame 2f + 2 seen)
        partial = previewed.preview()
        assert len(partial) == made - done
        if len(partial):
            ref = encoder.forward_full(mel[None, :, :m], made)[0, done:]
            assert (partial - ref).abs().max().item() <= TOL, m
            assert made < block_end(done, gran)  # a partial block, never a whole one
            checked += 1
    assert checked > 50
    assert torch.equal(previewed.flush(), plain.flush())


class DroppingScorer(ScriptedScorer):
    def drop_frames(self, n_frames: int) -> None:
        self.n_frames = min(self.n_frames, n_frames)


def test_item_preview_is_taken_back() -> None:
    # Vocabulary 0..5, eos = 0, context [5]: 5 -> 1 -> 2 -> eos. Token 2's probability is 0.3 after the first block,
    # 0.6 in the preview and 0.35 at the block's end, no longer the argmax: kept (0.35 >= 0.3), unless the
    # preview's 0.6 were left behind as what it must not fall below.
    def script(frames: int, prev: int) -> dict[int, float]:
        after_one = {2: 0.3} if frames <= 2 else {2: 0.6} if frames == 3 else {2: 0.35, 3: 0.4}
        return {5: {1: 0.9}, 1: after_one, 2: {0: 0.9}, 3: {0: 0.9}}[prev]

    runs = []
    for preview in (False, True):
        scorer = DroppingScorer(script)
        item = ItemDecoder(scorer, [5], eos_id=0, lookback=2, max_tokens=10, block_tokens=5, frame0=0)
        item.step(torch.zeros(2, 1))
        before = ([(t.id, t.prob, t.frame) for t in item.tokens], item.stable, scorer.n_frames)
        if preview:
            assert item.preview(torch.zeros(1, 1)) == [1, 2]
            assert ([(t.id, t.prob, t.frame) for t in item.tokens], item.stable, scorer.n_frames) == before
            assert scorer.length <= len(item.context) + item.stable  # what the preview fed is gone
        item.step(torch.zeros(2, 1))
        runs.append([(t.id, round(t.prob, 6)) for t in item.tokens])
    assert runs[0] == runs[1] == [(1, 0.9), (2, 0.35)]


def shown_after_each_call(asr: CausalWhisperASR, audio: np.ndarray, sizes: list[int]) -> tuple[list, list, str]:
    """(samples fed after each call, the current item's text shown then, the completed transcripts)."""
    stream, pos, fed, shown = asr.open_stream(), 0, [], []
    item, emitted, unstable, done = None, "", "", []
    for n in sizes:
        for u in stream.accept(AudioChunk(audio[pos : pos + n], pos)):
            if u.item_id != item:
                item, emitted = u.item_id, ""
            emitted, unstable = emitted + u.delta, u.unstable
            if u.completed:
                item, emitted, unstable = None, "", ""
                done.append(u.transcript)
        pos += n
        fed.append(pos)
        shown.append(emitted + unstable)
    done += [u.transcript for u in stream.finish() if u.completed]
    return fed, shown, "".join(done)


@pytest.mark.parametrize(("chunk_ms", "preview_ms", "kw"), [
    (300, 100, {"max_new_tokens": 60, "loop_repeats": 0}),  # the loop rule off: text long enough to reset
    (200, 40, {"max_new_tokens": 40}),
])
def test_stream_shows_the_references_previews(chunk_ms: int, preview_ms: int, kw: dict) -> None:
    asr = load(chunk_ms=chunk_ms, preview_ms=preview_ms, reset_s=3.0, **kw)
    plain = load(chunk_ms=chunk_ms, reset_s=3.0, **kw)
    audio = make_audio(4.5)
    ref = offline_run(asr, audio)
    blocks = offline_run(plain, audio)
    assert ref.text == blocks.text and len(ref.text) > 20
    assert any(t == "" for _, t in ref.shown[1:]), "the reference must cross a reset"
    assert len(ref.shown) > len(blocks.shown)
    # previews must show text the blocks never do: else this test could not tell a stream without them apart
    assert {t for _, t in ref.shown} - {t for _, t in blocks.shown}
    step = preview_ms * 16
    for kind in ("preview", "ragged", "big", "whole"):
        sizes = [step] * (len(audio) // step) + [len(audio) % step] if kind == "preview" else chunk_sizes(
            len(audio), kind)
        fed, shown, transcript = shown_after_each_call(asr, audio, sizes)
        assert transcript == ref.text, kind
        for n, text in zip(fed, shown, strict=True):
            events = [t for s, t in ref.shown if s <= n]
            assert text == (events[-1] if events else ""), (kind, n)


def test_preview_settings_are_checked() -> None:
    model = load(chunk_ms=300)
    for bad in (300, 40, 500, 30):
        with pytest.raises(ConfigError, match="preview_ms|chunk_ms"):
            CausalWhisperASR(model.model, model.tokenizer, ASRConfig(chunk_ms=300, preview_ms=bad))
    assert CausalWhisperASR(model.model, model.tokenizer, ASRConfig(chunk_ms=300, preview_ms=60)).preview_frames == 3


def test_bench_rows_and_targets_of_previews() -> None:
    assert asr_systems.variants(["causal", "previewed"], [100, 200, 300], 100) == [
        (100, "", 0), (200, "", 0), (300, "", 0), (200, "", 100), (300, "", 100), (200, "offline", 100),
        (300, "offline", 100)]
    assert asr_systems.variants(["previewed"], [300], 0) == []
    assert asr_systems.causal_id(300, "offline", 100) == "causal-whisper-300ms-preview100ms+offline"
    words = {"shown": {"median": 0.35}, "words_timed": 5}
    table = {
        "whisper-offline": {"human": {"wer": 0.0, "compute_s": 1.0, "audio_s": 10.0}},
        "causal-whisper-300ms-preview100ms+offline": {"human": {"wer": 0.0, "compute_s": 1.5, "audio_s": 10.0,
                                                                "word_latency_s": words}},
        "whisper-buffered-1s": {"human": {"wer": 0.0, "compute_s": 5.0, "audio_s": 10.0}},
    }
    t = asr_systems.targets(table, [300], 100)
    key = "causal_300ms_preview100ms+offline"
    assert t[f"{key}_human_wer_within_1.5x_offline"]["met"] is True  # held to the 100 ms bound
    assert t[f"{key}_human_median_word_latency_s"]["target"] == "<= 0.4"  # the preview's cadence + 300 ms
    assert t[f"{key}_human_median_word_latency_s"]["met"] is True
    assert t[f"{key}_compute_over_buffered"] == {"value": 0.3, "target": "<= 0.2", "met": False, "causal": 0.15,
                                                 "buffered": 0.5}
    assert "causal_300ms_preview100ms_human_median_word_latency_s" not in t  # no row, no target
    args = argparse.Namespace(systems="previewed", chunks="300")
    assert asr_systems.selection(args)[0] == ["previewed"]
