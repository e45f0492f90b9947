"""`runtime serve --camera 0 --speak`: the local session's spoken answers played on this machine's speaker.

The session speaks as it does for any client (`output_modalities: ["audio"]`, `response.output_audio.delta` events
of 24 kHz PCM16, clause by clause while the answer decodes: pipeline/spoken_output.py); `Player.on_event` is the
local session's publish hook, and a player thread writes the audio to an `AudioOutput`. What the microphone hears
while that audio plays is gated (`speech_gate.py`), so the agent does not answer its own voice.

The device: ALSA through PyAV's libavdevice (`format="alsa"`), the same library and backend the microphone is read
with (`devices.py`), so no new dependency. A write blocks while the device's buffer is full: the player thread is
paced by the sound card, never the event loop. Tests stand in a fake `AudioOutput`.

Bounded, and what happens when full: the queue between the loop and the player holds at most `max_queued_s` of
audio (default 120 s, about 5.8 MB at 24 kHz; an answer is at most the profile's `lm.max_new_tokens`, well under a
minute of speech). The hook cannot wait (it is called for every event on the loop), so a delta that finds the queue
full is dropped and counted (`dropped_s`, logged once per response), rather than holding the session's events.
A cancelled or failed response (`response.done` not `completed`, e.g. `/cancel`) drops what it still had queued:
the sound stops after what the device already holds.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from runtime.errors import DeviceNotFound, UserError
from runtime.events import Event, ResponseAudioDelta, ResponseDone
from runtime.io.audio_formats import PCM, AudioFormat
from runtime.io.source import Source
from runtime.io.speech_gate import HANGOVER_S, GatedSource, SpeechGate

if TYPE_CHECKING:
    from runtime.config import Profile
    from runtime.loaded_models import Models
    from runtime.session_config import SessionConfig

log = logging.getLogger(__name__)

RATE = 24_000  # what the local session asks its voice for: the API's audio/pcm
MAX_QUEUED_S = 120.0
SPEAKER_FIX = "check the device name (aplay -L), or leave out --speak"


class AudioOutput(Protocol):
    """Where played audio goes: 16-bit mono PCM at `rate`."""

    rate: int

    def write(self, pcm: np.ndarray) -> None:
        """Play `pcm` (int16); blocks while the device's buffer is full, so the caller runs at the device's pace."""
        ...

    def close(self) -> None: ...


class AlsaOutput:
    """The default (or a named) ALSA playback device through PyAV's libavdevice."""

    def __init__(self, device: str = "default", rate: int = RATE, *, fix: str = SPEAKER_FIX) -> None:
        import av

        from runtime.io.devices import _stderr_captured, _use_system_alsa_config, device_backends

        if "alsa" not in device_backends():
            raise DeviceNotFound(f"no speaker {device!r} (alsa): this PyAV build has no alsa output; {fix}")
        _use_system_alsa_config()
        self.rate, self.device = rate, device
        with _stderr_captured() as noise:  # alsa-lib's own lines, said once in ours instead
            try:
                self._container = av.open(device, mode="w", format="alsa")
                self._stream = self._container.add_stream("pcm_s16le", rate=rate, layout="mono")
                self._container.start_encoding()  # opens the device now, not at the first answer
            except Exception as err:  # noqa: BLE001 - one line naming the device
                error = err
            else:
                error = None
        if error is not None:
            detail = next((line.split(") ", 1)[-1] for line in reversed(noise) if "ALSA lib" in line), "")
            raise DeviceNotFound(f"no speaker {device!r} (alsa): {detail or error}; {fix}")
        self._pts = 0

    def write(self, pcm: np.ndarray) -> None:
        import av

        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16",
                                           layout="mono")
        frame.sample_rate, frame.pts = self.rate, self._pts
        self._pts += len(pcm)
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for packet in self._stream.encode(None):
                self._container.mux(packet)
        self._container.close()


