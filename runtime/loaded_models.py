"""The models a process loads once and shares between its sessions, loaded on the device worker (the thread
that will run them): the ASR, the answerer, the vision half of a vision-language model when the language
model can see, the turn-detection models, and the voice that speaks answers (`runtime serve` loads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runtime.config import Profile, check_memory_fits
from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.asr.base import StreamingASR
from runtime.models.asr.registry import load_asr
from runtime.models.lm import AnswerBackend, NoAnswerer, load_answerer
from runtime.models.lm.remote_answerer import RemoteAnswerer
from runtime.models.lm.weights import is_vlm
from runtime.models.loading import configure_threads, load_progress, resolve_checkpoint, session_threads
from runtime.models.ocr.reader import TextReader
from runtime.models.tts.voice import Voice
from runtime.models.turns.silero_vad import SileroVAD
from runtime.models.turns.smart_turn import SmartTurn
from runtime.models.vlm.base import FrameEncoder
from runtime.models.vlm.llava_onevision import VisionEncoder
from runtime.pipeline.turn_taking import TurnModels
from runtime.worker import DeviceWorker, Priority


@dataclass
class Models:
    asr: StreamingASR
    answerer: AnswerBackend
    vision: FrameEncoder | None = None  # the VLM's vision half, when the language model can see
    turns: TurnModels | None = None  # Silero VAD and Smart Turn (turn detection); None: commits by hand only
    reader: TextReader | None = None  # PP-OCRv4, when the profile reads text on screen (screen.read)
    remote: RemoteAnswerer | None = None  # lm.backend = openai: a server answers (`answerer` is then NoAnswerer)
    voice: Voice | None = None  # speaks answers (`output_modalities: ["audio"]`); None: answers are text only


def load_reader(profile: Profile, progress: Callable[[str], None] | None = None) -> TextReader | None:
    if not profile.screen.read:
        return None
    with load_progress(progress, "ocr", profile.screen.model, "cpu", "float32"):
        return TextReader(profile.screen.model)


def load_turn_models(progress: Callable[[str], None] | None = None) -> TurnModels | None:
    """The turn-detection models, or None (said once through `progress`) when their package is missing: the
    session then has no turn detection and a client commits by hand."""
    try:
        return TurnModels(SileroVAD.load(), SmartTurn.load())
    except CheckpointNotFound as err:
        if progress:
            progress(f"no turn detection: {err}")
        return None


def load_voice_model(progress: Callable[[str], None] | None = None) -> Voice | None:
    """The default voice, or None (said once through `progress`) when its package or piper-tts is missing: the
    server then answers in text only and refuses `output_modalities: ["audio"]`, naming what to install."""
    from runtime.models.tts import DEFAULT_VOICE, load_voice

    try:
        return load_voice(DEFAULT_VOICE)
    except CheckpointNotFound as err:
        if progress:
            progress(f"no voice: {err}")
        return None


def load_models(profile: Profile, worker: DeviceWorker, progress: Callable[[str], None] | None = None, *,
                answers: bool = True) -> Models:
    """Load the profile's models on the worker thread (the thread that will run them). `answers=False` loads
    the ASR alone (`runtime transcribe`: no question comes, so neither the language model nor its vision)."""
    if answers and profile.lm.grounded and _sees_video(profile):  # before anything loads
        raise ConfigError(f"lm.grounded answers only from what was heard and read, and {profile.lm.model} also "
                          "sees the video: set one of lm.grounded=false or video.memory=false")
    worker.call(Priority.CONTROL, configure_threads, session_threads(profile.threads))
    asr = worker.call(Priority.CONTROL, load_asr, profile.asr, device=profile.device,
                      dtype=profile.dtype, progress=progress)
    turns = worker.call(Priority.CONTROL, load_turn_models, progress) if profile.pipeline.turn_detection != "none" \
        else None
    reader = worker.call(Priority.CONTROL, load_reader, profile, progress)
    if not answers:
        return Models(asr=asr, answerer=NoAnswerer(), turns=turns, reader=reader)
    if profile.lm.backend == "openai":  # nothing to load: the server holds the model
        return Models(asr=asr, answerer=NoAnswerer(), turns=turns, reader=reader,
                      remote=RemoteAnswerer.load(profile.lm, progress))
    answerer = worker.call(Priority.CONTROL, load_answerer, profile.lm, seed=profile.seed,
                           device=profile.device, dtype=profile.dtype, progress=progress)
    vision = None
    if profile.video.memory:
        path = resolve_checkpoint(profile.lm.model, role="lm")
        if not is_vlm(path):
            if progress:
                progress(f"lm {profile.lm.model} is text-only: video frames are counted, not remembered")
        elif profile.lm.backend != "engine":
            if progress:
                progress("video memory needs lm.backend = engine: video frames are counted, not remembered")
        else:
            check_memory_fits(profile)
            vision = worker.call(Priority.CONTROL, VisionEncoder.load, profile.lm.model, grid=profile.video.grid,
                                 device=profile.device, dtype=profile.dtype, progress=progress)
    return Models(asr=asr, answerer=answerer, vision=vision, turns=turns, reader=reader)


def _sees_video(profile: Profile) -> bool:
    """Whether the profile's answerer will keep a video memory: a vision-language model on the engine."""
    return (profile.video.memory and profile.lm.backend == "engine"
            and is_vlm(resolve_checkpoint(profile.lm.model, role="lm")))
