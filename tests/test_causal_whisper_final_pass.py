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
import torch
from test_causal_whisper_decoder import chunk_sizes, make_audio, run_stream

from runtime.chunks import AudioChunk
from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.decoder import IncrementalDecoder, RecomputeDecoder
from runtime.models.asr.causal_whisper.emission import Token
from runtime.models.asr.causal_whisper.encoder import FRAME_SAMPLES
from runtime.models.asr.causal_whisper.final_pass import (
    LOOP_RATIO,
    PREPARED,
    DecoderPass,
    OfflinePass,
    agrees,
    compression_ratio,
    loops,
    shared_words,
    words,
)
from runtime.models.asr.causal_whisper.reference import offline_transcript
from runtime.models.asr.whisper_window import Encoded


class Recorder:
    """A stand-in full-context decoder: remembers the audio it was given, answers with fixed ids (`by_beams`: other
    ids for a search with that many beams) and spells id i as `words[i]`."""

    def __init__(self, ids: list[int], *, by_beams: dict[int, list[int]] | None = None,
                 words: list[str] | None = None, no_speech: float = 0.0) -> None:
        self.ids, self.by_beams, self.words, self.heard, self.searches = ids, by_beams or {}, words, [], []
        self.drafts: list[list[int]] = []
        self.previous: list[list[int]] = []  # the previous text of each search
        self.beams, self.no_speech = 1, no_speech

    def encode(self, audio: np.ndarray) -> Encoded:
        self.heard.append(audio.copy())
        return Encoded(torch.from_numpy(audio), 1500)  # not states: the audio itself, to check it is the item's

    def decode(self, encoded: Encoded, forced: Sequence[int] = (), beams: int | None = None,
               draft: Sequence[int] = (), previous: Sequence[int] = (), sot: Sequence[int] | None = None) -> list[int]:
        beams = self.beams if beams is None else beams
        self.searches.append(beams)
        self.drafts.append(list(draft))
        self.previous.append(list(previous))
        return list(self.by_beams.get(beams, self.ids))

    def sot_for(self, encoded: Encoded, speech=None) -> tuple[list[int], str]:
        return [], "en"

    def judge(self, encoded: Encoded, ids: Sequence[int], previous: Sequence[int] = (),
              sot: Sequence[int] | None = None) -> tuple[float, float]:
        return self.no_speech, -0.5

    def text(self, ids: Sequence[int]) -> str:
        return "".join(self.words[i] for i in ids) if self.words else " ".join(map(str, ids))


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


def test_an_item_without_words_is_judged_by_the_offline_pass_and_kept_empty_by_the_decoder_pass(
        base: CausalWhisperASR) -> None:
    for no_speech, expected in ((0.9, []), (0.1, [1, 2, 3])):  # silence, or a short word the stream missed
        recorder = Recorder([1, 2, 3], no_speech=no_speech)
        asr = CausalWhisperASR(base.model, base.tokenizer, cfg(final_pass="offline"),
                               final_pass=OfflinePass(recorder))
        item = asr.item(IncrementalDecoder(base.model), None)
        assert asr.final_ids(item, np.zeros(1600, np.float32)) == expected and len(recorder.heard) == 1
    asr = CausalWhisperASR(base.model, base.tokenizer, cfg(final_pass="decoder"), final_pass=DecoderPass())
    assert asr.final_ids(asr.item(IncrementalDecoder(base.model), None), np.zeros(1600, np.float32)) == []


def test_unknown_final_pass_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="final_pass"):
        CausalWhisperASR.load(cfg(final_pass="twice"), device="cpu", dtype="float32")


WORDS = [" the", " moon", " of", " we", " landed", " on", "."]
LOOP = [0, 1] + [2, 0, 1] * 30  # " the moon of the moon of the moon ..."
SENTENCE = [3, 4, 5, 0, 1, 6]  # " we landed on the moon."


def test_a_transcript_written_over_and_over_is_a_loop() -> None:
    text = lambda ids: "".join(WORDS[i] for i in ids)  # noqa: E731
    assert compression_ratio(text(LOOP)) > LOOP_RATIO and loops(text(LOOP))
    assert not loops(text(SENTENCE)) and not loops(" Ever tried. Ever failed. No matter. Try again. Fail again.")
    assert not loops("") and compression_ratio("") == 0.0


def item_with(base: CausalWhisperASR, ids: list[int]):
    item = base.item(IncrementalDecoder(base.model), None)
    item.tokens = [Token(i, 1.0, 0) for i in ids]  # what the stream wrote
    return item


