"""Reading on from the turn before (final_pass.py, "Reading on"; pipeline/turns_before.py): in a captions session a
turn's offline pass also decodes the turn before's audio with its own, that turn's ids forced, and keeps what follows
them when the stream agrees.

- The pass: the window it encodes is exactly the turn before's audio then the item's, the forced ids are the turn
  before's, and it keeps the part after them only with the stream as witness; silence and turns over 30 s are not
  read on.
- The stream: its first item's pass gets the turn before, an item after a 30 s reset does not; `turn_before` is the
  audio and ids its own pass read and gave.
- The processor hands a committed buffer's turn to the next buffer's stream only in a session that does not answer
  turns, and not across a clear.
- On the real tiny.en, the pass's read-on transcript is a plain greedy decode (transformers, no cache) of the same
  window after the same forced ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from session_fakes import WordASR, WordStream
from test_audio_turns import STEP, _Turns
from test_causal_whisper_decoder import make_audio, run_stream
from test_causal_whisper_final_pass import Recorder, cfg, item_with

from runtime.channels import BlockingChannel
from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.memory.conversation import Conversation
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.final_pass import OfflinePass, TurnBefore
from runtime.models.asr.whisper_language import Speech
from runtime.models.asr.whisper_window import Encoded
from runtime.pipeline.audio import AudioProcessor, BufferEnd
from runtime.pipeline.turn_signals import TurnEvent
from runtime.pipeline.turns_before import READ_ON_PAUSE_S
from runtime.session_state import ContextChanges, HeardClock
from runtime.worker import DeviceWorker

EN = Speech("en")  # what the fakes' passes decode in (`Recorder.sot_for`)
WORDS = [" the", " ferry", " leaves", " at", " six", ".", " Captain", " Marwood", " checks", " ropes"]


class Reader(Recorder):
    """A full-context decoder that writes `own` for a turn's audio and, given forced ids, writes them and `read`."""

    def __init__(self, own: list[int], read: list[int]) -> None:
        super().__init__(own, words=WORDS)
        self.read = read
        self.forced: list[list[int]] = []

    def decode(self, encoded: Encoded, forced: Sequence[int] = (), beams: int | None = None,
               draft: Sequence[int] = (), previous: Sequence[int] = (), sot: Sequence[int] | None = None) -> list[int]:
        ids = super().decode(encoded, forced, beams, draft, previous, sot)
        self.forced.append(list(forced))
        return [*forced, *self.read] if forced else ids

    def text(self, ids: Sequence[int]) -> str:
        return "".join(WORDS[i] for i in ids if i < len(WORDS))


class Witnessed(Reader):
    """A `Reader` for a real (random-weight) stream: whatever ids the stream wrote, spelled as the reading's words
    (a witness that agrees with it)."""

    def text(self, ids: Sequence[int]) -> str:
        if ids and all(i < len(WORDS) for i in ids):
            return super().text(ids)
        return super().text(self.read) if ids else ""


@pytest.fixture(scope="module")
def base() -> CausalWhisperASR:
    return CausalWhisperASR.load(cfg(), device="cpu", dtype="float32")


def test_the_pass_reads_the_turn_before_and_its_own_audio_in_one_window(base: CausalWhisperASR) -> None:
    before = TurnBefore(make_audio(1.0), (0, 1, 2, 3, 4, 5), EN)
    audio = make_audio(1.5)
    reader = Reader(own=[6, 7, 9], read=[6, 7, 8, 9])  # alone it lost " checks"; read on, it hears it
    final = OfflinePass(reader)
    assert final.revise(item_with(base, [6, 7, 8, 9]), audio, before=before) == [6, 7, 8, 9]
    assert final.read_on == 1 and reader.forced[-1] == [0, 1, 2, 3, 4, 5]
    np.testing.assert_array_equal(reader.heard[0], audio)  # its own pass first (the no-speech rule, the witness)
    np.testing.assert_array_equal(reader.heard[-1], np.concatenate([before.audio, audio]))
    assert final.revise(item_with(base, [6, 7, 8, 9]), audio) == [6, 7, 9]  # no turn before: its own
    off = Reader(own=[6, 7, 9], read=[6, 7, 8, 9])  # a profile that does not read on (whisper-base's)
    assert OfflinePass(off, read_on=False).revise(item_with(base, [6, 7, 8, 9]), audio, before=before) == [6, 7, 9]
    assert len(off.heard) == 1 and off.forced == [[]]


