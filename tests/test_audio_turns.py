"""The audio processor and turn detection: `pipeline.speech_gate` (with turn detection on, a buffer's words wait
for the VAD to hear speech, and a buffer where it heard none holds no words: Whisper's "you" over silence), and
what follows a turn decided by the settings where it ended. Scripted ASR stream and turns, the real processor."""

import numpy as np
import pytest
from test_grounding import screen

from runtime.channels import BlockingChannel
from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.memory.conversation import Conversation
from runtime.models.asr.base import TranscriptUpdate
from runtime.pipeline.audio import AudioProcessor, BufferEnd
from runtime.pipeline.pause_pass import FINAL_TAIL_S
from runtime.pipeline.turn_signals import IdleTimeout, TurnEvent
from runtime.session_state import ContextChanges, HeardClock
from runtime.worker import DeviceWorker

STEP = SAMPLE_RATE // 10  # 100 ms chunks


class _Stream:
    """Scripted updates per chunk index, and a final pass; records whether it was closed."""

    def __init__(self, by_chunk: dict[int, list[TranscriptUpdate]], final: list[TranscriptUpdate]) -> None:
        self.by_chunk, self.final, self.closed = by_chunk, final, False
        self.contexts: list[tuple[str, str]] = []

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        self.contexts.append((previous, vocabulary))

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        return self.by_chunk.get(chunk.start_sample // STEP, [])

    def finish(self) -> list[TranscriptUpdate]:
        return self.final

    def close(self) -> None:
        self.closed = True


class _Turns:
    """Turn events scripted per chunk index; `on` is whether a turn rule listens, flipped after the chunks in
    `flip_after` (as a session.update between two chunks would); `speech`: the VAD's seconds of speech heard."""

    def __init__(self, by_chunk: dict[int, list[TurnEvent | IdleTimeout]], on: bool = True,
                 flip_after: tuple[int, ...] = (), speech: float = 1.0,
                 pauses: dict[int, int | None] | None = None) -> None:
        """`pauses`: after chunk i, where the current pause began (None: speaking), until the next entry."""
        self.by_chunk, self.on, self.flip_after, self.speech = by_chunk, on, flip_after, speech
        self.pauses, self.pause = pauses or {}, None

    def detect(self, chunk: AudioChunk) -> list[TurnEvent | IdleTimeout]:
        index = chunk.start_sample // STEP
        self.pause = self.pauses.get(index, self.pause)
        if index in self.flip_after:
            self.on = not self.on
        return self.by_chunk.get(index, [])

    def reset(self, at_sample: int) -> None:
        pass

    def listening(self) -> bool:
        return self.on

    def speech_s(self) -> float:
        return self.speech

    def pause_start(self) -> int | None:
        return self.pause


def _you(i: int) -> list[TranscriptUpdate]:
    return [TranscriptUpdate("a0", "you", "", 0.0, (i + 1) / 10)]


async def _run(entries: list[int | BufferEnd], stream: _Stream, turns: _Turns, *, gate: bool = True,
               conversation: Conversation | None = None, sink=None):
    channel: BlockingChannel[AudioChunk | BufferEnd] = BlockingChannel(len(entries), "audio")
    for entry in entries:
        await channel.put(entry if isinstance(entry, BufferEnd)
                          else AudioChunk(np.zeros(STEP, np.float32), entry * STEP))
    channel.close()
    conversation, emitted = conversation or Conversation(), []

    async def emit(event) -> None:
        emitted.append(event)

    with DeviceWorker() as worker:
        await AudioProcessor(channel, lambda: stream, worker, emit, conversation, HeardClock(), ContextChanges(),
                             first_stream=stream, turns=turns, sink=sink, speech_gate=gate).run()
    return emitted, conversation


@pytest.mark.asyncio
async def test_words_before_speech_wait_for_it_then_follow_speech_started():
    stream = _Stream({0: _you(0), 3: [TranscriptUpdate("a0", " red ball", "", 0.0, 0.4)]},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.5, True, "red ball")])
    turns = _Turns({2: [TurnEvent(True, 2 * STEP)], 4: [TurnEvent(False, 5 * STEP)]})
    out, conversation = await _run([0, 1, 2, 3, 4], stream, turns)
    types = [e.type for e in out]
    assert types[:3] == ["input_audio_buffer.speech_started", "conversation.item.input_audio_transcription.delta",
                         "conversation.item.input_audio_transcription.delta"]
    assert [e.delta for e in out[1:3]] == ["you", " red ball"]  # held from chunk 0, released at speech
    done = [e for e in out if e.type == "conversation.item.input_audio_transcription.completed"]
    assert [d.transcript for d in done] == ["red ball"] and conversation.final_text() == "red ball"