def test_a_looping_pass_is_decoded_again_with_beams_from_the_same_states(base: CausalWhisperASR) -> None:
    recorder = Recorder(LOOP, by_beams={5: SENTENCE}, words=WORDS)
    final = OfflinePass(recorder)
    audio = make_audio(1.0)
    assert final.revise(item_with(base, [4]), audio) == SENTENCE
    assert recorder.searches == [1, 5] and len(recorder.heard) == 1  # encoded once
    assert (final.retried, final.kept_stream) == (1, 0)


def test_a_pass_that_loops_with_beams_too_keeps_the_streams_text(base: CausalWhisperASR) -> None:
    recorder = Recorder(LOOP, words=WORDS)
    final = OfflinePass(recorder)
    assert final.revise(item_with(base, [3, 4]), make_audio(1.0)) == [3, 4]
    assert recorder.searches == [1, 5] and (final.retried, final.kept_stream) == (1, 1)


def test_a_pass_that_does_not_loop_is_searched_once(base: CausalWhisperASR) -> None:
    recorder = Recorder(SENTENCE, by_beams={5: LOOP}, words=WORDS)
    assert OfflinePass(recorder).revise(item_with(base, [4]), make_audio(1.0)) == SENTENCE
    assert recorder.searches == [1] and recorder.drafts == [[4]]  # the stream's words are the search's draft
    recorder = Recorder(LOOP, words=WORDS)
    recorder.beams = 5  # a pass that searched with 5 beams already keeps the stream's text at once
    final = OfflinePass(recorder)
    assert final.revise(item_with(base, [4]), make_audio(1.0)) == [4] and recorder.searches == [5]


def _searching(recorder: Recorder):
    """A greedy search run beside the recorder's decoder (as the ONNX graph's is), recorded the same way."""
    def search(encoded: Encoded, previous: Sequence[int], sot: Sequence[int]) -> list[int]:
        return recorder.decode(encoded, previous=previous, sot=sot)
    return search


def test_a_pass_prepared_during_the_pause_is_the_unprepared_pass_computed_sooner(base: CausalWhisperASR) -> None:
    audio = make_audio(1.0)
    recorder = Recorder(SENTENCE, words=WORDS)
    final = OfflinePass(recorder, _searching(recorder))
    item = item_with(base, [3, 4])
    final.prepare(item, audio)
    assert len(recorder.heard) == 1 and recorder.searches == [1]  # encoded and searched in the pause
    item.tokens = [Token(i, 1.0, 0) for i in [3, 4, 5]]  # the stream wrote on meanwhile: its words are read now
    assert final.revise(item, audio) == SENTENCE and final.prepared_used == 1
    assert len(recorder.heard) == 1 and recorder.searches == [1]  # nothing computed twice
    unprepared = Recorder(SENTENCE, words=WORDS)
    assert OfflinePass(unprepared, _searching(unprepared)).revise(item, audio) == SENTENCE
    # other audio (speech went on): computed again; the preparation stays for the audio it was made from
    final.prepare(item, audio)
    assert final.revise(item, audio[:-1]) == SENTENCE and final.prepared_used == 1
    np.testing.assert_array_equal(recorder.heard[-1], audio[:-1])
    assert final.revise(item, audio) == SENTENCE and final.prepared_used == 2 and len(recorder.heard) == 3
    # a revision takes its preparation: the same audio once more is computed again
    assert final.revise(item, audio) == SENTENCE and final.prepared_used == 2 and len(recorder.heard) == 4


def test_conversations_pausing_together_each_find_their_own_preparation(base: CausalWhisperASR) -> None:
    """The pass is the model's, shared by a server's sessions: two streams prepared one after the other, then
    revised, each use their own (a single slot lost both: the second replaced the first, the first's revision
    dropped the second's); past `PREPARED` the oldest is dropped."""
    recorder = Recorder(SENTENCE, words=WORDS)
    final = OfflinePass(recorder, _searching(recorder))
    first, second = make_audio(1.0), make_audio(1.2)
    item = item_with(base, [3, 4])
    final.prepare(item, first)
    final.prepare(item, second)
    assert final.revise(item, first) == SENTENCE and final.revise(item, second) == SENTENCE
    assert final.prepared_used == 2 and len(recorder.heard) == 2 and recorder.searches == [1, 1]
    clips = [make_audio(1.0 + 0.1 * k) for k in range(PREPARED + 1)]
    for clip in clips:
        final.prepare(item, clip)
    final.revise(item, clips[0])  # the oldest, dropped: computed again
    final.revise(item, clips[-1])
    assert final.prepared_used == 3 and len(recorder.heard) == 2 + len(clips) + 1


