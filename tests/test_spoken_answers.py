"""Spoken answers on the wire, through the official `openai` SDK (`client.realtime.connect`) against a server
started here: `output_modalities: ["audio"]`, the audio and transcript events in the GA API's order and shapes
(each checked strictly against the SDK's own model), `conversation.item.truncate` with `audio_end_ms`, barge-in,
`response.create` with no new user item, and bad `audio.output` values as error events.

The server runs stand-ins (`session_fakes`): a scripted answerer that says a fixed text a word a step, and a tone
voice whose every word is 0.1 s long, so the audio's length and each clause's place in it are known; one test speaks
with the real voice and hears it back with Whisper tiny.en. Barge-in runs the real Silero VAD on real speech."""

from __future__ import annotations

import asyncio
import base64
import json
import typing

import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from session_fakes import ScriptAnswerer, ToneVoice, WordASR, profile_for
from weights_common import packaged_or_skip

from runtime.io.sample import demo_speech
from runtime.loaded_models import Models, load_turn_models
from runtime.models.tts.clauses import split_clauses
from runtime.pipeline.questions import CONTINUE_QUESTION, OPENING_QUESTION
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker

pytestmark = pytest.mark.asyncio

SDK_MODELS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
              for m in typing.get_args(typing.get_args(RealtimeServerEvent)[0])}
VOICE = "builtin:piper-en-us-joe-medium"
COUNTING = "One two three four five six seven eight nine ten."  # clauses: three words, then seven (0.3 s + 0.7 s)
SPEAK = {"type": "realtime", "output_modalities": ["audio"], "audio": {"input": {"turn_detection": None}}}


def check(event: dict) -> None:
    """An API type validates strictly against the SDK's model; anything else is the runtime's own."""
    model = SDK_MODELS.get(event["type"])
    if model is None:
        assert event["type"].startswith("runtime."), f"neither the SDK's nor namespaced: {event['type']}"
        return
    model.model_validate(event, strict=True)


class Talk:
    """One SDK connection; every event read is checked and kept."""

    def __init__(self, connection) -> None:
        self.conn, self.events = connection, []

    async def next(self, kind: str, timeout: float = 30.0) -> dict:
        while True:
            event = json.loads(await asyncio.wait_for(self.conn.recv_bytes(), timeout))
            check(event)
            self.events.append(event)
            if event["type"] == kind:
                return event

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def audio(self, response_id: str | None = None) -> bytes:
        return b"".join(base64.b64decode(e["delta"]) for e in self.of("response.output_audio.delta")
                        if response_id in (None, e["response_id"]))

    async def send_audio(self, samples16k: np.ndarray, chunk_s: float = 0.1) -> None:
        """16 kHz float audio as the API's 24 kHz PCM16 (linear interpolation is plenty for a VAD)."""
        t = np.arange(round(len(samples16k) * 1.5)) / 24_000
        pcm = (np.clip(np.interp(t, np.arange(len(samples16k)) / 16_000, samples16k), -1, 1) * 32767).astype("<i2")
        raw, step = pcm.tobytes(), int(24_000 * chunk_s) * 2
        for i in range(0, len(raw), step):
            await self.conn.input_audio_buffer.append(audio=base64.b64encode(raw[i : i + step]).decode())


async def serve(answerer, voice=None, turns=None):
    worker = DeviceWorker().start()
    models = Models(WordASR(per_item=1000), answerer, turns=turns, voice=voice)
    server = await RealtimeServer(profile_for(metrics_interval_s=0), models, worker, port=0).start()
    client = AsyncOpenAI(api_key="unused", websocket_base_url=f"ws://127.0.0.1:{server.port}/v1")
    return server, worker, client


async def stop(server, worker) -> None:
    await server.stop()
    worker.stop()


def words_heard(audio_end_ms: int, text: str, word_ms: int) -> int:
    """The truncation rule (runtime/memory/spoken.py) for a tone voice of `word_ms` a word: whole clauses before
    the cut, then the played share of the clause it falls in, rounded down."""
    words, start = 0, 0
    for n in (len(clause.split()) for clause in split_clauses(text)):
        end = start + n * word_ms
        if end <= audio_end_ms:
            words += n
        else:
            words += n * max(0, audio_end_ms - start) // (end - start)
            break
        start = end
    return words