@pytest.mark.asyncio
async def test_a_buffer_without_speech_says_nothing_at_the_end_of_input():
    stream = _Stream({0: _you(0), 1: _you(1)}, [TranscriptUpdate("a0", "", "", 0.0, 0.3, True, "you")])
    out, conversation = await _run([0, 1, 2], stream, _Turns({}))
    assert out == [] and conversation.items == [] and stream.closed


@pytest.mark.asyncio
async def test_a_commit_of_a_buffer_without_speech_completes_an_empty_item():
    stream = _Stream({0: _you(0)}, [TranscriptUpdate("a0", "", "", 0.0, 0.2, True, "you")])
    out, conversation = await _run([0, 1, BufferEnd(client_event_id="c1")], stream, _Turns({}))
    assert [e.type for e in out] == ["input_audio_buffer.committed", "conversation.item.added",
                                     "conversation.item.input_audio_transcription.completed", "conversation.item.done"]
    assert out[2].transcript == "" and [it.text for it in conversation.items] == [""]


@pytest.mark.asyncio
async def test_speech_in_one_buffer_does_not_open_the_gate_of_the_next():
    stream = _Stream({1: [TranscriptUpdate("a0", "hi", "", 0.0, 0.2)], 4: _you(4)},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.3, True, "hi")])
    turns = _Turns({0: [TurnEvent(True, 0)], 2: [TurnEvent(False, 2 * STEP)]})
    out, conversation = await _run([0, 1, 2, 3, 4, 5], stream, turns)
    done = [e.transcript for e in out if e.type == "conversation.item.input_audio_transcription.completed"]
    assert done == ["hi"] and [it.text for it in conversation.items] == ["hi"]
    assert not any(getattr(e, "delta", "") == "you" for e in out)


@pytest.mark.asyncio
async def test_without_the_gate_or_without_turn_detection_every_word_shows():
    for gate, on in ((False, True), (True, False)):
        stream = _Stream({0: _you(0)}, [TranscriptUpdate("a0", "", "", 0.0, 0.2, True, "you")])
        out, conversation = await _run([0, 1], stream, _Turns({}, on=on), gate=gate)
        assert "".join(e.delta for e in out if e.type.endswith("transcription.delta")) == "you", (gate, on)
        assert conversation.final_text() == "you", (gate, on)


def _deltas(out: list) -> str:
    return "".join(e.delta for e in out if e.type.endswith("transcription.delta"))


def _completed(out: list) -> list[str]:
    return [e.transcript for e in out if e.type.endswith("transcription.completed")]


@pytest.mark.asyncio
async def test_what_waited_comes_out_as_one_update_whatever_the_wait():
    stream = _Stream({i: [TranscriptUpdate("a0", " you", "", 0.0, (i + 1) / 10)] for i in range(40)},
                     [TranscriptUpdate("a0", "", "", 0.0, 4.1, True, "you")])
    turns = _Turns({40: [TurnEvent(True, 40 * STEP)]})
    out, _ = await _run(list(range(41)), stream, turns)
    deltas = [e for e in out if e.type.endswith("transcription.delta")]
    assert deltas[0].delta == " you" * 40 and deltas[0].media_time == pytest.approx(4.0)
    assert out[out.index(deltas[0]) - 1].type == "input_audio_buffer.speech_started"