def test_the_turn_before_is_forced_once_not_also_in_the_previous_text(base: CausalWhisperASR) -> None:
    """A captions session's previous text ends with the turn before's words: the window's forced ids hold them, so
    the forced decode's previous text is what came before them; other previous text is passed whole."""
    before = TurnBefore(make_audio(1.0), (0, 1, 2), EN)
    for previous, passed in (([9, 4, 0, 1, 2], [9, 4]), ([9, 4, 0, 1], [9, 4, 0, 1])):
        reader = Reader(own=[6, 7, 9], read=[6, 7, 8, 9])
        item = item_with(base, [6, 7, 8, 9])
        item.previous = list(previous)
        assert OfflinePass(reader).revise(item, make_audio(1.5), before=before) == [6, 7, 8, 9]
        assert reader.forced[-1] == [0, 1, 2] and reader.previous[-1] == passed
        assert reader.previous[0] == previous  # the turn's own pass reads the previous text as it is


def test_a_reading_the_stream_does_not_witness_is_dropped(base: CausalWhisperASR) -> None:
    before = TurnBefore(make_audio(1.0), (0, 1, 2), EN)
    for read in ([5, 5], []):  # other words than the stream's, or nothing after the forced ids
        final = OfflinePass(Reader(own=[6, 7, 9], read=read))
        assert final.revise(item_with(base, [6, 7, 8, 9]), make_audio(1.5), before=before) == [6, 7, 9]
        assert final.read_on == 0
    reader = Reader(own=[6, 7, 9], read=[6, 7, 8, 9])  # a stream that wrote nothing is no witness: not read on
    assert OfflinePass(reader).revise(item_with(base, []), make_audio(1.5), before=before) == [6, 7, 9]
    assert len(reader.heard) == 1 and reader.forced == [[]]


def test_a_turn_before_in_another_language_or_task_is_not_read_on(base: CausalWhisperASR) -> None:
    for speech in (Speech("de"), Speech("en", "translate")):
        reader = Reader(own=[6, 7, 9], read=[6, 7, 8, 9])
        final = OfflinePass(reader)
        assert final.revise(item_with(base, [6, 7, 8, 9]), make_audio(1.5), Speech("en"),
                            before=TurnBefore(make_audio(1.0), (0, 1), speech)) == [6, 7, 9]
        assert final.read_on == 0 and reader.forced == [[]]