async def test_a_spoken_answer_arrives_as_the_ga_api_sends_it() -> None:
    voice = ToneVoice()
    server, worker, client = await serve(ScriptAnswerer(COUNTING, step_s=0.01), voice)
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            await talk.next("session.created")
            await connection.session.update(session={**SPEAK, "audio": {**SPEAK["audio"], "output": {
                "voice": VOICE, "speed": 1.0}}})
            updated = await talk.next("session.updated")
            assert updated["session"]["output_modalities"] == ["audio"]
            assert updated["session"]["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000},
                                                             "voice": VOICE, "speed": 1.0}
            await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "count to ten"}]})
            await connection.response.create()
            done = (await talk.next("response.done"))["response"]
            # the same answer again, as G.711 mu-law at 8 kHz: a response's own audio.output
            await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "again"}]})
            await connection.response.create(response={"audio": {"output": {"format": {"type": "audio/pcmu"}}}})
            ulaw = (await talk.next("response.done"))["response"]
    finally:
        await stop(server, worker)
    assert done["status"] == "completed" and done["output_modalities"] == ["audio"]
    assert done["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000}, "voice": VOICE}
    item = done["output"][0]
    assert item["content"] == [{"type": "output_audio", "transcript": COUNTING}]
    mine = [e for e in talk.events if e.get("response_id") == done["id"]]
    kinds = [e["type"] for e in mine]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert mine[1]["part"] == {"type": "audio", "transcript": ""}
    assert kinds[-4:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done"]  # then response.done
    assert "response.output_text.delta" not in kinds
    # the audio starts while the answer is still being written: the first clause is spoken before the last word
    first_audio = kinds.index("response.output_audio.delta")
    assert first_audio < len(kinds) - 1 - kinds[::-1].index("response.output_audio_transcript.delta")
    deltas = "".join(e["delta"] for e in mine if e["type"] == "response.output_audio_transcript.delta")
    assert deltas == COUNTING == mine[-3]["transcript"] == mine[-2]["part"]["transcript"]
    # 24 kHz PCM16: ten words of 0.1 s, resampled from the voice's 22,050 Hz, every sample sent
    pcm = np.frombuffer(talk.audio(done["id"]), "<i2")
    assert abs(len(pcm) - 24_000) <= 2 and 0.25 < np.abs(pcm).max() / 32767 < 0.35
    assert all(len(base64.b64decode(e["delta"])) <= 24_000 * 2 // 5 for e in mine
               if e["type"] == "response.output_audio.delta")  # at most 200 ms a delta
    assert voice.spoken[:2] == ["One two three", "four five six seven eight nine ten."]
    assert voice.threads == {"device-worker"}  # synthesis runs on the worker, never on the event loop
    assert ulaw["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    assert abs(len(talk.audio(ulaw["id"])) - 8_000) <= 2  # one byte a sample at 8 kHz


async def test_truncate_cuts_the_audio_and_transcript_to_what_was_played() -> None:
    answerer = ScriptAnswerer(COUNTING)
    server, worker, client = await serve(answerer, ToneVoice())
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            await connection.session.update(session=SPEAK)
            await talk.next("session.updated")
            await connection.response.create()
            item_id = (await talk.next("response.done"))["response"]["output"][0]["id"]
            await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=1500)
            past = await talk.next("error")
            await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=850)
            truncated = await talk.next("conversation.item.truncated")
            await connection.conversation.item.retrieve(item_id=item_id)
            retrieved = (await talk.next("conversation.item.retrieved"))["item"]
            await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=300)
            await talk.next("conversation.item.truncated")
            await connection.conversation.item.retrieve(item_id=item_id)
            shorter = (await talk.next("conversation.item.retrieved"))["item"]
            await connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=301)
            again = await talk.next("error")
            await connection.response.create()  # the next answer reads the conversation as truncated
            await talk.next("response.done")
    finally:
        await stop(server, worker)
    assert past["error"]["code"] == "invalid_value" and "is already shorter than 1500 ms" in past["error"]["message"]
    assert truncated == {**truncated, "item_id": item_id, "content_index": 0, "audio_end_ms": 850}
    # 850 ms: the first clause (three words, 0.3 s) whole, and 0.55 s of the second's 0.7 s: five of its seven words
    assert retrieved["content"] == [{"type": "output_audio", "transcript": "One two three four five six seven eight"}]
    assert shorter["content"][0]["transcript"] == "One two three"  # 300 ms: the first clause, whole
    assert again["error"]["code"] == "invalid_value"  # the item now holds 300 ms
    assert "Assistant: One two three\n" in answerer.contexts[-1] + "\n" and "four" not in answerer.contexts[-1]