@pytest.mark.asyncio
async def test_turn_detection_switched_on_mid_buffer_does_not_hide_words_already_shown():
    stream = _Stream({0: [TranscriptUpdate("a0", "hello", "", 0.0, 0.1)],
                      2: [TranscriptUpdate("a0", " world", "", 0.0, 0.3)]},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.4, True, "hello world")])
    for ending in ([], [BufferEnd(client_event_id="c1")]):
        out, conversation = await _run([0, 1, 2, 3, *ending], stream, _Turns({}, on=False, flip_after=(0,)))
        assert _deltas(out) == "hello world" and _completed(out) == ["hello world"], ending
        assert conversation.final_text() == "hello world"


@pytest.mark.asyncio
async def test_turn_detection_switched_off_releases_what_waited():
    stream = _Stream({0: [TranscriptUpdate("a0", "hi", "", 0.0, 0.1)],
                      1: [TranscriptUpdate("a0", " there", "", 0.0, 0.2)]},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.3, True, "hi there")])
    out, conversation = await _run([0, 1, 2], stream, _Turns({}, flip_after=(0,)))
    assert _deltas(out) == "hi there" and _completed(out) == ["hi there"]


# --- what follows a turn is decided by the settings where the turn ended ---


@pytest.mark.asyncio
async def test_a_turn_is_answered_as_the_settings_said_when_it_ended_not_when_its_commit_landed():
    """A client that reads a turn's `completed` and then sends `session.update` must not change what follows
    that turn: with a slow final pass the update used to land first, and the turn was answered."""
    from runtime.pipeline.response_requests import ResponseRequests
    from runtime.session_config import SessionConfig, TurnDetection
    from runtime.session_state import AnswerActivity, SessionSettings

    silent, answering = (SessionConfig(turn_detection=TurnDetection(create_response=flag)) for flag in (False, True))
    for then, now, asked in ((silent, answering, 0), (answering, silent, 1), (None, answering, 1)):
        questions: BlockingChannel = BlockingChannel(4, "questions")
        requests = ResponseRequests(questions, None, AnswerActivity(), HeardClock(),  # type: ignore[arg-type]
                                    SessionSettings(now), emit=None)  # type: ignore[arg-type]
        await requests.turn_ended("item_1", 1.0, then)
        assert len(questions) == asked, (then, now)


@pytest.mark.asyncio
async def test_the_audio_processor_hands_the_turn_its_own_settings():
    from runtime.session_config import SessionConfig, TurnDetection

    then = SessionConfig(turn_detection=TurnDetection(create_response=False))
    ended: list = []

    class Sink:
        async def turn_ended(self, item_id: str, at: float, settings) -> None:
            ended.append(settings)

        async def idle_timeout(self, item_id: str, at: float, settings) -> None:
            pass

        def speech_started(self) -> None:
            pass

    stream = _Stream({}, [TranscriptUpdate("a0", "", "", 0.0, 0.2, True, "hi")])
    turns = _Turns({0: [TurnEvent(True, 0)], 1: [TurnEvent(False, 2 * STEP, then)]})
    channel: BlockingChannel[AudioChunk | BufferEnd] = BlockingChannel(4, "audio")
    for i in range(3):
        await channel.put(AudioChunk(np.zeros(STEP, np.float32), i * STEP))
    channel.close()

    async def emit(event) -> None:
        pass

    with DeviceWorker() as worker:
        await AudioProcessor(channel, lambda: stream, worker, emit, Conversation(), HeardClock(), ContextChanges(),
                             first_stream=stream, turns=turns, sink=Sink()).run()
    assert ended == [then]


