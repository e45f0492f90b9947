"""What an answer says about itself on the wire: the ids that tie its events together, its status and reason for
each way it can end, its usage and timing, and that a failed or cancelled answer costs nothing else."""

import asyncio
import time

import numpy as np
import pytest
import torch
from session_fakes import (
    EchoAnswer,
    EchoAnswerer,
    StreamingEchoAnswerer,
    StreamState,
    WordASR,
    audio_chunks,
    collect,
    profile_for,
)

from runtime.chunks import VideoFrame
from runtime.config import with_overrides
from runtime.loaded_models import Models
from runtime.models.lm import AnswerStep
from runtime.session_builder import open_session


class CountingAnswer(EchoAnswer):
    """Echo, with speculative-decoding counters, ending for length after `limit` characters."""

    def __init__(self, answerer: EchoAnswerer, text: str, limit: int | None) -> None:
        super().__init__(answerer, text)
        self.limit = limit

    def step(self) -> AnswerStep:
        step = super().step()
        if self.limit is not None and self.i == self.limit:
            return AnswerStep(step.delta, True, "length", 2)
        return AnswerStep(step.delta, step.done, step.finish_reason, 2)

    def stats(self) -> dict[str, float | int | list[float]]:
        return {"steps": self.i, "accepted_per_step": 2.0}


class CountingAnswerer(EchoAnswerer):
    def __init__(self, limit: int | None = None, fail_at: int | None = None) -> None:
        super().__init__()
        self.limit, self.fail_at = limit, fail_at

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> EchoAnswer:
        if question == "explode":
            raise RuntimeError("the model fell over")
        return CountingAnswer(self, super().start(context, question).text, self.limit)


