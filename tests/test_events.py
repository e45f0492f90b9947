"""One event schema: every event serialises to JSON and parses back to itself."""

import json

import pytest

from runtime.events import (
    AudioBufferCleared,
    AudioBufferCommitted,
    AudioBufferTimeout,
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    ItemAdded,
    ItemDeleted,
    ItemDone,
    ItemRetrieved,
    ItemTruncated,
    Metrics,
    OutputAudioBufferCleared,
    OutputAudioBufferStarted,
    OutputAudioBufferStopped,
    OutputItemAdded,
    OutputItemDone,
    ResponseAudioDelta,
    ResponseAudioDone,
    ResponseAudioTranscriptDelta,
    ResponseAudioTranscriptDone,
    ResponseCreated,
    ResponseDone,
    ResponseTextDelta,
    ResponseTextDone,
    ScreenText,
    SessionCreated,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    TranscriptionCompleted,
    TranscriptionDelta,
    VideoNote,
    error_event,
    event_types,
    parse_event,
)

SAMPLES = [
    SessionCreated(session={"id": "sess_1"}),
    SessionUpdated(session={"id": "sess_1", "output_modalities": ["text"]}),
    AudioBufferCommitted(item_id="item_1", previous_item_id=None, media_time=2.0),
    AudioBufferCleared(media_time=2.0),
    AudioBufferTimeout(item_id="item_3", audio_start_ms=4000, audio_end_ms=10000),
    SpeechStarted(item_id="item_1", audio_start_ms=120),
    SpeechStopped(item_id="item_1", audio_end_ms=2100),
    ItemAdded(item={"id": "item_1", "type": "message", "role": "user", "content": []}, previous_item_id=None),
    ItemDone(item={"id": "item_1", "type": "message", "role": "user", "content": []}, previous_item_id="item_0"),
    ItemDeleted(item_id="item_1"),
    ItemTruncated(item_id="item_2", content_index=0, audio_end_ms=0),
    ItemRetrieved(item={"id": "item_1", "type": "message", "role": "user", "content": []}),
    OutputItemAdded(response_id="resp_1", item={"id": "item_2", "type": "message", "role": "assistant"}),
    OutputItemDone(response_id="resp_1", item={"id": "item_2", "type": "message", "role": "assistant"}),
    ContentPartAdded(response_id="resp_1", item_id="item_2", part={"type": "text", "text": ""}),
    ContentPartDone(response_id="resp_1", item_id="item_2", part={"type": "text", "text": "Hi"}),
    TranscriptionDelta(item_id="item_1", delta="hello ", unstable="wor", start=0.0, end=1.2, media_time=1.2),
    TranscriptionCompleted(item_id="item_1", transcript="hello world", start=0.0, end=2.0, media_time=2.0),
    ResponseCreated(response={"id": "resp_1", "status": "in_progress"}),
    ResponseTextDelta(response_id="resp_1", item_id="item_2", delta="Hi"),
    ResponseTextDone(response_id="resp_1", item_id="item_2", text="Hi"),
    ResponseAudioTranscriptDelta(response_id="resp_1", item_id="item_5", delta="Hello"),
    ResponseAudioDelta(response_id="resp_1", item_id="item_5", delta="AAAA"),
    ResponseAudioDone(response_id="resp_1", item_id="item_5"),
    ResponseAudioTranscriptDone(response_id="resp_1", item_id="item_5", transcript="Hello"),
    OutputAudioBufferStarted(response_id="resp_1"),
    OutputAudioBufferStopped(response_id="resp_1"),
    OutputAudioBufferCleared(response_id="resp_1"),
    FunctionCallArgumentsDelta(response_id="resp_1", item_id="item_4", output_index=1, call_id="call_1",
                               delta='{"city": '),
    FunctionCallArgumentsDone(response_id="resp_1", item_id="item_4", output_index=1, call_id="call_1",
                              name="get_weather", arguments='{"city": "Paris"}'),
    ResponseDone(response={"id": "resp_1", "status": "completed"}),
    Metrics(metrics={"loop_lag": {"max_ms": 1.0}}),
    ScreenText(screen_id="screen_0", text="Budget | - Lisbon", lines=[{"text": "Budget", "box": [0.1, 0.1, 0.4, 0.2],
               "confidence": 0.98, "first_seen": 1.0, "last_seen": 3.0}], start=1.0, end=3.0, media_time=3.0),
    VideoNote(segment_id=3, text="a red ball rolls", start=10.0, end=20.0, media_time=20.0),
    error_event("bad", code="empty_question", param="text", client_event_id="evt_c"),
]


def test_every_event_type_is_covered():
    assert sorted(e.type for e in SAMPLES) == event_types()


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.type)
def test_round_trip(event):
    line = event.to_json()
    assert "\n" not in line
    data = json.loads(line)
    assert data["type"] == event.type and data["event_id"].startswith("evt_")
    assert isinstance(data["wall_time"], float) and "media_time" in data
    assert parse_event(line) == event


def test_openai_realtime_names_and_error_shape():
    err = error_event("the question is empty", code="empty_question", param="text", client_event_id="evt_9")
    data = err.to_dict()
    assert data["type"] == "error"
    assert data["error"] == {"type": "invalid_request_error", "code": "empty_question",
                             "message": "the question is empty", "param": "text", "event_id": "evt_9"}
    assert TranscriptionDelta.type == "conversation.item.input_audio_transcription.delta"
    assert ResponseTextDelta.type == "response.output_text.delta"


def test_parse_rejects_garbage():
    for bad in ['{"type": "nope"}', '[]', '{"type": "response.done", "response": {}, "extra": 1}']:
        with pytest.raises(ValueError):
            parse_event(bad)
