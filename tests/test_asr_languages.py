"""Languages (issue 53): the session's `audio.input.transcription.language` and `.task` parsed and checked, handed
to each turn's ASR stream, refused in an error event where the model cannot do them (tiny.en is English-only), the
language the ASR heard on the transcript events; and, slow, Whisper base on espeak-ng German: the language given or
detected, and translated into English."""

from __future__ import annotations

import io
import shutil
import subprocess
from dataclasses import replace

import numpy as np
import pytest
import soundfile

from runtime.channels import BlockingChannel
from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig
from runtime.errors import CheckpointNotFound, ConfigError
from runtime.memory.conversation import Conversation
from runtime.models.asr.base import Speech, TranscriptUpdate
from runtime.models.asr.whisper_language import check_english_only
from runtime.pipeline.audio import AudioProcessor, BufferEnd
from runtime.profile_files import load_profile
from runtime.session_config import ConfigFieldError, SessionConfig, parse_update
from runtime.session_state import ContextChanges, HeardClock
from runtime.worker import DeviceWorker

PARAM = "session.audio.input.transcription"


def transcription(**fields: object) -> SessionConfig:
    return parse_update(SessionConfig(), {"audio": {"input": {"transcription": fields}}})


def test_the_session_language_and_task_over_the_profile_s():
    assert transcription(language="de", task="translate").transcription_speech("", "transcribe") == Speech(
        "de", "translate")
    assert transcription(task="translate").transcription_speech("fr", "transcribe") == Speech("fr", "translate")
    assert transcription(language="es").transcription_speech("", "transcribe") == Speech("es", "transcribe")
    assert transcription(prompt="Zoë").transcription_speech("", "transcribe") is None  # neither: the profile's
    assert transcription(language="de", task="translate").to_api()["audio"]["input"]["transcription"] == {
        "language": "de", "task": "translate"}


@pytest.mark.parametrize(("fields", "param"), [
    ({"language": "German"}, "language"), ({"language": "de-DE"}, "language"), ({"language": 7}, "language"),
    ({"task": "summarize"}, "task"), ({"task": True}, "task"), ({"dialect": "x"}, "dialect"),
])
def test_a_bad_language_or_task_names_its_field(fields, param):
    with pytest.raises(ConfigFieldError) as err:
        transcription(**fields)
    assert err.value.param == f"{PARAM}.{param}"


class _Stream:
    """One German word, its updates saying the language; `set_speech` as an English-only Whisper checks it."""

    def __init__(self, english_only: bool) -> None:
        self.english_only, self.speech = english_only, None

    def set_speech(self, speech: Speech) -> None:
        if self.english_only:
            check_english_only(speech, "builtin:whisper-tiny.en")
        self.speech = speech

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        pass

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        return [TranscriptUpdate("a", " Hallo", "", 0.0, chunk.end, language="de")] if not chunk.start_sample else []

    def finish(self) -> list[TranscriptUpdate]:
        return [TranscriptUpdate("a", "", "", 0.0, 0.2, True, " Hallo", language="de")]

    def close(self) -> None:
        pass


async def _session(stream: _Stream, speech: Speech | None) -> list:
    channel: BlockingChannel[AudioChunk | BufferEnd] = BlockingChannel(4, "audio")
    for i in range(2):
        await channel.put(AudioChunk(np.zeros(1600, np.float32), i * 1600))
    await channel.put(BufferEnd())
    channel.close()
    out: list = []

    async def emit(event) -> None:
        out.append(event)

    with DeviceWorker() as worker:
        await AudioProcessor(channel, lambda: stream, worker, emit, Conversation(), HeardClock(), ContextChanges(),
                             first_stream=stream, speech=lambda: speech).run()
    return out


@pytest.mark.asyncio
async def test_the_session_s_language_reaches_the_stream_and_the_heard_one_the_events():
    stream = _Stream(english_only=False)
    out = await _session(stream, Speech("de", "transcribe"))
    assert stream.speech == Speech("de", "transcribe")
    words = [e for e in out if e.type.startswith("conversation.item.input_audio_transcription.")]
    assert {e.type.rsplit(".", 1)[1] for e in words} == {"delta", "completed"}
    assert {e.language for e in words} == {"de"} and words[-1].to_dict()["language"] == "de"