async def _answer(worker, answerer, *questions, client_event_id=None):
    session = await (await open_session(profile_for(), Models(WordASR(per_item=2), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(3):
        await session.push_audio(chunk)
    ids = [await session.ask(q, media_time=0.25, client_event_id=client_event_id, wait=True) for q in questions]
    await session.finish()
    return ids, await events


def _by_response(events, response_id):
    return [e for e in events if getattr(e, "response_id", None) == response_id
            or (e.type in ("response.created", "response.done") and e.response["id"] == response_id)]


@pytest.mark.asyncio
async def test_a_completed_answer_ties_its_events_together_and_reports_usage_and_timing(worker):
    (rid,), events = await _answer(worker, CountingAnswerer(), "q")
    mine = _by_response(events, rid)
    # the Realtime API's response lifecycle, in its order; the answer also joins the conversation
    assert [e.type for e in mine] == ["response.created", "response.output_item.added", "response.content_part.added"
                                      ] + ["response.output_text.delta"] * 5 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.done"]
    created, item_added, part_added, *deltas, text_done, part_done, item_done, done = mine
    assert created.response == {"id": rid, "object": "realtime.response", "status": "in_progress", "output": [],
                                "conversation_id": "auto", "output_modalities": ["text"], "max_output_tokens": "inf",
                                "metadata": None, "question": "q"}
    assert item_added.item["status"] == "in_progress" and item_done.item["status"] == "completed"
    assert part_added.part == {"type": "text", "text": ""} and part_done.part == {"type": "text", "text": "q->w2"}
    item_ids = {e.item_id for e in [*deltas, text_done, part_added, part_done]} | {item_added.item["id"]}
    assert len(item_ids) == 1 and next(iter(item_ids)).startswith("item_")
    assert all(e.media_time == 0.25 for e in mine)  # every event of the answer carries the question's media time
    assert "".join(d.delta for d in deltas) == text_done.text == "q->w2"  # w2 ends at 0.3 s, after 0.25 s
    r = done.response
    assert (r["id"], r["object"], r["status"], r["status_details"], r["question"]) == (
        rid, "realtime.response", "completed", None, "q")
    assert r["output"] == [{"id": next(iter(item_ids)), "object": "realtime.item", "type": "message",
                            "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": "q->w2"}]}]
    # each step reported two tokens; the fake's prompt is three tokens
    assert r["usage"] == {"total_tokens": 3 + 2 * 5, "input_tokens": 3, "output_tokens": 2 * 5, "decode_steps": 5}
    # the question and its answer joined the conversation, after what was heard
    conversation = [e for e in events if e.type == "conversation.item.done"]
    said = [(e.item["role"], e.item["content"][0].get("text")) for e in conversation]
    assert said[:2] == [("user", "q"), ("assistant", "q->w2")]  # the spoken item completes at the end of input
    assert r["decoding"] == {"steps": 5, "accepted_per_step": 2.0}
    assert 0 < r["timing"]["first_token_s"] <= r["timing"]["total_s"] < 30
    assert "video" not in r  # no video memory, so no selection to report






class TimedAnswerer(EchoAnswerer):
    """Echo, noting the wall time at which its answer was started and at which its last step ended."""

    def __init__(self, step_s: float) -> None:
        super().__init__(step_s)
        self.started = self.last_step = 0.0

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> EchoAnswer:
        self.started = time.perf_counter()
        answer = super().start(context, question)
        step = answer.step

        def timed_step():
            out = step()
            self.last_step = time.perf_counter()
            return out

        answer.step = timed_step
        return answer


@pytest.mark.asyncio
async def test_total_time_runs_from_the_question_to_the_answers_end_and_the_context_is_a_line_per_item(worker):
    answerer = TimedAnswerer(step_s=0.03)
    session = await (await open_session(profile_for(), Models(WordASR(per_item=2), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for chunk in audio_chunks(3):
        await session.push_audio(chunk)
    asked = time.perf_counter()
    await session.ask("q", media_time=0.25, wait=True)  # returns once response.done is out
    answered = time.perf_counter()
    await session.finish()
    timing = next(e for e in await events if e.type == "response.done").response["timing"]
    # The ASR's items fold into the buffer's one user item, stamped with its start.
    assert answerer.contexts == ["[00:00.0] w0 w1 w2"]
    # The answer spelled "q->w2" in 5 steps of 30 ms, all between the question and its response.done.
    assert answerer.last_step - answerer.started >= 5 * 0.03
    assert answerer.last_step - answerer.started - 1e-4 <= timing["total_s"] <= answered - asked + 1e-4
    assert 0 < timing["first_token_s"] <= timing["total_s"]


class ColourEncoder:
    """A vision model a test can predict: every token of a frame is its top-left pixel's RGB, in the first three
    of 8 channels (the tiny profile's 4x4 grid: 16 tokens)."""

    dim, dtype = 8, torch.float32

    def encode(self, images) -> torch.Tensor:
        out = torch.zeros(len(images), 16, self.dim)
        for i, image in enumerate(images):
            out[i, :, :3] = torch.tensor(image[0, 0].astype(np.float32))
        return out


class VideoStreamState(StreamState):
    """The echo stream, taking the memory suffix a seeing model is handed after the transcript."""

    def set_context(self, text: str, suffix=None) -> None:
        super().set_context(text)


class GreenAnswerer(StreamingEchoAnswerer):
    """Embeds every question as "green" (channel 1), so it selects the segments whose frames are greenest."""

    def __init__(self) -> None:
        super().__init__()
        self.embedded: list[str] = []

    def open_stream(self) -> VideoStreamState:
        return VideoStreamState()

    def embed_text(self, text: str) -> torch.Tensor:
        self.embedded.append(text)
        return torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.asyncio
async def test_a_question_selects_the_video_segments_its_embedding_points_at(worker):
    # 4 s segments at 1 fps: 0-3 yellow (cosine with green 0.71), 4-7 green (1.0), 8-11 red (0, still open).
    # The tiny profile selects retrieved_frames = 2 segments: the green and the yellow one, in time order.
    profile = with_overrides(profile_for(), video={"notes": False})
    answerer = GreenAnswerer()
    session = await (await open_session(profile, Models(WordASR(), answerer, ColourEncoder()), worker)).start()
    events = asyncio.create_task(collect(session))
    for t in range(12):
        colour = (1, 1, 0) if t < 4 else (0, 1, 0) if t < 8 else (1, 0, 0)
        assert session.push_video(VideoFrame(np.full((4, 4, 3), colour, np.uint8), float(t)))
        await session.video_settled()  # one frame at a time: none dropped
    await session.ask("what is green?", media_time=12.0, wait=True)
    await session.finish()
    done = next(e for e in await events if e.type == "response.done").response
    assert session.video_memory.snapshot().frames_seen == 12
    assert answerer.embedded and set(answerer.embedded) == {"what is green?"}  # a background round may embed again
    assert done["video"] == {"selected_segments": [[0.0, 3.0], [4.0, 7.0]]}


@pytest.mark.asyncio
async def test_cancel_names_the_answer_it_stops(worker):
    session = await (await open_session(profile_for(), Models(WordASR(), EchoAnswerer(step_s=0.02)), worker)).start()
    events = asyncio.create_task(collect(session))
    assert not session.cancel_response()  # nothing to cancel yet
    rid = await session.ask("a question long enough to cancel midway")
    while session.answers.current is None:
        await asyncio.sleep(0.005)
    assert not session.cancel_response("resp_someone_else")
    assert session.cancel_response(rid)
    await session.finish()
    done = next(e for e in await events if e.type == "response.done")
    assert done.response["status"] == "cancelled"
    assert done.response["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert session.answers.answered == 1 and session.answers.current is None


class ScriptedAnswerer:
    """Plays a script of steps per answer (one script per question, in order); `fail_start` raises in `start`,
    `fail_step` raises at that step index. Counts releases; `stats` returns `decoding`."""

    name = "scripted"

    def __init__(self, *scripts: list[AnswerStep], fail_start: bool = False, fail_step: int | None = None,
                 decoding: dict | None = None) -> None:
        self.scripts, self.fail_start, self.fail_step, self.decoding = list(scripts), fail_start, fail_step, decoding
        self.released = 0
        self.steps_taken = 0

    def open_stream(self) -> None:
        return None

    def start(self, context, question, *, seed=None, stream=None, suffix=None, max_tokens=None) -> "ScriptedAnswer":
        if self.fail_start:
            raise RuntimeError("out of memory")
        return ScriptedAnswer(self, self.scripts.pop(0))

    def embed_text(self, text: str) -> None:
        return None


class ScriptedAnswer:
    prompt_ids: list[int] = [1, 2, 3]  # noqa: RUF012 - read only
    def __init__(self, model: ScriptedAnswerer, script: list[AnswerStep]) -> None:
        self.model, self.script, self.i = model, script, 0

    def step(self) -> AnswerStep:
        if self.i == self.model.fail_step:
            raise RuntimeError("bad step")
        self.i += 1
        self.model.steps_taken += 1
        return self.script[self.i - 1]

    def release(self) -> None:
        self.model.released += 1

    def stats(self) -> dict | None:
        return self.model.decoding


async def _answer_events(worker, answerer, *questions: tuple[str, float]) -> list:
    session = await (await open_session(profile_for(), Models(WordASR(), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    for text, at in questions:
        await session.ask(text, media_time=at, wait=True)
    await session.finish()
    return await events


@pytest.mark.asyncio
async def test_an_answer_cut_at_max_tokens_is_incomplete_with_its_usage(worker):
    steps = [AnswerStep("ab", False, None, tokens=2), AnswerStep("", False, None, tokens=1),
             AnswerStep("c", True, "length", tokens=3)]
    out = await _answer_events(worker, ScriptedAnswerer(steps, decoding={"target_forwards": 3}), ("  why?  ", 0.7))
    created = next(e for e in out if e.type == "response.created")
    deltas = [e for e in out if e.type == "response.output_text.delta"]
    text_done = next(e for e in out if e.type == "response.output_text.done")
    done = next(e for e in out if e.type == "response.done")
    rid = created.response["id"]
    assert created.response == {"id": rid, "object": "realtime.response", "status": "in_progress", "output": [],
                                "conversation_id": "auto", "output_modalities": ["text"], "max_output_tokens": "inf",
                                "metadata": None, "question": "why?"}
    assert [d.delta for d in deltas] == ["ab", "c"]  # an empty delta (a partial character) is not emitted
    item = deltas[0].item_id
    assert item.startswith("item_") and rid.startswith("resp_")
    assert {d.item_id for d in deltas} == {item} and text_done.item_id == item and text_done.text == "abc"
    assert {d.response_id for d in deltas} == {rid} and text_done.response_id == rid and done.response["id"] == rid
    r = done.response
    assert r["status"] == "incomplete" and r["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert r["usage"] == {"total_tokens": 9, "input_tokens": 3, "output_tokens": 6, "decode_steps": 3}
    assert r["output"] == [{"id": item, "object": "realtime.item", "type": "message", "role": "assistant",
                            "status": "incomplete", "content": [{"type": "output_text", "text": "abc"}]}]
    assert r["decoding"] == {"target_forwards": 3} and "video" not in r
    assert 0 <= r["timing"]["first_token_s"] <= r["timing"]["total_s"]
    assert {e.media_time for e in (created, *deltas, text_done, done)} == {0.7}
    assert out[-1].metrics["answers"]["answered"] == 1


@pytest.mark.asyncio
async def test_a_completed_answer_has_no_status_details_and_no_decoding_stats(worker):
    out = await _answer_events(worker, ScriptedAnswerer([AnswerStep("ok", True, "stop")]), ("q", 0.0))
    r = next(e for e in out if e.type == "response.done").response
    assert r["status"] == "completed" and r["status_details"] is None and "decoding" not in r
    assert r["usage"] == {"total_tokens": 4, "input_tokens": 3, "output_tokens": 1, "decode_steps": 1}


@pytest.mark.asyncio
async def test_a_question_the_answerer_refuses_is_the_clients_error_without_a_traceback(worker, caplog):
    """A question and instructions too long for the engine (or a schema it cannot use) is for the client to fix:
    an `invalid_request_error` with the refusal's own code, not a server failure with a logged traceback."""
    from runtime.errors import PromptTooLong

    class Refusing(ScriptedAnswerer):
        def start(self, *args, **kwargs):
            raise PromptTooLong("the question and the response's instructions need 924 prompt tokens, more than the "
                                "engine's 256; shorten them")

    out = await _answer_events(worker, Refusing([AnswerStep("never", True, "stop")]), ("q", 0.2))
    error = next(e for e in out if e.type == "error").error
    assert (error["type"], error["code"]) == ("invalid_request_error", "prompt_too_long")
    assert error["message"].startswith("the question and the response's instructions need 924")
    done = next(e for e in out if e.type == "response.done").response
    assert done["status"] == "failed" and done["status_details"]["error"]["type"] == "invalid_request_error"
    assert "answer failed" not in caplog.text


@pytest.mark.asyncio
async def test_an_answer_that_fails_to_start_is_failed_and_the_next_question_is_answered(worker):
    answerer = ScriptedAnswerer([AnswerStep("fine", True, "stop")], fail_start=True)
    session = await (await open_session(profile_for(), Models(WordASR(), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    await session.ask("first", media_time=0.3, client_event_id="c1", wait=True)
    answerer.fail_start = False
    await session.ask("second", wait=True)
    await session.finish()
    out = await events
    errors = [e for e in out if e.type == "error"]
    assert len(errors) == 1 and errors[0].media_time == 0.3
    assert errors[0].error == {"type": "server_error", "code": "response_failed", "event_id": "c1", "param": None,
                               "message": "answering failed: out of memory"}
    first, second = [e.response for e in out if e.type == "response.done"]
    assert first["status"] == "failed" and first["status_details"] == {
        "type": "failed", "error": {"type": "server_error", "code": "response_failed", "message": "out of memory"}}
    assert first["usage"] == {"total_tokens": 0, "input_tokens": 0, "output_tokens": 0, "decode_steps": 0}
    assert first["timing"]["first_token_s"] is None
    assert "decoding" not in first and "video" not in first  # no counters from an answer that never started
    assert first["output"] == []  # a response that failed before saying anything adds no item
    assert second["status"] == "completed" and second["output"][0]["content"][0]["text"] == "fine"
    # the failed question was not recorded either: only the answered one joins the conversation, with its answer
    assert [(it.role, it.text) for it in session.conversation.items] == [("user", "second"), ("assistant", "fine")]
    assert answerer.released == 1  # only the answer that started holds state to release
    assert out[-1].metrics["answers"]["answered"] == 2 and session.activity.open == 0


@pytest.mark.asyncio
async def test_an_answer_failing_mid_decode_keeps_its_text_and_releases_its_state(worker):
    steps = [AnswerStep("ab", False, None), AnswerStep("cd", False, None), AnswerStep("e", True, "stop")]
    answerer = ScriptedAnswerer(steps, fail_step=2)
    out = await _answer_events(worker, answerer, ("q", 0.0))
    assert "".join(e.delta for e in out if e.type == "response.output_text.delta") == "abcd"
    assert next(e for e in out if e.type == "response.output_text.done").text == "abcd"
    r = next(e for e in out if e.type == "response.done").response
    assert r["status"] == "failed" and r["usage"] == {"total_tokens": 5, "input_tokens": 3, "output_tokens": 2,
                                                    "decode_steps": 2}
    assert answerer.released == 1


@pytest.mark.asyncio
async def test_the_question_queue_takes_exactly_its_capacity(worker):
    session = await (await open_session(profile_for(question_queue=2), Models(WordASR(), EchoAnswerer(step_s=0.01)),
                                        worker)).start()
    events = asyncio.create_task(collect(session))
    ids = [await session.ask(f"q{i}", client_event_id=f"c{i}") for i in range(4)]  # no yield: none taken yet
    assert [i is not None for i in ids] == [True, True, False, False]
    assert session.activity.open == 2  # a refused question is not waited for
    await session.finish()
    assert await session.ask("late", client_event_id="c-late") is None
    out = await events
    refused = [e.error for e in out if e.type == "error"]
    assert [(e["code"], e["event_id"]) for e in refused] == [("question_queue_full", "c2"),
                                                             ("question_queue_full", "c3")]
    assert [e.media_time for e in out if e.type == "error"] == [0.0, 0.0]
    assert refused[0]["message"] == "question queue is full (2 waiting); ask again after the current answer"
    assert [e.response["id"] for e in out if e.type == "response.done"] == ids[:2]
    assert session.activity.open == 0


@pytest.mark.asyncio
async def test_a_question_after_the_end_is_refused_as_closed(worker):
    session = await (await open_session(profile_for(), Models(WordASR(), EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
    session.questions.close()
    assert await session.ask("late", media_time=2.5, client_event_id="c9") is None
    await session.finish()
    err = next(e for e in await events if e.type == "error")
    assert err.error["message"] == "question queue is closed; ask again after the current answer"
    assert err.error["event_id"] == "c9" and err.media_time == 2.5 and session.activity.open == 0


@pytest.mark.asyncio
async def test_cancel_names_the_current_answer_only(worker):
    answerer = EchoAnswerer(step_s=0.02)
    session = await (await open_session(profile_for(), Models(WordASR(), answerer), worker)).start()
    events = asyncio.create_task(collect(session))
    assert not session.cancel_response()  # nothing is being answered
    rid = await session.ask("a question long enough to cancel")
    for _ in range(100):
        if session.answers.current is not None:
            break
        await asyncio.sleep(0.01)
    assert not session.cancel_response("resp_someone_else")
    assert session.cancel_response(rid)
    await session.finish()
    out = await events
    done = next(e for e in out if e.type == "response.done")
    assert done.response["status"] == "cancelled" and done.response["status_details"] == {"type": "cancelled",
        "reason": "client_cancelled"}
    assert done.response["usage"]["decode_steps"] <= 2 and answerer.released == 1
    assert not session.cancel_response(rid)  # over