def test_a_failure_while_reading_on_leaves_the_turns_own_transcript(base: CausalWhisperASR,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    class Failing(Reader):
        def decode(self, encoded: Encoded, forced: Sequence[int] = (), *args: object, **kwargs: object) -> list[int]:
            if forced:
                raise RuntimeError("out of memory")
            return super().decode(encoded, forced, *args, **kwargs)  # type: ignore[arg-type]

    final = OfflinePass(Failing(own=[6, 7, 9], read=[6, 7, 8, 9]))
    assert final.revise(item_with(base, [6, 7, 8, 9]), make_audio(1.5), before=TurnBefore(make_audio(1.0), (0, 1),
                                                                                             EN)) == [6, 7, 9]
    assert final.read_on == 0 and "reading on from the turn before failed" in caplog.text


def test_silence_and_turns_over_whisper_s_window_are_not_read_on(base: CausalWhisperASR) -> None:
    reader = Reader(own=[6, 7], read=[6, 7, 8])
    reader.no_speech = 0.9  # Whisper hears no speech in the turn: it completes empty, nothing is read on
    assert OfflinePass(reader).revise(item_with(base, []), make_audio(1.0), before=TurnBefore(make_audio(1.0),
                                                                                                (0, 1), EN)) == []
    assert len(reader.heard) == 1
    reader = Reader(own=[6, 7], read=[6, 7, 8])
    long_before = TurnBefore(np.zeros(29 * SAMPLE_RATE, np.float32), (0, 1), EN)
    assert OfflinePass(reader).revise(item_with(base, [6, 7, 8]), make_audio(1.5), before=long_before) == [6, 7]
    assert len(reader.heard) == 1 and reader.forced == [[]]


def test_a_streams_first_item_reads_on_and_hands_its_own_turn_to_the_next(base: CausalWhisperASR) -> None:
    reader = Witnessed(own=[6, 7], read=[6, 7, 8])
    asr = CausalWhisperASR(base.model, base.tokenizer, cfg(final_pass="offline", reset_s=30.0),
                           final_pass=OfflinePass(reader))
    first, second = make_audio(1.2), make_audio(1.0) * 0.5
    stream = asr.open_stream()
    run_stream(stream, first, [len(first)])
    handed = stream.turn_before()
    assert handed is not None and handed.ids == (6, 7) and handed.speech == EN and reader.forced == [[]]
    np.testing.assert_array_equal(handed.audio, first)  # the audio its own pass read
    nxt = asr.open_stream()
    nxt.read_on(handed)
    done = [u for u in run_stream(nxt, second, [len(second)]) if u.completed]
    assert reader.forced[-1] == [6, 7] and done[-1].transcript == asr.text([6, 7, 8])
    np.testing.assert_array_equal(reader.heard[-1], np.concatenate([first, second]))
    late = asr.open_stream()
    run_stream(late, second, [len(second)])
    with pytest.raises(RuntimeError, match="before the stream's first chunk"):
        late.read_on(handed)
    with pytest.raises(TypeError, match="turn_before"):
        asr.open_stream().read_on(("audio", [1]))
    withdrawn = asr.open_stream()  # handed on, then withdrawn after its first chunk (the pause was too long)
    withdrawn.read_on(handed)
    forced = len(reader.forced)
    withdrawn.accept(AudioChunk(second[:8000], 0))
    withdrawn.read_on(None)
    withdrawn.accept(AudioChunk(second[8000:], 8000))
    withdrawn.finish()
    assert all(not f for f in reader.forced[forced:])  # its pass read its own turn only


def test_an_item_after_a_30_s_reset_is_not_read_on(base: CausalWhisperASR) -> None:
    reader = Witnessed(own=[6, 7], read=[6, 7, 8])
    asr = CausalWhisperASR(base.model, base.tokenizer, cfg(final_pass="offline"), final_pass=OfflinePass(reader))
    stream = asr.open_stream()  # reset_s 3.0: the committed item of 4.5 s starts after a reset
    stream.read_on(TurnBefore(make_audio(1.0), (0, 1), EN))
    done = [u for u in run_stream(stream, make_audio(4.5), [16_000] * 5) if u.completed]
    assert len(done) >= 2 and all(not f for f in reader.forced)


@dataclass
class _ReadingStream(WordStream):
    """A word stream that records what it was handed to read on from, and hands on its words."""

    handed: list[object] = field(default_factory=list)

    def read_on(self, before: object | None) -> None:
        self.handed.append(before)

    def turn_before(self) -> object | None:
        return ("turn", tuple(self.chunks))


class _ReadingASR(WordASR):
    def open_stream(self) -> _ReadingStream:
        self.streams.append(_ReadingStream(self))
        return self.streams[-1]  # type: ignore[return-value]


async def _buffers(ends: list[BufferEnd], captions: bool) -> list[_ReadingStream]:
    """Three buffers of two chunks, each ended by `ends[i]`, through the audio processor."""
    asr = _ReadingASR(per_item=1000)
    channel: BlockingChannel[AudioChunk | BufferEnd] = BlockingChannel(16, "audio")
    step = SAMPLE_RATE // 10
    for i in range(6):
        await channel.put(AudioChunk(np.full(step, 0.1, np.float32), i * step))
        if i % 2:
            await channel.put(ends[i // 2])
    channel.close()

    async def emit(event) -> None:
        pass

    with DeviceWorker() as worker:
        await AudioProcessor(channel, asr.open_stream, worker, emit, Conversation(), HeardClock(), ContextChanges(),
                             reads_on=lambda: captions).run()
    return asr.streams  # type: ignore[return-value]


@pytest.mark.asyncio
async def test_a_captions_session_hands_each_committed_turn_to_the_next_stream() -> None:
    streams = await _buffers([BufferEnd(), BufferEnd(), BufferEnd()], captions=True)
    assert [s.handed for s in streams] == [[], [("turn", (0, 1))], [("turn", (2, 3))]]
    streams = await _buffers([BufferEnd(), BufferEnd(), BufferEnd()], captions=False)  # a session that answers
    assert all(not s.handed for s in streams)
    streams = await _buffers([BufferEnd(), BufferEnd(clear=True), BufferEnd()], captions=True)
    assert [s.handed for s in streams] == [[], [("turn", (0, 1))], []]  # nothing follows a dropped buffer


async def _two_spoken_turns(pause_s: float) -> list[_ReadingStream]:
    """Two turns the VAD (scripted) heard in a captions session: speech from 0.1 s, stopped at 0.3 s (the turn
    commits), then speech again `pause_s` after that stop, stopped 0.2 s later."""
    asr = _ReadingASR(per_item=1000)
    second = 3 + round(pause_s * 10)
    turns = _Turns({1: [TurnEvent(True, STEP)], 3: [TurnEvent(False, 3 * STEP)],
                    second: [TurnEvent(True, second * STEP)], second + 2: [TurnEvent(False, (second + 2) * STEP)]})
    channel: BlockingChannel[AudioChunk | BufferEnd] = BlockingChannel(second + 4, "audio")
    for i in range(second + 4):
        await channel.put(AudioChunk(np.full(STEP, 0.1, np.float32), i * STEP))
    channel.close()

    async def emit(event) -> None:
        pass

    with DeviceWorker() as worker:
        await AudioProcessor(channel, asr.open_stream, worker, emit, Conversation(), HeardClock(), ContextChanges(),
                             turns=turns, reads_on=lambda: True).run()
    return asr.streams  # type: ignore[return-value]


@pytest.mark.asyncio
async def test_a_turn_that_starts_long_after_the_one_before_does_not_read_on_from_it() -> None:
    """A reader's pause joins two turns; a silence longer than `READ_ON_PAUSE_S` between the VAD's speech stop and the
    next speech start withdraws the turn before (`read_on(None)`): `runtime bench video-qa`'s narration, a sentence a
    slide ten seconds apart, read on lost words (speech and screen 6/6 -> 4/6)."""
    streams = await _two_spoken_turns(0.5)
    assert streams[1].handed == [("turn", (0, 1, 2, 3))]
    streams = await _two_spoken_turns(READ_ON_PAUSE_S + 0.5)
    assert streams[1].handed == [("turn", (0, 1, 2, 3)), None]


@pytest.mark.slow
def test_the_real_pass_reads_on_as_a_plain_greedy_decode_of_the_same_window(base: CausalWhisperASR) -> None:
    """tiny.en over two sentences said by espeak-ng: the read-on ids are what a cache-free greedy loop over the
    model (transformers' forward, every step from scratch) writes after the same forced ids."""
    from runtime.bench.asr_captions import READING
    from runtime.config import ASRConfig
    from runtime.models.asr.registry import load_asr
    from runtime.train.synthesizers import Voice, resample, synthesize

    offline = load_asr(ASRConfig(backend="whisper-buffered", model="builtin:whisper-tiny.en"), device="cpu",
                       dtype="float32")
    final = OfflinePass(offline)
    said = []
    for text in READING[3:5]:
        samples, rate, _ = synthesize(Voice("espeak", "en-us"), text, np.random.default_rng(0))
        said.append(resample(samples, rate, SAMPLE_RATE).astype(np.float32))
    before = TurnBefore(said[0], tuple(offline.decode(offline.encode(said[0]))), EN)
    own = offline.decode(offline.encode(said[1]))
    read = final.revise(item_with(base, own), said[1], before=before)  # a stream that wrote what the pass did
    assert final.read_on == 1
    window = np.concatenate([said[0], said[1]])
    features = offline.feature_extractor(window, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    ids = offline.prefix([], offline.sot_for(offline.encode(window))[0]) + list(before.ids)
    written: list[int] = []
    with torch.inference_mode():
        states = offline.model.model.encoder(features)  # once: every step below runs the whole decoder again
        for _ in range(60):
            logits = offline.model(encoder_outputs=states, decoder_input_ids=torch.tensor([ids + written]),
                                   use_cache=False).logits[0, -1].float()
            if offline.suppress:
                logits[offline.suppress] = float("-inf")
            token = int(logits.argmax())
            if token == offline.eos_id:
                break
            written.append(token)
    assert read == written and offline.text(read).strip()
