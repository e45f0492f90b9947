"""A spoken user message sent whole (`conversation.item.create` with `input_audio`), transcribed in one worker job.

It is not the live input buffer: the audio processor streams that chunk by chunk, with turn detection, as it
arrives. This utterance is already complete, so it goes through an ASR stream of its own, leaving the live
buffer's stream as it was, in the same chunks and the same `BufferTranscript` fold, so its transcript reads as a
committed buffer's would. The session runs it on the worker (`Session.add_spoken_item`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.models.asr.base import ASRStream, Speech
from runtime.pipeline.input_buffer import BufferTranscript


def transcribe_whole(open_asr: Callable[[], ASRStream], samples: np.ndarray, chunk_ms: int,
                     speech: Speech | None = None) -> tuple[str, str]:
    """One utterance through an ASR stream of its own, in the session's chunks and the session's language and task
    (`speech`; None: the profile's), on the worker: (its transcript, the language the ASR heard)."""
    stream = open_asr()
    try:
        if speech is not None:
            stream.set_speech(speech)
        buffer, chunk = BufferTranscript("whole", 0.0), SAMPLE_RATE * chunk_ms // 1000
        for start in range(0, len(samples), chunk):
            for update in stream.accept(AudioChunk(samples[start : start + chunk], start)):
                buffer.fold(update)
        for update in stream.finish():
            buffer.fold(update)
        return buffer.text, buffer.language
    finally:
        stream.close()