@pytest.fixture(scope="module")
def turn_models():
    models = load_turn_models()
    assert models is not None, "make install installs the turn-detection models (pipecat-ai, requirements/weights.txt)"
    return models


async def test_barge_in_cancels_the_answer_and_truncates_it_to_what_was_heard(turn_models) -> None:
    """Speech starts while the agent speaks: the answer in progress is cancelled (reason turn_detected) and its item
    cut to the audio the client had played by its own clock: input media time at detection minus that at the first
    audio delta (0 here: nothing was sent before it), at most the audio sent."""
    long = " ".join(["Counting on, one two three four five six seven eight nine ten."] * 4)
    slow = ScriptAnswerer(long, step_s=0.08)  # 48 words: 3.8 s to write, 14 s to hear
    server, worker, client = await serve(slow, ToneVoice(word_s=0.3), turns=turn_models)
    speech = np.concatenate([np.zeros(16_000, np.float32), demo_speech()[: int(2.5 * 16_000)]])
    vad = {"type": "server_vad", "create_response": False, "interrupt_response": True}
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            await connection.session.update(session={**SPEAK, "audio": {"input": {"turn_detection": vad}}})
            await talk.next("session.updated")
            await connection.response.create()
            while len(talk.audio()) < 2.5 * 48_000:  # 2.5 s of the answer's audio has come
                await talk.next("response.output_audio.delta")
            await talk.send_audio(speech)  # a second of silence, then the user talks over the answer
            started = await talk.next("input_audio_buffer.speech_started")
            cancelled = (await talk.next("response.done"))["response"]
            truncated = await talk.next("conversation.item.truncated")
            await connection.conversation.item.retrieve(item_id=truncated["item_id"])
            item = (await talk.next("conversation.item.retrieved"))["item"]
    finally:
        await stop(server, worker)
    assert cancelled["status"] == "cancelled" and cancelled["status_details"]["reason"] == "turn_detected"
    assert truncated["item_id"] == cancelled["output"][0]["id"]
    sent_ms = len(talk.audio(cancelled["id"])) // 48
    speech_ms = started["audio_start_ms"] + 300  # the VAD's start, without the prefix padding
    assert sent_ms >= 2500 and truncated["audio_end_ms"] <= sent_ms
    # detected within the VAD's windows; the clock is read to the audio chunk (100 ms) the detection came in
    assert speech_ms - 100 <= truncated["audio_end_ms"] <= speech_ms + 600
    words = item["content"][0]["transcript"].split()
    assert words == long.split()[: len(words)]  # a prefix of the answer: what was heard
    assert len(words) == words_heard(truncated["audio_end_ms"], long, 300)


async def test_an_answer_still_playing_is_truncated_at_barge_in(turn_models) -> None:
    """An answer sent whole (synthesis outruns playback) whose audio the client is still playing by its own clock
    is truncated at barge-in, without a cancel: there is no response in progress."""
    quick = ScriptAnswerer(" ".join(["one two three four five six seven eight nine ten."] * 3))
    server, worker, client = await serve(quick, ToneVoice(), turns=turn_models)
    vad = {"type": "server_vad", "create_response": False}
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            await connection.session.update(session={**SPEAK, "audio": {"input": {"turn_detection": vad}}})
            await talk.next("session.updated")
            await connection.response.create()
            done = (await talk.next("response.done"))["response"]  # all 3 s of audio sent, faster than real time
            await talk.send_audio(np.concatenate([np.zeros(8_000, np.float32), demo_speech()[: 2 * 16_000]]))
            truncated = await talk.next("conversation.item.truncated")
    finally:
        await stop(server, worker)
    assert done["status"] == "completed"
    assert truncated["item_id"] == done["output"][0]["id"] and 500 < truncated["audio_end_ms"] < 2000
    assert not [e for e in talk.events if e["type"] == "response.done" and e["response"]["id"] != done["id"]]


