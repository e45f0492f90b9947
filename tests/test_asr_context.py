"""Context across turns: each turn's ASR stream starts from the text of the turns before it and the user's
vocabulary (Whisper's previous text, at most 223 tokens, the most recent kept).

- The prompt the pipeline builds turn by turn (its context trimmed as it goes) is the one computed offline from
  all the turns' texts.
- A causal stream given that context shows, for any chunking, with previews and across a cache reset, what the
  cache-free reference computes with the same context; the final pass decodes with it too.
- `audio.input.transcription.prompt` is parsed, checked, and reaches every turn's stream on the worker.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from session_fakes import EchoAnswerer, WordASR, audio_chunks, collect, profile_for
from test_causal_whisper_decoder import chunk_sizes, make_audio
from test_causal_whisper_final_pass import Recorder

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig
from runtime.loaded_models import Models
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.final_pass import OfflinePass
from runtime.models.asr.causal_whisper.reference import offline_run
from runtime.models.asr.whisper_checkpoint import PROMPT_TOKENS, encoded, fit_previous, previous_ids
from runtime.pipeline.turns_before import CONTEXT_CHARS, TurnsBefore
from runtime.session_builder import open_session
from runtime.session_config import ConfigFieldError, SessionConfig, parse_update


def load(**kw: object) -> CausalWhisperASR:
    return CausalWhisperASR.load(ASRConfig(**{"chunk_ms": 300, "max_new_tokens": 40, **kw}), device="cpu",
                                 dtype="float32")


@pytest.fixture(scope="module")
def asr() -> CausalWhisperASR:
    return load(preview_ms=100, reset_s=3.0, loop_repeats=0, max_new_tokens=60)


def test_previous_ids_keep_the_vocabulary_then_the_most_recent_words(asr: CausalWhisperASR) -> None:
    tok = asr.tokenizer
    text = " ".join(f"word{i}" for i in range(300))
    vocab = "Pickwick Snodgrass"
    ids = previous_ids(tok, text, vocab)
    assert len(ids) == PROMPT_TOKENS
    assert ids[: len(encoded(tok, vocab))] == encoded(tok, vocab)
    assert ids[len(encoded(tok, vocab)) :] == encoded(tok, text)[-(PROMPT_TOKENS - len(encoded(tok, vocab))) :]
    assert previous_ids(tok, "", "") == [] and fit_previous([1, 2, 3], [4, 5], 2) == [1, 2]


def test_the_pipelines_context_is_the_prompt_of_every_turn_before(asr: CausalWhisperASR) -> None:
    """Turn by turn the audio processor's `TurnsBefore` keeps only the most recent text; the prompt from it equals the
    one from all the turns' texts, and its memory stays bounded."""
    before = TurnsBefore()
    turns = [f" Turn {i} said  word{i} and\tanother{i}. " for i in range(400)]
    for i, text in enumerate(turns):
        before.committed(text, None)
        offline = previous_ids(asr.tokenizer, " ".join(turns[: i + 1]), "Boz")
        assert previous_ids(asr.tokenizer, before.context(), "Boz") == offline, i
    # at least CONTEXT_CHARS kept (whole transcripts), never a transcript more
    assert CONTEXT_CHARS <= len(before.context()) <= CONTEXT_CHARS + max(map(len, turns))
    assert len(" ".join(turns)) > 3 * CONTEXT_CHARS


def feed(asr: CausalWhisperASR, audio: np.ndarray, sizes: list[int], previous: str, vocabulary: str
         ) -> tuple[str, list[tuple[int, str]]]:
    """(transcript, (samples fed, text shown) per call) of a stream given the context."""
    stream = asr.open_stream()
    stream.set_context(previous, vocabulary)
    shown, done, emitted, unstable, item, pos = [], [], "", "", None, 0
    for n in sizes:
        for u in stream.accept(AudioChunk(audio[pos : pos + n], pos)):
            if u.item_id != item:
                item, emitted = u.item_id, ""
            emitted, unstable = emitted + u.delta, u.unstable
            if u.completed:
                item, emitted, unstable = None, "", ""
                done.append(u.transcript)
        pos += n
        shown.append((pos, emitted + unstable))
    return "".join(done + [u.transcript for u in stream.finish() if u.completed]), shown


def test_a_stream_with_context_shows_what_the_reference_computes_with_it(asr: CausalWhisperASR) -> None:
    audio = make_audio(4.5, seed=1)
    previous, vocabulary = "we were all going direct to heaven", "Dickens"
    ref = offline_run(asr, audio, previous, vocabulary)
    assert ref.text != offline_run(asr, audio).text  # the context changes the words: else this could not tell
    assert any(e.kind == "reset" for e in ref.shown) and any(e.kind == "preview" for e in ref.shown)
    for kind in ("whole", "one-sample", "ragged", "big"):
        text, shown = feed(asr, audio, chunk_sizes(len(audio), kind), previous, vocabulary)
        assert text == ref.text, kind
        for n, seen in shown:
            events = [e.text for e in ref.shown if e.sample <= n]
            assert seen == (events[-1] if events else ""), (kind, n)