def test_a_prepared_pass_that_loops_still_retries_with_beams(base: CausalWhisperASR) -> None:
    recorder = Recorder(LOOP, by_beams={5: SENTENCE}, words=WORDS)
    final = OfflinePass(recorder, _searching(recorder))
    final.prepare(item_with(base, [4]), make_audio(1.0))
    assert final.revise(item_with(base, [4]), make_audio(1.0)) == SENTENCE
    assert recorder.searches == [1, 5] and final.prepared_used == 1 and final.retried == 1


def test_the_final_pass_reads_the_turn_up_to_the_speech_end_it_was_given(base: CausalWhisperASR) -> None:
    """`end_speech` during the pause prepares the pass on the audio up to that point; more audio (the rest of the
    rule's silence) does not change what it reads; the same point given only at the commit gives the same
    transcript; `end_speech(None)` (speech went on) reads everything again."""
    audio = make_audio(2.4)
    until = 16_000 * 2  # the speech end plus its tail, 0.4 s before the commit

    def finished(prepare_at: int | None, point: int | None) -> tuple[str, Recorder, OfflinePass]:
        recorder = Recorder(base.tokenizer(" a revised ending", add_special_tokens=False).input_ids)
        final = OfflinePass(recorder, _searching(recorder))
        asr = CausalWhisperASR(base.model, base.tokenizer, cfg(final_pass="offline", reset_s=30.0), final_pass=final)
        stream, updates, pos = asr.open_stream(), [], 0
        for size in chunk_sizes(len(audio), "ragged"):
            updates += stream.accept(AudioChunk(audio[pos: pos + size], pos))
            pos += size
            if prepare_at is not None and pos >= prepare_at:
                stream.end_speech(point)
                prepare_at = None
        if prepare_at is not None:  # given at the commit
            stream.end_speech(point)
        done = [u for u in updates + stream.finish() if u.completed]
        return "".join(u.transcript for u in done), recorder, final

    early, recorder, final = finished(until, until)
    np.testing.assert_array_equal(recorder.heard[-1], audio[:until])
    assert len(recorder.heard) == 1 and final.prepared_used == 1  # prepared once, read at the commit
    late, recorder, final = finished(len(audio) + 1, until)
    assert late == early and final.prepared_used == 1
    np.testing.assert_array_equal(recorder.heard[-1], audio[:until])
    _, recorder, final = finished(until, None)
    np.testing.assert_array_equal(recorder.heard[-1], audio)
    assert final.prepared_used == 0


def test_a_pass_cut_short_is_decoded_again_with_beams_and_kept_if_it_holds_more_of_the_streams_words(
        base: CausalWhisperASR) -> None:
    """Greedy " the moon." for a stream that wrote " we landed on the moon": it holds fewer than half the stream's
    words, so 5 beams search again; their " we landed on the moon." is kept, as holding more of them."""
    stream = [3, 4, 5, 0, 1]
    recorder = Recorder([0, 1, 6], by_beams={5: SENTENCE}, words=WORDS)
    final = OfflinePass(recorder)
    assert final.revise(item_with(base, stream), make_audio(1.0)) == SENTENCE
    assert recorder.searches == [1, 5] and final.beamed == 1
    # the beams do no better: the greedy transcript stays (never the stream's own words)
    recorder = Recorder([0, 1, 6], by_beams={5: [2, 6]}, words=WORDS)
    final = OfflinePass(recorder)
    assert final.revise(item_with(base, stream), make_audio(1.0)) == [0, 1, 6] and final.beamed == 1
    # a pass that adds words the stream missed is not cut short: searched once
    recorder = Recorder(SENTENCE, by_beams={5: LOOP}, words=WORDS)
    final = OfflinePass(recorder)
    assert final.revise(item_with(base, [4]), make_audio(1.0)) == SENTENCE and recorder.searches == [1]
    assert final.beamed == 0


def test_the_witness_compares_words_of_any_script() -> None:
    """The witness and the loop fallback compare words; the whisper-base profile writes other languages than English,
    whose letters must not cut words apart (a stream's "años" agreed with a pass's "años, a os" before)."""
    assert words("Hace dos AÑOS, él llegó.") == ["hace", "dos", "años", "él", "llegó"]
    assert words("Don't stop: it's 7 o'clock") == ["don't", "stop", "it's", "7", "o'clock"]
    assert words("我们去 Tokyo 吧") == ["我", "们", "去", "tokyo", "吧"]  # no spaces between words: each character
    assert words("हिन्दी भाषा") == ["हिन्दी", "भाषा"]  # vowel signs and the virama are marks inside the word
    assert words("cafe\u0301, it\u2019s students'") == ["café", "it's", "students"]
    assert shared_words("Die Straße über der Brücke", "die straße unter der brücke") == 4
    assert agrees("Über den Fluß", "über den Fluß.") and not agrees("años", "a os")