class Player:
    """Plays a session's spoken answers on `output` from a thread of its own; tells `gate` when sound plays.

    `on_event` (the session's publish hook, on the loop) only decodes base64 and queues. `close()` stops the
    thread, dropping what is still queued (Ctrl-C: stop talking); `close(play_rest=True)` plays it out first."""

    def __init__(self, output: AudioOutput, gate: SpeechGate, *, max_queued_s: float = MAX_QUEUED_S) -> None:
        self.output, self.gate = output, gate
        self.max_samples = int(max_queued_s * output.rate)
        self._queue: queue.Queue[tuple[str, np.ndarray] | None] = queue.Queue()  # bounded by `_queued` below
        self._queued = 0  # samples waiting (the bound is on audio, not on a count of deltas of varying size)
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()  # responses cut short: their queued audio is skipped
        self._stopping = False
        self.dropped_s = 0.0
        self.played_s = 0.0
        self._warned: str | None = None
        self._thread = threading.Thread(target=self._play, name="speaker", daemon=True)
        self._thread.start()

    def on_event(self, event: Event) -> None:
        if isinstance(event, ResponseAudioDelta):
            pcm = np.frombuffer(event.audio(), dtype="<i2")
            with self._lock:
                full = self._queued + len(pcm) > self.max_samples
                if not full:
                    self._queued += len(pcm)
            if not full:
                self._queue.put((event.response_id, pcm))
                return
            self.dropped_s += len(pcm) / self.output.rate
            if self._warned != event.response_id:
                self._warned = event.response_id
                log.warning("the speaker's queue is full (%.0f s of audio): audio of %s dropped",
                            self.max_samples / self.output.rate, event.response_id)
        elif isinstance(event, ResponseDone) and event.response.get("status") == "cancelled":
            with self._lock:  # barge-in or /cancel: what was not played yet is not played
                self._cancelled.add(str(event.response.get("id")))

    def _play(self) -> None:
        while (entry := self._queue.get()) is not None:
            response_id, pcm = entry
            with self._lock:
                self._queued -= len(pcm)
                skip = self._stopping or response_id in self._cancelled
            if skip:
                continue
            self.gate.playing(len(pcm) / self.output.rate)  # before the write: the sound starts as it lands
            try:
                self.output.write(pcm)
            except Exception:  # a device that fails costs the sound, not the session
                log.exception("playing the answer failed")
                continue
            self.played_s += len(pcm) / self.output.rate

    def close(self, play_rest: bool = False) -> None:
        """Stop the player thread and close the output; idempotent."""
        with self._lock:
            self._stopping = self._stopping or not play_rest
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
            self.output.close()


class LocalSpeech:
    """What `serve --speak` adds to the local session: a player on `output`, the gate, and the session's config
    (spoken answers, each spoken turn answered, no barge-in by voice: the gate would never let it through)."""

    def __init__(self, output: AudioOutput, *, gate_microphone: bool, hangover_s: float = HANGOVER_S) -> None:
        self.gate = SpeechGate(hangover_s)
        self.player = Player(output, self.gate)
        self.gate_microphone = gate_microphone
        self.gated: GatedSource | None = None

    def source(self, source: Source) -> Source:
        """The local source, its audio gated while the voice plays when it is a microphone (a file is not)."""
        if not self.gate_microphone:
            return source
        self.gated = GatedSource(source, self.gate)
        return self.gated

    def config(self, profile: Profile, models: Models) -> SessionConfig:
        from runtime.session_builder import initial_config

        base = initial_config(profile, models, answer_turns=True)
        detection = None if base.turn_detection is None else replace(base.turn_detection, interrupt_response=False)
        return replace(base, output_modalities=("audio",), turn_detection=detection,
                       output=replace(base.output, format=AudioFormat(PCM, self.player.output.rate)))

    def publish(self, then: Callable[[Event], None] | None) -> Callable[[Event], None]:
        """The session's publish hook: the player first, then `then` (serve's browser watchers)."""
        def hook(event: Event) -> None:
            self.player.on_event(event)
            if then is not None:
                then(event)
        return hook

    def close(self) -> str:
        """Stop playing (Ctrl-C or the end of the source: stop talking); a line on what was played and gated."""
        self.player.close()
        gated = f", {self.gated.gated_s:.1f} s of microphone gated" if self.gated is not None else ""
        dropped = f", {self.player.dropped_s:.1f} s dropped (queue full)" if self.player.dropped_s else ""
        return f"spoke {self.player.played_s:.1f} s of answers{gated}{dropped}"


def local_speech(args: argparse.Namespace, source: Source | None) -> LocalSpeech:
    """`serve --speak [--speaker NAME]`, checked and opened before any model loads: one line when there is no local
    source to answer, no voice package, or no speaker. A microphone is gated; a file (`--source`) is not."""
    if source is None:
        raise UserError("--speak speaks the local session's answers: give it one, --camera N, --mic NAME or "
                        "--source FILE")
    from runtime.models.tts import DEFAULT_VOICE, check_voice

    check_voice(DEFAULT_VOICE)
    return LocalSpeech(AlsaOutput(args.speaker), gate_microphone=args.source is None and not args.no_mic)