async def test_response_create_with_no_new_item_answers_from_the_conversation() -> None:
    """An agent that greets first: response.create on an empty conversation opens it; with nothing new after an
    answer it goes on from the conversation (the API answers either; this server said no_pending_item before)."""
    answerer = ScriptAnswerer("Hello, how can I help?")
    server, worker, client = await serve(answerer, ToneVoice())
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            await connection.session.update(session={**SPEAK, "instructions": "Greet the caller."})
            await talk.next("session.updated")
            await connection.response.create()
            greeting = (await talk.next("response.done"))["response"]
            await connection.response.create(response={"output_modalities": ["text"]})
            follow = (await talk.next("response.done"))["response"]
    finally:
        await stop(server, worker)
    assert greeting["status"] == "completed" and greeting["output"][0]["content"][0]["transcript"] == \
        "Hello, how can I help?"
    assert answerer.questions == [f"{OPENING_QUESTION}\n\nInstructions: Greet the caller.",
                                  f"{CONTINUE_QUESTION}\n\nInstructions: Greet the caller."]
    assert follow["output_modalities"] == ["text"] and follow["output"][0]["content"][0]["type"] == "output_text"
    assert not talk.of("error")


async def test_bad_audio_output_values_are_error_events_and_the_session_goes_on() -> None:
    server, worker, client = await serve(ScriptAnswerer("Fine."), ToneVoice())
    silent_server, silent_worker, silent_client = await serve(ScriptAnswerer("Fine."))  # no voice installed
    bad = [({"output_modalities": ["audio"], "audio": {"output": {"voice": "alloy"}}}, "session.audio.output.voice"),
           ({"audio": {"output": {"speed": 4}}}, "session.audio.output.speed"),
           ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 8000}}}}, "session.audio.output.format"),
           ({"output_modalities": ["audio", "text"]}, "session.output_modalities")]
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            errors = []
            for session, _ in bad:
                await connection.session.update(session={"type": "realtime", **session})
                errors.append((await talk.next("error"))["error"])
            await connection.response.create(response={"audio": {"output": {"voice": "echo"}}})
            errors.append((await talk.next("error"))["error"])
            await connection.response.create()  # the session kept its config: a text answer
            done = (await talk.next("response.done"))["response"]
        async with silent_client.realtime.connect(model="gpt-realtime") as connection:
            silent = Talk(connection)
            await connection.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            no_voice = (await silent.next("error"))["error"]
    finally:
        await stop(server, worker)
        await stop(silent_server, silent_worker)
    assert [(e["param"], e["code"]) for e in errors] == [
        (param, "unsupported_modality" if param.endswith("modalities") else "invalid_value") for _, param in bad
    ] + [("response.audio.output.voice", "invalid_value")]
    assert "builtin:piper-en-us-joe-medium" in errors[0]["message"]
    assert done["status"] == "completed" and done["output_modalities"] == ["text"]
    assert not talk.of("response.output_audio.delta")
    assert (no_voice["code"], no_voice["param"]) == ("unsupported_modality", "session.output_modalities")
    assert "no voice" in no_voice["message"]


async def test_the_real_voice_says_the_transcript() -> None:
    """The end-to-end check with builtin:piper-en-us-joe-medium: the audio deltas the SDK receives, decoded and
    transcribed back by Whisper tiny.en, are the transcript, spoken clause by clause ("Sure," first). VITS draws
    noise on every call; this answer was heard word for word in every run tried (3 of 3 offline, and here)."""
    from runtime.bench.asr_systems import faster_whisper
    from runtime.models.tts import load_voice
    from runtime.models.tts.output_audio import resample
    from runtime.train.text_norm import wer

    transcribe, why = faster_whisper(packaged_or_skip("whisper-tiny.en"), "")
    assert transcribe is not None, why
    packaged_or_skip("piper-en-us-joe-medium")
    said = "Sure, the meeting moved to Thursday. Please bring the slides."
    server, worker, client = await serve(ScriptAnswerer(said), load_voice())
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            await connection.session.update(session=SPEAK)
            await talk.next("session.updated")
            await connection.response.create()
            done = (await talk.next("response.done", timeout=60))["response"]
    finally:
        await stop(server, worker)
    transcript = talk.of("response.output_audio_transcript.done")[0]["transcript"]
    assert transcript == said == done["output"][0]["content"][0]["transcript"]
    pcm = np.frombuffer(talk.audio(done["id"]), "<i2").astype(np.float32) / 32768
    assert 2.5 < len(pcm) / 24_000 < 7.0
    heard = transcribe(resample(pcm, 24_000, 16_000))
    # Piper's VITS samples noise, so each synthesis differs a little: one word of the ten may be heard otherwise
    # ("Sure, the meeting" once came back as "Make sure the meeting"); words of another sentence would be many
    assert wer([transcript], [heard]) <= 0.1, heard