@pytest.mark.asyncio
@pytest.mark.parametrize(("speech", "param"), [(Speech("de"), "language"), (Speech("", "translate"), "task")])
async def test_an_english_only_model_asked_for_more_is_an_error_event_and_the_turn_is_still_heard(speech, param):
    stream = _Stream(english_only=True)
    out = await _session(stream, speech)
    errors = [e.error for e in out if e.type == "error"]
    assert len(errors) == 1 and errors[0]["param"] == f"{PARAM}.{param}" and errors[0]["code"] == "invalid_value"
    assert "English-only" in errors[0]["message"] and stream.speech is None
    assert [e.transcript for e in out if e.type.endswith("transcription.completed")] == ["Hallo"]


def test_english_only_whisper_streams_refuse_another_language_or_translation():
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
    from runtime.models.asr.whisper_buffered import WhisperBuffered

    for asr in (CausalWhisperASR.load(ASRConfig(backend="causal-whisper", chunk_ms=300), device="cpu",
                                      dtype="float32"),
                WhisperBuffered.load(ASRConfig(), device="cpu", dtype="float32")):
        stream = asr.open_stream()
        for refused in (Speech("de"), Speech("en", "translate"), Speech("", "translate")):
            with pytest.raises(ConfigError, match="English-only"):
                stream.set_speech(refused)
        with pytest.raises(ConfigError, match="is not one of"):
            stream.set_speech(Speech("en", "summarize"))
        stream.set_speech(Speech("en"))
        stream.set_speech(Speech(""))  # English is what it detects


GERMAN = "Heute Morgen habe ich mit meiner Schwester in der Küche gefrühstückt."


def espeak(text: str, voice: str) -> np.ndarray:
    from runtime.train.synthesizers import resample

    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", "140", "--stdout", text], capture_output=True,
                         check=True, timeout=30).stdout
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    return resample(audio, rate, SAMPLE_RATE)


def streamed(asr, audio: np.ndarray, speech: Speech | None, chunk: int = 1600,
             ) -> tuple[list[TranscriptUpdate], TranscriptUpdate]:
    """`audio` through one stream in chunks of `chunk` samples (100 ms: a session's; the whole clip at once skips the
    previews, whose unstable tails cost a partial block's encoding and decoding each 100 ms and change neither the
    stable text nor the transcript: stream.py)."""
    stream = asr.open_stream()
    if speech is not None:
        stream.set_speech(speech)
    updates = [u for i in range(0, len(audio), chunk) for u in stream.accept(AudioChunk(audio[i : i + chunk], i))]
    done = stream.finish()[-1]
    stream.close()
    return updates, done