@pytest.mark.asyncio
@pytest.mark.parametrize("gate", [True, False])
async def test_a_turn_starts_where_its_speech_began_not_where_its_buffer_did(gate: bool):
    # the buffer opens at 0 (where the previous turn was committed); the VAD hears speech from 0.3 s: the
    # transcript events and the context line start there, the words written over the silence before included
    stream = _Stream({1: _you(1), 4: [TranscriptUpdate("a0", " red ball", "", 0.0, 0.5)]},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.6, True, "you red ball")])
    turns = _Turns({3: [TurnEvent(True, 3 * STEP)], 5: [TurnEvent(False, 6 * STEP)]})
    out, conversation = await _run([0, 1, 2, 3, 4, 5], stream, turns, gate=gate)
    (item,) = conversation.items
    assert item.start == 0.3 and conversation.context() == "[00:00.3] you red ball"
    starts = [e.start for e in out if e.type.startswith("conversation.item.input_audio")]
    # without the gate, "you" was shown before the speech, at the buffer's start
    assert starts[0] == (0.3 if gate else 0.0) and set(starts[1:]) == {0.3} and len(starts) >= 3


@pytest.mark.asyncio
async def test_without_turn_detection_a_line_is_stamped_at_its_buffers_start():
    stream = _Stream({2: [TranscriptUpdate("a0", "hi", "", 0.0, 0.3)]},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.4, True, "hi")])
    _, conversation = await _run([0, 1, 2, 3], stream, _Turns({}, on=False))
    assert conversation.context() == "[00:00.0] hi"


def _screen_at(start: float) -> Conversation:
    """A conversation holding one screen's line, read at `start` (the screen reader ahead of the ASR)."""
    return Conversation([screen("s", "Budget", start)])


@pytest.mark.asyncio
async def test_a_turn_whose_words_come_only_at_its_commit_still_goes_before_a_later_screen():
    stream = _Stream({}, [TranscriptUpdate("a0", "red ball", "", 0.0, 0.6)])
    turns = _Turns({3: [TurnEvent(True, 3 * STEP)], 5: [TurnEvent(False, 6 * STEP)]})
    _, conversation = await _run([0, 1, 2, 3, 4, 5], stream, turns, conversation=_screen_at(0.4))
    assert conversation.context() == "[00:00.3] red ball\n[00:00.4] On screen: Budget"


@pytest.mark.asyncio
async def test_a_turn_restamped_at_its_speech_moves_past_a_screen_read_before_it():
    stream = _Stream({1: _you(1), 4: [TranscriptUpdate("a0", " red", "", 0.0, 0.5)]},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.6, True, "you red")])
    turns = _Turns({3: [TurnEvent(True, 3 * STEP)], 5: [TurnEvent(False, 6 * STEP)]})
    _, conversation = await _run([0, 1, 2, 3, 4, 5], stream, turns, gate=False, conversation=_screen_at(0.2))
    assert conversation.context() == "[00:00.2] On screen: Budget\n[00:00.3] you red"


@pytest.mark.asyncio
async def test_turn_detection_switched_on_mid_buffer_does_not_restamp_words_heard_before():
    # its first "speech started" is only when it began to listen, not where the words began
    stream = _Stream({1: [TranscriptUpdate("a0", "the board", "", 0.0, 0.2)]},
                     [TranscriptUpdate("a0", "", "", 0.0, 0.6, True, "the board")])
    turns = _Turns({4: [TurnEvent(True, 4 * STEP)]}, on=False, flip_after=(3,))
    out, conversation = await _run([0, 1, 2, 3, 4, 5, BufferEnd()], stream, turns)
    assert conversation.context() == "[00:00.0] the board"
    assert {e.start for e in out if e.type.startswith("conversation.item.input_audio")} == {0.0}


