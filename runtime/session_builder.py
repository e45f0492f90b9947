"""Assembles a session in one place, in dependency order, and hands each part only what it uses.

    channels, memories, shared signals  (plain objects, no model work)
    ASR stream, LM stream               (opened on the device worker: they allocate model state)
    prefiller, note writer              (need the LM stream; exist only when the model keeps one)
    audio, video, question processors   (need all of the above)

Nothing is wired after construction: no processor is handed another processor, and no attribute is set from
outside. A transport that measures something before the session's own channels (WebRTC's audio buffer, a
websocket's rate bounds) passes the `TransportStats` it owns, and the session's metrics read it.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from runtime.channels import BlockingChannel, LatestChannel
from runtime.chunks import AudioChunk, VideoFrame
from runtime.config import Profile, memory_sizes
from runtime.errors import ConfigError
from runtime.events import Event
from runtime.loaded_models import Models
from runtime.memory.conversation import Conversation
from runtime.memory.grounding import Grounding
from runtime.memory.screen_notes import ScreenNotes, token_counter
from runtime.memory.video import VideoMemory
from runtime.models.lm import NoAnswerer
from runtime.models.lm.answering import Answering
from runtime.pipeline.answers import QuestionProcessor
from runtime.pipeline.audio import AudioProcessor, BufferEnd
from runtime.pipeline.local_answers import OnWorker
from runtime.pipeline.notes import NoteWriter
from runtime.pipeline.prefill import ContextPrefiller
from runtime.pipeline.prefix_warming import PrefixWarmer
from runtime.pipeline.questions import Question
from runtime.pipeline.response_requests import ResponseRequests
from runtime.pipeline.screen import NotesWithQuestion, ScreenReader
from runtime.pipeline.spoken_output import Speaker
from runtime.pipeline.turn_taking import TurnTaking
from runtime.pipeline.video import VideoProcessor
from runtime.session import Session
from runtime.session_config import CAPTIONS, SessionConfig, TurnDetection
from runtime.session_parts import FrameSampler, SessionParts
from runtime.session_state import AnswerActivity, ContextChanges, HeardClock, SessionSettings, TransportStats
from runtime.worker import DeviceWorker, Priority

TURN_DETECTION = ("server_vad", "semantic_vad", "none")


def initial_config(profile: Profile, models: Models, *, answer_turns: bool) -> SessionConfig:
    """The config a session starts with: the profile's turn detection (when its models loaded), answering each
    turn only for a conversation client (`answer_turns`; a live captioner only splits its captions)."""
    kind = profile.pipeline.turn_detection
    if kind not in TURN_DETECTION:
        raise ConfigError(f"pipeline.turn_detection must be one of {', '.join(TURN_DETECTION)}, got {kind!r}")
    detection = None
    if kind != "none" and models.turns is not None:
        detection = TurnDetection(type=kind) if answer_turns else replace(CAPTIONS, type=kind)  # type: ignore[arg-type]
    return SessionConfig(turn_detection=detection)


async def open_session(profile: Profile, models: Models, worker: DeviceWorker, *,
                       transport: TransportStats | None = None, config: SessionConfig | None = None) -> Session:
    """A session ready to `start()`. Its per-stream model state is opened on the worker, never on the loop.
    `config`: what the client starts with (default: `initial_config` for a captioner)."""
    pipe = profile.pipeline
    settings = SessionSettings(config or initial_config(profile, models, answer_turns=False))
    audio_in: BlockingChannel[AudioChunk | BufferEnd] = BlockingChannel(pipe.audio_queue_chunks, "audio")
    video_in: LatestChannel[VideoFrame] = LatestChannel(pipe.video_queue_frames, "video")
    questions: BlockingChannel[Question] = BlockingChannel(pipe.question_queue, "questions")
    events: BlockingChannel[Event] = BlockingChannel(pipe.event_queue, "events")

    async def emit(event: Event) -> None:
        """Waits while the event channel is full: events are never dropped, the processors are slowed."""
        if not events.closed:
            await events.put(event)

    conversation = Conversation(answers_in_context=profile.lm.answers_in_context)
    heard, changes, activity = HeardClock(), ContextChanges(), AnswerActivity()
    video_memory = None
    if models.vision is not None:
        video_memory = VideoMemory(memory_sizes(profile), models.vision.dim, device=profile.device,
                                   dtype=models.vision.dtype)

    asr_stream = await worker.run(Priority.ASR, models.asr.open_stream)  # (the ASR's thread: module doc)
    try:
        lm_stream = await worker.run(Priority.CONTROL, models.answerer.open_stream)
    except BaseException:
        with contextlib.suppress(Exception):
            await worker.run(Priority.ASR, asr_stream.close)
        raise

    prefiller = notes = None
    if lm_stream is not None:  # the answerer keeps per-stream KV: prefill the context as it lands
        prefiller = ContextPrefiller(lm_stream, worker, conversation, changes, video=video_memory,
                                     embed_text=models.answerer.embed_text)
        if video_memory is not None and profile.video.notes:
            notes = NoteWriter(models.answerer, worker, video_memory, emit, activity,
                               max_tokens=profile.video.note_tokens)

    warmer = None
    answering: Answering = OnWorker(models.answerer, worker, lm_stream)
    if models.remote is not None:  # a server answers: its prefix cache plays the prefiller's part
        answering = models.remote
        warmer = PrefixWarmer(models.remote, conversation, changes, activity,
                              interval_s=profile.lm.warm_interval_s, settings=settings)
    screen, screen_notes = None, None
    if models.reader is not None:  # screen notes in the context within a budget; a question gets the ones it names
        screen_notes = ScreenNotes(conversation, max_tokens=profile.screen.max_note_tokens,
                                   selected_tokens=profile.screen.selected_tokens, keep=profile.screen.max_screens,
                                   count=token_counter(getattr(models.answerer, "tokenizer", None)))
        screen = ScreenReader(models.reader, profile.screen, worker, emit, screen_notes, changes)
        answering = NotesWithQuestion(answering, screen_notes)
    grounding = None  # with it, a question nothing heard or shown mentions is answered "not known yet"
    if profile.lm.grounded:  # (load_models refuses it beside a vision-language model's video memory)
        grounding = Grounding(conversation, screens=screen_notes.shown if screen_notes is not None else None)
    # the picture reaches the answerer through the screen reader or the video memory; without either, a question about
    # the screen is answered that this session cannot see it (pipeline/answers.py)
    sees_screen = screen is not None or video_memory is not None
    speaker = Speaker(models.voice, worker, emit, heard) if models.voice is not None else None
    answers = QuestionProcessor(questions, answering, emit, conversation, heard, activity, changes,
                                prefiller=prefiller, grounding=grounding, sees_screen=sees_screen, speaker=speaker)
    requests = ResponseRequests(questions, answers, activity, heard, settings, emit)
    turns = TurnTaking(models.turns, settings, activity) if models.turns is not None else None
    parts = SessionParts(
        audio_in=audio_in, video_in=video_in, questions=questions, events=events, emit=emit,
        sampler=FrameSampler(profile.video.fps), conversation=conversation, video_memory=video_memory,
        heard=heard, changes=changes, activity=activity, transport=transport or TransportStats(),
        settings=settings, requests=requests,
        audio=AudioProcessor(audio_in, models.asr.open_stream, worker, emit, conversation, heard, changes,
                             first_stream=asr_stream, turns=turns, sink=requests,
                             speech_gate=profile.pipeline.speech_gate,
                             vocabulary=lambda: settings.config.transcription_prompt(),
                             speech=lambda: settings.config.transcription_speech(profile.asr.language,
                                                                                 profile.asr.task),
                             reads_on=lambda: settings.config.captions_only()),
        video=VideoProcessor(video_in, worker, emit, changes, encoder=models.vision, memory=video_memory,
                             notes=notes, screen=screen),
        answers=answers, prefiller=prefiller, notes=notes, warmer=warmer,
        describe=describe(profile, models, video_memory),
    )
    return Session(profile, worker, parts)


def describe(profile: Profile, models: Models, video_memory: VideoMemory | None) -> dict[str, object]:
    """The models and settings a session runs with, as `session.created` reports them."""
    p = profile
    lm: dict[str, object] = {"backend": "none"}  # transcribe: no language model
    if not isinstance(models.answerer, NoAnswerer) or models.remote is not None:
        lm = {"backend": p.lm.backend, "model": p.lm.model, "max_new_tokens": p.lm.max_new_tokens}
        if models.remote is not None:
            lm["base_url"] = p.lm.base_url
    return {
        "profile": p.name,
        "device": p.device,
        "dtype": p.dtype,
        "random_weights": p.random_weights,
        "asr": {"backend": p.asr.backend, "model": p.asr.model, "language": p.asr.language},
        "lm": lm,
        "video": {"fps": p.video.fps, "max_side": p.video.max_side,
                  "memory_tokens": video_memory.sizes.budget() if video_memory else 0},
    }