def test_the_final_pass_decodes_with_the_turns_context(asr: CausalWhisperASR) -> None:
    recorder = Recorder(asr.tokenizer(" the end", add_special_tokens=False).input_ids)
    two_pass = CausalWhisperASR(asr.model, asr.tokenizer, ASRConfig(chunk_ms=300, max_new_tokens=40,
                                                                     final_pass="offline"),
                                final_pass=OfflinePass(recorder))
    stream = two_pass.open_stream()
    stream.set_context("it was the best of times", "Dickens")
    audio = make_audio(1.5)
    stream.accept(AudioChunk(audio, 0))
    (done,) = [u for u in stream.finish() if u.completed]
    assert done.transcript == " the end"
    # the first search reads the context (a second one, without it, follows where the random stream disagrees)
    assert recorder.previous[0] == previous_ids(asr.tokenizer, "it was the best of times", "Dickens")
    with pytest.raises(RuntimeError, match="before the stream's first chunk"):
        stream.set_context("too late")


def test_the_final_pass_completes_empty_what_whisper_says_is_no_speech(asr: CausalWhisperASR) -> None:
    item = asr.item(asr.scorer(), None)
    for no_speech, expected in ((0.9, []), (0.5, [5, 6])):
        final = OfflinePass(Recorder([5, 6], no_speech=no_speech))
        assert final.revise(item, np.zeros(SAMPLE_RATE, np.float32)) == expected
        assert (final.silent, final.last_no_speech) == (int(not expected), no_speech)


def test_the_transcription_prompt_is_a_checked_session_field() -> None:
    config = parse_update(SessionConfig(), {"audio": {"input": {"transcription": {"model": "whisper-1",
                                                                                  "prompt": "Pickwick, Boz"}}}})
    assert config.transcription_prompt() == "Pickwick, Boz"
    assert config.to_api()["audio"]["input"]["transcription"]["prompt"] == "Pickwick, Boz"
    assert SessionConfig().transcription_prompt() == ""
    with pytest.raises(ConfigFieldError, match="prompt must be a string") as err:
        parse_update(config, {"audio": {"input": {"transcription": {"prompt": ["Boz"]}}}})
    assert err.value.param == "session.audio.input.transcription.prompt"


@pytest.mark.asyncio
async def test_the_prompt_and_the_turns_before_reach_each_turns_stream_on_the_worker(worker) -> None:
    asr = WordASR(per_item=1000)
    session = await (await open_session(profile_for(), Models(asr, EchoAnswerer()), worker)).start()
    events = asyncio.create_task(collect(session))
    prompt = {"audio": {"input": {"transcription": {"prompt": "Pickwick"}}}}
    await session.update_config(parse_update(session.settings.config, prompt))
    chunks = audio_chunks(6)
    for chunk in chunks[:3]:
        await session.push_audio(chunk)
    await session.commit_audio()
    for chunk in chunks[3:]:
        await session.push_audio(chunk)
    await session.finish()
    await events
    assert [s.contexts for s in asr.streams[:2]] == [[("", "Pickwick")], [("w0 w1 w2", "Pickwick")]]
    assert asr.streams[1].threads == {worker.name}


def test_the_pass_misled_by_the_turns_context_decodes_again_without_it(asr: CausalWhisperASR) -> None:
    """The stream is the pass's witness: where the pass with previous text shares fewer than half the stream's words,
    it decodes again without it and keeps whichever shares more; a stream that wrote nothing is no witness."""
    from runtime.models.asr.causal_whisper.emission import Token

    words = asr.tokenizer
    said = words(" what day is the meeting", add_special_tokens=False).input_ids
    misled = words(" whats next", add_special_tokens=False).input_ids

    class Primed(Recorder):  # decodes `misled` after previous text, `said` without it
        def decode(self, encoded, forced=(), beams=None, draft=(), previous=(), sot=None):
            super().decode(encoded, forced, beams, draft, previous)
            return list(misled if previous else said)

    for stream, previous, expected, again in ((said, [5, 6], said, 1), ([], [5, 6], misled, 0),
                                              (misled, [5, 6], misled, 0), (said, [], said, 0)):
        recorder = Primed([])
        final = OfflinePass(recorder)
        item = asr.item(asr.scorer(), None)
        item.tokens, item.previous = [Token(i, 1.0, 0) for i in stream], previous
        assert final.revise(item, np.zeros(SAMPLE_RATE, np.float32)) == expected, (stream, previous)
        assert final.redecoded == again and recorder.previous == [previous] + [[]] * again
