"""`runtime bench serve --conversations --quick --json` holds real multi-turn voice conversations (the official
openai SDK, server VAD) against a real server process and prints one JSON object: every turn answered, nothing
lost, no session left after the abrupt disconnects. Timing is not asserted (the machine is shared and noisy),
only that the numbers are there and consistent. The latency and loss accounting is checked on scripted
timestamps, and the sentence cuts against Silero VAD."""

import json

import numpy as np
import pytest
from cli_common import one_error_line, run_cli

from runtime.bench import demo_sentences
from runtime.bench.turn_accounting import Ev, TurnMarks, account, summarize

# paced in real time with time-outs: `make test` runs these alone, after the rest (docs/testing.md)
pytestmark = pytest.mark.realtime


@pytest.mark.slow
def test_bench_serve_conversations_quick_json(capsys):
    code, out, _ = run_cli(capsys, "bench", "serve", "--conversations", "--quick", "--json", "-q")
    assert code == 0
    assert len(out.strip().splitlines()) == 1
    result = json.loads(out)
    for key in ("rows", "faults", "sequential", "machine", "n_sessions", "turns_per_session", "lost",
                "turns_answered_equals_spoken", "sessions_left_at_end", "random_weights"):
        assert key in result, key
    assert result["n_sessions"] == [1, 2] and result["turns_per_session"] == 2
    assert [row["n"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        loss, n = row["loss"], row["n"]
        assert loss["turns_spoken"] == n * 2 == loss["turns_answered"] and loss["missed"] == 0
        assert loss["lost"] == 0 and loss["sessions_failed"] == 0 and loss["errors"] == {}
        assert loss["transcripts_not_once"] == loss["items_done_not_once"] == loss["responses_not_done_once"] == 0
        assert loss["committed"] >= loss["turns_spoken"] and loss["responses_created"] >= loss["turns_answered"]
        for key in ("turn_latency_ms", "speech_stopped_ms", "response_created_ms", "answer_after_stop_ms"):
            stats = row[key]
            with_text = key in ("turn_latency_ms", "answer_after_stop_ms")
            assert stats["n"] == loss["turns_spoken"] - with_text * loss["turns_without_text"]
            assert 0 < stats["p50"] <= stats["p95"] <= stats["max"]
        # the VAD needs its 500 ms of silence before it may stop the turn; the answer starts after the stop
        assert row["speech_stopped_ms"]["p50"] >= 400
        assert row["response_created_ms"]["p50"] >= row["speech_stopped_ms"]["p50"]
        assert row["answer_after_stop_ms"]["p50"] < row["turn_latency_ms"]["p50"]
        assert len(row["sessions"]) == n and row["sessions_left_after"] == 0
    faults = result["faults"]
    assert faults["disconnects"] == 10 == faults["opened"] and sum(faults["by_kind"].values()) == 10
    assert faults["sessions_left"] == 0 and faults["server_alive"] and faults["after_disconnects_ok"]
    assert faults["client_errors"] == []
    sequential = result["sequential"]
    assert sequential["turns"] == 10 == sequential["turns_answered"] == sequential["turns_spoken"]
    assert sequential["lost"] == 0
    assert result["lost"] == 0 and result["turns_answered_equals_spoken"] and result["sessions_left_at_end"] == 0
    assert result["machine"]["cpu_count"] >= 1


def test_conversations_is_a_mode_of_serve_only(capsys):
    code, _, err = run_cli(capsys, "bench", "asr", "--quick", "--conversations")
    assert code != 0 and "--conversations" in one_error_line(err)


def _turn(at: float, item: str, resp: str, status: str = "incomplete", delta: bool = True) -> list[Ev]:
    """A turn's server events from `at` (its speech_stopped) on: commit, transcript, answer."""
    events = [Ev(at, "input_audio_buffer.speech_stopped", item_id=item),
              Ev(at, "input_audio_buffer.committed", item_id=item),
              Ev(at + 0.01, "conversation.item.input_audio_transcription.completed", item_id=item),
              Ev(at + 0.01, "conversation.item.done", item_id=item, role="user"),
              Ev(at + 0.1, "response.created", response_id=resp, status="in_progress")]
    if delta:
        events += [Ev(at + 0.15, "response.output_text.delta", response_id=resp),
                   Ev(at + 0.16, "response.output_text.delta", response_id=resp)]
    events += [Ev(at + 0.2, "conversation.item.done", item_id=f"{resp}_out", role="assistant"),
               Ev(at + 0.2, "response.done", response_id=resp, status=status)]
    return [Ev(at - 2.0, "input_audio_buffer.speech_started", item_id=item)] + events


def test_latency_accounting_on_scripted_timestamps():
    turns = [TurnMarks(0, first_sent=0.0, speech_end_sent=2.6), TurnMarks(1, first_sent=3.5, speech_end_sent=6.5),
             TurnMarks(2, first_sent=10.0, speech_end_sent=12.0)]
    events = (_turn(3.2, "item_1", "resp_1")  # speech_stopped 0.6 s after the end of speech
              + _turn(7.3, "item_2", "resp_2", status="completed", delta=False)  # answered, no text
              + _turn(12.5, "item_3", "resp_3", status="cancelled"))  # never answered: a miss
    # the finish commits the trailing silence: an item with its transcript and its item.done, no response
    events += [Ev(20.0, "input_audio_buffer.committed", item_id="item_4"),
               Ev(20.1, "conversation.item.input_audio_transcription.completed", item_id="item_4"),
               Ev(20.1, "conversation.item.done", item_id="item_4", role="user")]
    a = account(turns, events)
    assert np.allclose(a.speech_stopped, [0.6, 0.8, 0.5])
    assert np.allclose(a.response_created, [0.7, 0.9, 0.6])
    assert np.allclose(a.first_delta, [0.75, 0.65])  # turn 2 had none; turn 3's counts though it was cancelled
    assert np.allclose(a.after_stop, [0.15, 0.15])
    c = a.counts
    assert (c["turns_spoken"], c["turns_answered"], c["missed"], c["turns_without_text"]) == (3, 2, 1, 1)
    assert (c["committed"], c["transcripts_not_once"], c["items_done_not_once"]) == (4, 0, 0)
    assert (c["responses_created"], c["responses_not_done_once"], c["responses_cancelled"]) == (3, 0, 1)
    assert c["extra_responses"] == 0 and c["sessions_failed"] == 0
    row = summarize([a, account(turns[:1], _turn(3.0, "item_9", "resp_9"))])
    assert row["turn_latency_ms"]["n"] == 3 and row["turn_latency_ms"]["max"] == 750.0
    assert row["turn_latency_ms"]["p50"] == 650.0 and row["response_created_ms"]["n"] == 4
    assert row["speech_stopped_ms"]["p95"] == round(float(np.percentile([600, 800, 500, 400], 95)), 2)
    assert row["loss"]["lost"] == 1 and row["loss"]["turns_spoken"] == 4 and row["loss"]["errors"] == {}


def test_loss_accounting_counts_what_is_missing_or_doubled():
    turns = [TurnMarks(0, first_sent=0.0, speech_end_sent=1.0)]
    events = _turn(1.6, "item_1", "resp_1")
    events += [Ev(1.9, "conversation.item.input_audio_transcription.completed", item_id="item_1"),  # twice
               Ev(2.0, "input_audio_buffer.committed", item_id="item_2"),  # no transcript, no item.done
               Ev(2.1, "response.created", response_id="resp_2"),  # a second response in the turn, never done
               Ev(2.2, "response.done", response_id="resp_x", status="completed"),  # done, never created
               Ev(2.3, "error", code="response_failed")]
    a = account(turns, events, failed=True)
    c = a.counts
    assert (c["turns_answered"], c["missed"], c["extra_responses"]) == (1, 0, 1)
    assert (c["transcripts_not_once"], c["items_done_not_once"], c["responses_not_done_once"]) == (2, 1, 2)
    assert c["sessions_failed"] == 1 and dict(a.errors) == {"response_failed": 1}
    assert summarize([a])["loss"]["lost"] == 2 + 1 + 2 + 1
    # a turn's events run from its end of speech to the next turn's first chunk: one received before the end of
    # speech (while speaking) belongs to no turn
    two = [TurnMarks(0, 0.0, 2.0), TurnMarks(1, 3.0, 5.0)]
    a = account(two, [Ev(1.5, "input_audio_buffer.speech_stopped"), Ev(3.1, "response.created", response_id="r0"),
                      Ev(5.2, "response.created", response_id="r1")])
    assert a.speech_stopped == [] and np.allclose(a.response_created, [0.2]) and a.counts["missed"] == 2


def test_sentences_end_where_silero_vad_says_speech_ends():
    from runtime.models.turns.silero_vad import WINDOW_SAMPLES, SileroVAD

    pool = demo_sentences.sentences()
    assert len(pool) == 4
    vad = SileroVAD.load()
    for s in pool:
        assert len(s.samples) == len(s.chunks) * demo_sentences.CHUNK_16K
        assert all(len(c) == len(demo_sentences.SILENCE) for c in s.chunks)  # 100 ms of 24 kHz PCM16 each
        end = round((s.speech_end_s - s.start_s) * demo_sentences.SAMPLE_RATE)
        assert s.speech_end_chunk == (end - 1) // demo_sentences.CHUNK_16K and not s.samples[end:].any()
        probs = vad.open_stream().accept(np.concatenate([s.samples, np.zeros(demo_sentences.SAMPLE_RATE, np.float32)]))
        speech = np.flatnonzero(probs >= 0.5)
        assert len(speech) and speech[0] * WINDOW_SAMPLES < end  # speech starts before the found end
        after = (end + demo_sentences.SAMPLE_RATE // 10) // WINDOW_SAMPLES + 1  # 100 ms on: silence for the server
        assert (probs[after:] < 0.35).all()
        quiet = probs[speech[0] : end // WINDOW_SAMPLES] < 0.35
        longest = max((len(run) for run in "".join("x" if q else " " for q in quiet).split()), default=0)
        assert longest * WINDOW_SAMPLES < 0.5 * demo_sentences.SAMPLE_RATE  # no pause within a sentence ends a turn