@pytest.mark.asyncio
async def test_a_turn_the_vad_heard_too_little_speech_in_says_nothing():
    # a chord or a click: one loud window starts a turn, but the VAD heard less than MIN_SPEECH_S of speech
    from runtime.pipeline.transcript_gate import MIN_SPEECH_S

    for speech, shown in ((MIN_SPEECH_S - 0.032, []), (MIN_SPEECH_S, ["you"])):
        stream = _Stream({0: _you(0)}, [TranscriptUpdate("a0", "", "", 0.0, 0.3, True, "you")])
        turns = _Turns({1: [TurnEvent(True, STEP)], 2: [TurnEvent(False, 3 * STEP)]}, speech=speech)
        out, conversation = await _run([0, 1, 2, 3], stream, turns)
        assert [e.delta for e in out if e.type.endswith("transcription.delta") and e.delta] == shown, speech
        assert _completed(out) == ["".join(shown)] and conversation.final_text() == "".join(shown)


def test_turn_taking_counts_the_speech_the_vad_heard_since_the_buffer_began():
    from runtime.pipeline.turn_taking import TurnModels, TurnTaking
    from runtime.session_config import SessionConfig, TurnDetection
    from runtime.session_state import AnswerActivity, SessionSettings

    class VAD:  # scripted probabilities: one per 512-sample window
        windows_done = 0

        def accept(self, samples):
            probs = np.array([0.9, 0.2, 0.6, 0.55], np.float32)[: len(samples) // 512]
            self.windows_done += len(probs)
            return probs

    class Models:
        def open_stream(self):
            return VAD()

    turns = TurnTaking(TurnModels(Models()), SessionSettings(SessionConfig(turn_detection=TurnDetection(  # type: ignore[arg-type]
        threshold=0.58))), AnswerActivity())
    turns.detect(AudioChunk(np.zeros(2048, np.float32), 0))
    assert turns.speech_s() == pytest.approx(2 * 512 / SAMPLE_RATE)  # 0.9 and 0.6 reach the threshold
    turns.reset(1024)  # a commit after window 1: the windows from 1024 on count for the next buffer
    assert turns.speech_s() == 0.0
    turns.detect(AudioChunk(np.zeros(2048, np.float32), 2048))
    assert turns.speech_s() == pytest.approx(2 * 512 / SAMPLE_RATE)


class _EndingStream(_Stream):
    """A stream told where the speech ended (`SpeechEnds`): records each point and the audio it had by then."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.ends: list[tuple[int | None, int]] = []
        self.heard_to = 0
        self.read: list[tuple[int, int]] = []  # each chunk read, in chunk indices: (first, past the last)
        self.prepares = True  # whether its final pass is prepared at a speech end (the offline pass's is)

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        assert chunk.start_sample == self.heard_to or not self.read or self.closed, "the audio must be contiguous"
        self.heard_to, self.closed = chunk.end_sample, False  # (the test's next buffer opens the same stream again)
        self.read.append((chunk.start_sample // STEP, chunk.end_sample // STEP))
        return super().accept(chunk)

    def end_speech(self, until_sample: int | None) -> str | None:
        self.ends.append((until_sample, self.heard_to))
        return None if until_sample is None or not self.prepares else f" hi at {until_sample}"


class _PausingSink:
    """Records what the pauses told it (the `TurnSink` calls a pause makes) and the turns that ended."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    async def turn_ended(self, item_id, at, settings) -> None:
        self.log.append(("ended", item_id))

    async def idle_timeout(self, item_id, at, settings) -> None:
        pass

    def speech_started(self) -> None:
        pass

    def turn_may_end(self, item_id: str, transcript: str) -> None:
        self.log.append(("may end", item_id, transcript))

    def turn_goes_on(self) -> None:
        self.log.append(("goes on",))


TAIL = round(FINAL_TAIL_S * SAMPLE_RATE)


@pytest.mark.asyncio
async def test_a_pause_prepares_the_final_pass_and_speech_that_goes_on_undoes_it():
    final = [TranscriptUpdate("a0", "", "", 0.0, 1.0, True, "hi there")]
    # a pause from chunk 2 that speech ends at chunk 5; one from chunk 7 that the rule ends at chunk 12
    stream = _EndingStream({}, final)
    turns = _Turns({0: [TurnEvent(True, 0)], 12: [TurnEvent(False, 7 * STEP)]},
                   pauses={2: 2 * STEP, 5: None, 7: 7 * STEP, 12: None})
    sink = _PausingSink()
    out, conversation = await _run(list(range(14)), stream, turns, sink=sink)
    assert stream.ends == [(2 * STEP + TAIL, 4 * STEP), (None, 6 * STEP), (7 * STEP + TAIL, 9 * STEP)]
    assert _completed(out) == ["hi there"]  # the commit found its point given: nothing given twice
    item = out[0].item_id
    assert sink.log == [("may end", item, f"hi at {2 * STEP + TAIL}"), ("goes on",),
                        ("may end", item, f"hi at {7 * STEP + TAIL}"), ("ended", item)]
    # once prepared, the pause's chunks wait: read as one with the chunk where speech resumed, never at the commit
    assert stream.read == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6), (6, 7), (7, 8), (8, 9), (13, 14)]


