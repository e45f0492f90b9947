"""The real tiny models through the whole pipeline: what the session emits equals running the same models
directly, outside the pipeline, on the same input (so channels, the worker and events lose nothing). For the
engine, the answer from the transcript prefilled as it streamed equals one from a single prefill at question
time (greedy)."""

import asyncio
import time

import pytest

from runtime.feed import ScheduledQuestion, feed
from runtime.io.file_source import FileSource
from runtime.loaded_models import Models, load_models
from runtime.memory.conversation import Conversation
from runtime.profile_files import load_profile
from runtime.session_builder import open_session
from runtime.worker import DeviceWorker


@pytest.fixture(scope="module")
def tiny():
    profile = load_profile("tiny", overrides=["pipeline.metrics_interval_s=0", "lm.max_new_tokens=8"])
    with DeviceWorker() as worker:
        yield profile, worker, load_models(profile, worker)


async def _chunks(path, profile):
    return [item async for item in FileSource(path, speed=0, video=False,
                                              chunk_ms=profile.pipeline.audio_chunk_ms)]


@pytest.mark.asyncio
async def test_session_equals_direct_model_calls(tiny, demo_file):
    profile, worker, models = tiny
    spy = ContextSpy(models.answerer)
    session = await (await open_session(profile, Models(models.asr, spy), worker)).start()
    events: list = []
    consumer = asyncio.create_task(_drain(session, events))
    await feed(FileSource(demo_file, speed=0, chunk_ms=profile.pipeline.audio_chunk_ms), session,
               [ScheduledQuestion("what moved?", at=2.0)])
    await session.finish()
    await consumer
    assert asyncio.all_tasks() == {asyncio.current_task()}

    # The same audio straight through the ASR stream, no pipeline.
    stream = models.asr.open_stream()
    direct = [u for chunk in await _chunks(demo_file, profile) for u in stream.accept(chunk)] + stream.finish()
    # no turn detection here: the whole input is one buffer, one user item holding every item the ASR cut
    completed = [e.transcript for e in events if e.type.endswith("transcription.completed")]
    assert completed == [" ".join(u.transcript.strip() for u in direct if u.completed and u.transcript.strip())]
    deltas = [e.delta for e in events if e.type.endswith("transcription.delta")]
    streamed, direct_streamed = "".join(deltas), "".join(u.delta for u in direct)
    # the same words as streamed straight from the ASR (the fold only puts a space between the ASR's own items)
    assert streamed.replace(" ", "") == direct_streamed.replace(" ", "")
    assert "".join(deltas).strip() == completed[0]  # the deltas add up to the final text

    # The answer equals the answerer run directly (one prefill) on the context and video memory it was given.
    ((context, suffix),) = spy.contexts
    assert context.startswith("[00:00.0] ")  # what was heard before the question, stamped
    # ...which is exactly what the audio up to the question's media time says: the file plays unpaced, and no
    # later word may reach the answer however far the ASR could have raced ahead meanwhile
    heard, replay = Conversation(), models.asr.open_stream()
    for chunk in await _chunks(demo_file, profile):
        if chunk.end > 2.0:
            break
        for update in replay.accept(chunk):
            heard.apply(update)
    assert context == heard.context()
    state = models.answerer.start(context, "what moved?", suffix=list(suffix))
    expected, tokens, steps = [], 0, 0
    while True:
        step = state.step()
        expected.append(step.delta)
        tokens, steps = tokens + step.tokens, steps + 1
        if step.done:
            break
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert answer == "".join(expected)
    done = next(e for e in events if e.type == "response.done")
    assert done.response["usage"]["output_tokens"] == tokens == len(state.generated)
    assert done.response["usage"]["decode_steps"] == steps
    assert done.response["decoding"]["steps"] >= 1  # speculative decoding stats of the engine
    assert done.response["timing"]["first_token_s"] > 0


class ContextSpy:
    """The real answerer, recording the context the session hands it. Its prefill steps are slowed, so that
    an ASR left to race ahead of a question would surely be transcribing later audio while it prefills."""

    def __init__(self, answerer):
        self.answerer, self.contexts = answerer, []

    def open_stream(self):
        stream = self.answerer.open_stream()
        return None if stream is None else SlowPrefill(stream)

    def start(self, context, question, **kwargs):
        stream = kwargs.get("stream")
        if stream is not None:
            kwargs["stream"] = stream.stream
        state = self.answerer.start(context, question, **kwargs)
        if stream is not None:  # a question (video notes use pooled streams, without one)
            self.contexts.append(stream.stream.session.answered_from)  # transcript and video memory it saw
        return state

    def embed_text(self, text):
        return self.answerer.embed_text(text)


class SlowPrefill:
    """An answerer's stream whose every prefill step takes 20 ms longer (on the worker, like the real ones)."""

    def __init__(self, stream):
        self.stream = stream

    def set_context(self, *args):
        return self.stream.set_context(*args)

    def prefill_step(self):
        time.sleep(0.02)
        return self.stream.prefill_step()


async def _drain(session, sink):
    async for event in session.events:
        sink.append(event)