async def test_a_truncation_keeps_whole_clauses_and_the_played_share_of_the_one_it_cuts() -> None:
    from runtime.memory.spoken import SpokenTrack

    track = SpokenTrack(rate=1000)
    track.plan("one two three four", 400)
    track.plan("five six", 200)
    track.sent(500)  # the second clause is half sent when the response is cut short
    assert track.duration_ms == 500
    assert [track.heard(ms) for ms in (0, 99, 100, 399, 400, 450, 500, 9999)] == [
        "", "", "one", "one two three", "one two three four", "one two three four",
        "one two three four five", "one two three four five"]
    assert track.cut(250) == "one two" and track.duration_ms == 250
    assert track.clauses == [(0, 250, "one two")] and track.heard(250) == "one two"


async def test_a_slow_reader_holds_the_decoder_and_nothing_grows() -> None:
    """The speaking path is bounded: when the event channel does not take the audio (a client that stops reading),
    the speaking task waits, the clause queue fills, and `push` (the decode loop) waits: nothing is dropped and at
    most `clause_queue` clauses and one clause's audio are held."""
    from runtime.pipeline.spoken_output import Speaker
    from runtime.session_config import OutputAudio
    from runtime.session_state import HeardClock

    reading = asyncio.Event()
    emitted = []

    async def emit(event) -> None:
        await reading.wait()  # the client reads nothing until told
        emitted.append(event)

    voice = ToneVoice()
    with DeviceWorker() as worker:
        speaker = Speaker(voice, worker, emit, HeardClock(), clause_queue=2)
        spoken = speaker.open("resp_1", "item_1", 0, OutputAudio(), 0.0)
        sentences = [f"Sentence number {i} is here." for i in range(8)]
        pushing = asyncio.create_task(_push_all(spoken, sentences))
        await asyncio.sleep(0.3)
        assert not pushing.done()  # the decoder is held
        assert len(voice.spoken) == 1  # one clause synthesised, waiting to be emitted; two queued; one in push
        reading.set()
        await asyncio.wait_for(pushing, 10)
        await asyncio.wait_for(spoken.finish(), 10)
    assert voice.spoken == split_clauses(" ".join(sentences))  # every word, in order (the first clause is short)
    assert spoken.track.duration_ms == pytest.approx(8 * 5 * 100, abs=2)
    assert sum(len(base64.b64decode(e.delta)) for e in emitted) // 2 == spoken.track.samples


async def _push_all(spoken, sentences: list[str]) -> None:
    for sentence in sentences:
        await spoken.push(sentence + " ")


async def test_the_runtime_client_yields_the_spoken_audio() -> None:
    from runtime.client import AsyncRealtimeClient

    server, worker, _ = await serve(ScriptAnswerer(COUNTING), ToneVoice())
    try:
        async with AsyncRealtimeClient(f"ws://127.0.0.1:{server.port}/v1/realtime") as client:
            await client.speak(format={"type": "audio/pcma"}, speed=1.25)
            await client.ask("count")
            await client.finish()
            chunks = [chunk async for chunk in client.audio_chunks()]
    finally:
        await stop(server, worker)
    assert len({item_id for item_id, _ in chunks}) == 1
    assert abs(sum(len(audio) for _, audio in chunks) - 8_000 / 1.25) <= 2  # 1 s at 1.25x, one byte a sample


async def test_a_client_gone_mid_answer_leaves_no_speaking_task() -> None:
    server, worker, client = await serve(ScriptAnswerer(COUNTING * 5, step_s=0.05), ToneVoice(delay_s=0.02))
    try:
        async with client.realtime.connect(model="gpt-realtime") as connection:
            talk = Talk(connection)
            await connection.session.update(session=SPEAK)
            await talk.next("session.updated")
            await connection.response.create()
            await talk.next("response.output_audio.delta")
        for _ in range(100):  # the session is stopped once the server sees the close
            if not server.sessions:
                break
            await asyncio.sleep(0.05)
        speaking = [t for t in asyncio.all_tasks() if t.get_name().endswith(":speech") and not t.done()]
        assert not server.sessions and not speaking
    finally:
        await stop(server, worker)
