"""The final pass of causal Whisper (`asr.final_pass`): a committed item decoded once more with all it heard.

- `decoder`: re-decoding equals a fresh cache-free decode over all the item's frames at once.
- Streamed over any chunking, with resets, the completed transcripts equal `offline_transcript` with the same
  pass, and the `offline` pass is given exactly the audio of the item the commit ends.
- On the real tiny.en with the shipped adapter, the `offline` pass is the offline ceiling's own transcript.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from test_causal_whisper_decoder import chunk_sizes, make_audio, run_stream

from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.asr import FRAME_SAMPLES, CausalWhisperASR
from runtime.models.asr.causal_whisper.decoder import IncrementalDecoder, RecomputeDecoder
from runtime.models.asr.causal_whisper.final_pass import DecoderPass, OfflinePass
from runtime.models.asr.causal_whisper.reference import offline_transcript


class Recorder:
    """A stand-in full-context decoder: remembers the audio it was given, answers with fixed ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.heard = ids, []

    def hypothesis(self, audio: np.ndarray, forced: Sequence[int] = ()) -> list[int]:
        self.heard.append(audio.copy())
        return list(self.ids)


def cfg(**kw) -> ASRConfig:
    return ASRConfig(**{"chunk_ms": 300, "reset_s": 3.0, "max_new_tokens": 60, "loop_repeats": 0, **kw})


@pytest.fixture(scope="module")
def base() -> CausalWhisperASR:
    return CausalWhisperASR.load(cfg(), device="cpu", dtype="float32")


def test_redecode_equals_a_fresh_decode_over_every_frame(base: CausalWhisperASR) -> None:
    frames = base.encoder.encode_audio(make_audio(2.0))
    b = base.block_frames
    item = base.item(IncrementalDecoder(base.model), None)
    for start in range(0, len(frames), b):
        item.step(frames[start : start + b], final=start + b >= len(frames))
    streamed = [t.id for t in item.tokens]
    fresh = base.item(RecomputeDecoder(base.model), None)
    fresh.step(frames, final=True)  # every position fed once, with all the frames
    assert DecoderPass().revise(item, np.zeros(0, np.float32)) == [t.id for t in fresh.tokens]
    assert item.stable == len(item.tokens)
    assert streamed != [t.id for t in fresh.tokens]  # the random model's first pass differs: the pass did work


@pytest.mark.parametrize("kind", ["decoder", "offline"])
def test_streamed_final_pass_equals_its_offline_computation(base: CausalWhisperASR, kind: str) -> None:
    audio = make_audio(4.5)
    recorder = Recorder(base.tokenizer("a revised ending", add_special_tokens=False).input_ids)
    final = DecoderPass() if kind == "decoder" else OfflinePass(recorder)
    asr = CausalWhisperASR(base.model, base.tokenizer, cfg(final_pass=kind), final_pass=final)
    plain = offline_transcript(base, audio)
    reference = offline_transcript(asr, audio)
    assert reference != plain
    for chunking in ("whole", "one-sample", "ragged", "big"):
        updates = run_stream(asr.open_stream(), audio, chunk_sizes(len(audio), chunking))
        done = [u for u in updates if u.completed]
        assert len(done) >= 2, "the stream must cross a reset"
        assert "".join(u.transcript for u in done) == reference, chunking
        # a reset-completed item keeps its first pass; only the last (committed) one is revised
        assert plain.startswith("".join(u.transcript for u in done[:-1]))
        if kind == "offline":
            assert recorder.ids == base.tokenizer(done[-1].transcript, add_special_tokens=False).input_ids
            start = round(done[-2].end * 16_000)  # the committed item starts where the reset item ended
            assert start % FRAME_SAMPLES == 0
            np.testing.assert_array_equal(recorder.heard[-1], audio[start:])
            np.testing.assert_array_equal(recorder.heard[0], audio[start:])  # offline_transcript's call


def test_an_item_without_words_is_not_decoded_again(base: CausalWhisperASR) -> None:
    recorder = Recorder([1, 2, 3])
    asr = CausalWhisperASR(base.model, base.tokenizer, cfg(final_pass="offline"),
                           final_pass=OfflinePass(recorder))
    item = asr.item(IncrementalDecoder(base.model), None)
    assert asr.final_ids(item, np.zeros(1600, np.float32)) == [] and recorder.heard == []


def test_unknown_final_pass_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="final_pass"):
        CausalWhisperASR.load(cfg(final_pass="twice"), device="cpu", dtype="float32")