@pytest.mark.asyncio
async def test_a_commit_in_a_prepared_pause_leaves_its_silence_unread_and_an_unprepared_stream_reads_it_all():
    for prepares in (True, False):
        stream = _EndingStream({}, [TranscriptUpdate("a0", "", "", 0.0, 1.0, True, "hi")])
        stream.prepares = prepares
        turns = _Turns({0: [TurnEvent(True, 0)]}, pauses={2: 2 * STEP})
        out, conversation = await _run([0, 1, 2, 3, 4, 5, BufferEnd()], stream, turns)  # the client's commit
        assert stream.ends == [(2 * STEP + TAIL, 4 * STEP)]
        assert stream.read == ([(0, 1), (1, 2), (2, 3), (3, 4)] if prepares else [(i, i + 1) for i in range(6)])
        assert _completed(out) == ["hi"] and conversation.final_text() == "hi"


@pytest.mark.asyncio
async def test_a_commit_by_turn_detection_gives_the_speech_end_first_when_the_pause_did_not():
    """The pause never seen between two chunks (as when chunks are as long as the rule's silence): the commit gives
    the point itself, the same the pause would have, before the final pass; a rule shorter than the tail gives the
    end of the audio heard."""
    stream = _EndingStream({}, [TranscriptUpdate("a0", "", "", 0.0, 1.0, True, "hi")])
    turns = _Turns({0: [TurnEvent(True, 0)], 6: [TurnEvent(False, 2 * STEP + 50)]})
    sink = _PausingSink()
    out, _ = await _run(list(range(8)), stream, turns, sink=sink)
    assert stream.ends == [(2 * STEP + 50 + TAIL, 7 * STEP)]
    assert sink.log == [("ended", out[0].item_id)]  # the turn ends anyway: nothing to prepare
    assert _completed(out) == ["hi"]
    stream = _EndingStream({}, [TranscriptUpdate("a0", "", "", 0.0, 1.0, True, "hi")])
    turns = _Turns({0: [TurnEvent(True, 0)], 3: [TurnEvent(False, 3 * STEP + 50)]})
    await _run(list(range(5)), stream, turns)
    assert stream.ends == [(4 * STEP, 4 * STEP)]


@pytest.mark.asyncio
async def test_a_stream_without_the_capability_finishes_on_all_its_audio():
    stream = _Stream({}, [TranscriptUpdate("a0", "", "", 0.0, 1.0, True, "hi")])
    turns = _Turns({0: [TurnEvent(True, 0)], 8: [TurnEvent(False, 2 * STEP)]}, pauses={2: 2 * STEP, 8: None})
    out, _ = await _run(list(range(10)), stream, turns)
    assert _completed(out) == ["hi"]
