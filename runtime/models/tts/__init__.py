"""Speech out: the voice that speaks the agent's answers.

One concept a file:
- `voice.py`: the `Voice` protocol every voice implements (text -> `Speech`, float32 PCM at the voice's own rate)
  and the speed range the API allows;
- `piper_voice.py`: Piper's en_US-joe-medium (`builtin:piper-en-us-joe-medium`), VITS on onnxruntime with
  espeak-ng's phonemes through `piper-tts`;
- `clauses.py`: cuts the answer's streamed text deltas into speakable clauses as they arrive, the first one
  short so that sound starts soon, and strips what a voice must not read aloud (markdown marks);
- `output_audio.py`: the voice's samples encoded for the client as a stream: `audio/pcm` at 24 kHz and G.711
  `audio/pcmu` / `audio/pcma` at 8 kHz, resampled by PyAV (libswresample);
- `g711.py`: mu-law and A-law encoding from the standard's segment tables, in numpy.

`load_voice(ref)` is the one entry: it maps a `builtin:` name to its implementation. Loading and synthesis are
model compute: callers run them on the device worker, never on the event loop.
"""

from __future__ import annotations

from runtime.errors import ConfigError
from runtime.models.tts.voice import Voice

DEFAULT_VOICE = "builtin:piper-en-us-joe-medium"
VOICES = (DEFAULT_VOICE,)


def check_voice(ref: str = DEFAULT_VOICE) -> None:
    """Without loading the model: ConfigError for an unknown voice, CheckpointNotFound (one line, naming the
    install command) when its weights package or its library is missing, or its weight file fails its hash."""
    if ref != DEFAULT_VOICE:
        raise ConfigError(f"unknown voice {ref!r}; known: {', '.join(VOICES)}")
    from runtime.models.packaged import packaged_checkpoint
    from runtime.models.tts.piper_voice import NAME, import_piper

    packaged_checkpoint(NAME)
    import_piper()


def load_voice(ref: str = DEFAULT_VOICE, *, threads: int | None = None) -> Voice:
    """The voice `ref` loaded and ready; ConfigError names the known voices, CheckpointNotFound (one line) the
    install command of a missing package. `threads`: onnxruntime's intra-op threads for one synthesis (None: every
    core this process may use, piper_voice.py says why)."""
    if ref != DEFAULT_VOICE:
        raise ConfigError(f"unknown voice {ref!r}; known: {', '.join(VOICES)}")
    from runtime.models.tts.piper_voice import PiperVoiceModel

    return PiperVoiceModel.load(threads=threads)