@pytest.mark.slow  # Whisper base joined and converted into the test cache, three streams of a 4.4 s sentence: 20-30 s
def test_whisper_base_hears_german_given_or_detected_and_translates_it():
    from runtime.models.asr.registry import load_asr

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    cfg = replace(load_profile("whisper-base").asr, graph_runtime="torch")  # no graph export in the test cache
    try:
        asr = load_asr(cfg, device="cpu", dtype="float32")
    except CheckpointNotFound as err:
        pytest.skip(str(err))
    audio = espeak(GERMAN, "de")
    # the given and the translated stream take the clip whole (no previews: 1-1.5 s of CPU less each); the detected
    # one in a session's 100 ms chunks, where what it shows before and after its first 2 s is checked
    given, done = streamed(asr, audio, Speech("de"), chunk=len(audio))
    assert {u.language for u in [*given, done]} == {"de"}
    assert {"heute", "morgen", "meiner"} <= set(done.transcript.lower().split()), done
    # detected (the profile's asr.language = ""), in a session's 100 ms chunks: nothing shown before it was detected
    detected, auto = streamed(asr, audio, None)
    # (the same German; a word may differ: the stream held its first seconds, and the pass checks the stream's words)
    assert auto.language == "de" and {"heute", "morgen", "meiner"} <= set(auto.transcript.lower().split()), auto
    shown = [u for u in detected if u.delta or u.unstable]
    assert shown and all(u.end >= 2.0 and u.language == "de" for u in shown), shown
    # after a second of silence, as a session's turn opens at the pause before it: over the first 2 s (a second of
    # speech) Whisper base is unsure and says Thai (0.2-0.3), so the stream holds its words until it is sure
    # (stream.py, DETECT_SURE; here to the turn's end); before that rule they showed in Thai
    detected, auto = streamed(asr, np.concatenate([np.zeros(SAMPLE_RATE, np.float32), audio]), None)
    assert auto.language == "de" and all(u.language == "de" for u in detected if u.delta or u.unstable), detected
    # a turn Whisper stays unsure of (silence: "en" at 0.35-0.4) is held up to its segment's reset point and no
    # further (the encoder's window ends there); a stream of 30 s held past it failed at the next block
    short = load_asr(replace(cfg, reset_s=3.0), device="cpu", dtype="float32")
    held, end = streamed(short, np.zeros(5 * SAMPLE_RATE, np.float32), None, chunk=SAMPLE_RATE // 2)
    assert end.completed and not end.transcript.strip(), (held, end)
    assert [u.end for u in held if u.completed][:1] == [3.0], held  # decided at the reset point, and reset there
    _, english = streamed(asr, audio, Speech("", "translate"), chunk=len(audio))  # detected over the whole clip
    words = set(english.transcript.lower().replace(",", " ").replace(".", " ").split())
    assert english.language == "de" and len(words & {"this", "morning", "i", "my", "sister", "the", "kitchen"}) >= 3, \
        english


def test_transcribe_language_and_translate_set_the_profile_s_asr():
    from runtime.cli import _speech_overrides
    from runtime.cli_parser import build_parser
    from runtime.errors import UserError

    args = build_parser().parse_args(["transcribe", "x.wav", "--profile", "whisper-base", "--language", "de",
                                      "--translate"])
    asr = load_profile(args.profile, overrides=_speech_overrides(args)).asr
    assert (asr.language, asr.task) == ("de", "translate")
    assert _speech_overrides(build_parser().parse_args(["transcribe", "x.wav"])) == []
    with pytest.raises(UserError, match="language code"):
        _speech_overrides(build_parser().parse_args(["transcribe", "x.wav", "--language", "German"]))


def test_a_spoken_item_sent_whole_is_heard_in_the_session_s_language():
    from runtime.pipeline.whole_utterance import transcribe_whole

    stream = _Stream(english_only=False)
    audio = np.zeros(3200, np.float32)
    assert transcribe_whole(lambda: stream, audio, 100, Speech("de")) == ("Hallo", "de")
    assert stream.speech == Speech("de")
    with pytest.raises(ConfigError, match="English-only"):  # Session.add_spoken_item says so in an error event
        transcribe_whole(lambda: _Stream(english_only=True), audio, 100, Speech("de"))


ENGLISH = "The train to Boston leaves from platform four at seven in the morning."


@pytest.mark.slow  # Whisper base loaded twice and streamed over a 4 s sentence: 15-20 s
def test_the_shipped_base_adapter_makes_the_live_words_readable():
    """The whisper-base profile's stream alone (no final pass: the words shown while a turn is spoken), with the
    adapter distilled for it and bare: the bare block-causal base repeats and stops ("train train train"; 196 % WER
    on the human clips), the adapted one writes most of the sentence (measured: "the train to masterly from platforms
    4 at the morning", 38 %), on espeak's robotic voice."""
    from runtime.models.asr.registry import load_asr
    from runtime.train.text_norm import wer

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    profile = load_profile("whisper-base").asr
    assert profile.adapter == "builtin:causal-whisper-base"
    audio = espeak(ENGLISH, "en-us")
    errors = {}
    for adapter in (profile.adapter, ""):
        cfg = replace(profile, adapter=adapter, final_pass="none", graph_runtime="torch", language="en")
        try:
            asr = load_asr(cfg, device="cpu", dtype="float32")
        except CheckpointNotFound as err:
            pytest.skip(str(err))
        _, done = streamed(asr, audio, None, chunk=len(audio))  # the clip whole: the same words, no previews
        errors[adapter] = wer([ENGLISH], [done.transcript])
    assert errors[profile.adapter] <= 0.5, errors
    assert errors[profile.adapter] < errors[""], errors
