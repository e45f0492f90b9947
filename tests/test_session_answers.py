"""What an answer says about itself on the wire: the ids that tie its events together, its status and reason for
each way it can end, its usage and timing, and that a failed or cancelled answer costs nothing else."""

import asyncio

import pytest
from session_fakes import EchoAnswer, EchoAnswerer, WordASR, audio_chunks, collect, profile_for

from runtime.loaded_models import Models
from runtime.models.lm import AnswerStep
from runtime.session_builder import open_session
from runtime.worker import DeviceWorker


@pytest.fixture
def worker():
    with DeviceWorker() as w:
        yield w


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

    def start(self, context, question, *, seed=None, stream=None, suffix=None) -> EchoAnswer:
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
    assert [e.type for e in mine] == ["response.created"] + ["response.output_text.delta"] * 5 + [
        "response.output_text.done", "response.done"]
    created, *deltas, text_done, done = mine
    assert created.response == {"id": rid, "object": "realtime.response", "status": "in_progress",
                                "question": "q"}
    item_ids = {e.item_id for e in [*deltas, text_done]}
    assert len(item_ids) == 1 and next(iter(item_ids)).startswith("item_")
    assert all(e.media_time == 0.25 for e in mine)  # every event of the answer carries the question's media time
    assert "".join(d.delta for d in deltas) == text_done.text == "q->w2"  # w2 ends at 0.3 s, after 0.25 s
    r = done.response
    assert (r["id"], r["object"], r["status"], r["status_details"], r["question"]) == (
        rid, "realtime.response", "completed", None, "q")
    assert r["output"] == [{"id": next(iter(item_ids)), "type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "q->w2"}]}]
    assert r["usage"] == {"output_tokens": 2 * 5, "decode_steps": 5}  # each step reported two tokens
    assert r["decoding"] == {"steps": 5, "accepted_per_step": 2.0}
    assert 0 < r["timing"]["first_token_s"] <= r["timing"]["total_s"] < 30
    assert "video" not in r  # no video memory, so no selection to report


@pytest.mark.asyncio
async def test_an_answer_cut_by_its_length_is_incomplete(worker):
    (rid,), events = await _answer(worker, CountingAnswerer(limit=3), "long")
    done = next(e for e in events if e.type == "response.done")
    assert done.response["status"] == "incomplete"
    assert done.response["status_details"] == {"reason": "max_output_tokens"}
    assert done.response["output"][0]["content"][0]["text"] == "lon"


@pytest.mark.asyncio
async def test_a_failed_answer_is_an_error_and_a_failed_response_and_the_next_one_works(worker):
    answerer = CountingAnswerer()
    (bad, good), events = await _answer(worker, answerer, "explode", "again", client_event_id="c7")
    errors = [e for e in events if e.type == "error"]
    assert len(errors) == 1
    error = errors[0].error
    assert (error["type"], error["code"], error["event_id"]) == ("server_error", "response_failed", "c7")
    assert "the model fell over" in error["message"] and errors[0].media_time == 0.25
    done = {e.response["id"]: e.response for e in events if e.type == "response.done"}
    assert done[bad]["status"] == "failed" and done[bad]["status_details"] == {"reason": "error"}
    assert done[bad]["usage"] == {"output_tokens": 0, "decode_steps": 0} and "decoding" not in done[bad]
    assert done[good]["status"] == "completed" and done[good]["output"][0]["content"][0]["text"] == "again->w2"
    assert answerer.released == 1  # the one answer that started was released; the failed start held nothing


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
    assert done.response["status_details"] == {"reason": "client_cancelled"}
    assert session.answers.answered == 1 and session.answers.current is None
