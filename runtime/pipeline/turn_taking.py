"""Turn detection on one session's audio: Silero VAD on every chunk, the turn rule of the session's current
`turn_detection` (server_vad, or semantic_vad with Smart Turn judging each pause), as `TurnEvent`s for the
audio processor, which commits the buffer at the end of a turn.

`detect` runs on the device worker (the models are compute); `reset` runs on the loop between two `detect`
calls of the same processor, never during one. The VAD sees every sample from the session's start, whether or
not detection is on, so its windows stay on the session's sample grid; it costs well under 1% of a core.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.models.turns.silero_vad import WINDOW_SAMPLES, SileroVAD
from runtime.models.turns.smart_turn import SmartTurn
from runtime.pipeline.turn_detector import SpeechStarted, TurnDetector, VADSettings
from runtime.pipeline.turn_signals import IdleTimeout, TurnEvent
from runtime.session_config import TurnDetection
from runtime.session_state import AnswerActivity, SessionSettings

RECENT_S = 8  # what Smart Turn reads: the last 8 s of the turn


@dataclass
class TurnModels:
    """Loaded once per process, shared by sessions: the VAD always, Smart Turn for semantic_vad."""

    vad: SileroVAD
    smart_turn: SmartTurn | None = None


class TurnTaking:
    def __init__(self, models: TurnModels, settings: SessionSettings, activity: AnswerActivity) -> None:
        """`activity`: when the last answer ended, which an idle timeout counts from (read only)."""
        self.models, self.settings, self.activity = models, settings, activity
        self._timed_out_after: float | None = None  # the answer end an idle timeout already fired for
        self.vad = models.vad.open_stream()
        self._config: TurnDetection | None = None
        self._detector: TurnDetector | None = None
        self._buffer_start = 0
        self._recent: deque[AudioChunk] = deque()  # the newest chunks, about RECENT_S (Smart Turn's input)
        self._recent_samples = 0
        self._speech_windows = 0  # VAD windows at the threshold since the buffer's start (`speech_s`)

    def reset(self, at_sample: int) -> None:
        """The input buffer now starts at `at_sample` (a commit or a clear): speech state and audio forgotten."""
        self._buffer_start = at_sample
        self._speech_windows = 0
        if self._detector is not None:
            self._detector.reset(at_sample)
        while self._recent and self._recent[0].end_sample <= at_sample:
            self._recent_samples -= len(self._recent.popleft().samples)

    def listening(self) -> bool:
        return self.settings.config.turn_detection is not None

    def pause_start(self) -> int | None:
        """The sample where the speaker's current pause began (None: speaking, or no speech since the buffer's
        start): the audio processor prepares the final pass while the pause is timed (pipeline/pause_pass.py)."""
        return self._detector.pause_start if self._detector is not None else None

    def speech_s(self) -> float:
        """Seconds of VAD windows at the turn rule's threshold since the buffer's start: the speech gate's evidence
        (pipeline/transcript_gate.py), so one loud window does not count as speech."""
        return self._speech_windows * WINDOW_SAMPLES / SAMPLE_RATE

    def detect(self, chunk: AudioChunk) -> list[TurnEvent | IdleTimeout]:
        probs = self.vad.accept(chunk.samples)
        first = self.vad.windows_done - len(probs)
        config = self.settings.config.turn_detection
        threshold = config.threshold if config is not None else 0.5
        skip = max(0, -(-self._buffer_start // WINDOW_SAMPLES) - first)  # windows that began before the buffer
        self._speech_windows += int((probs[skip:] >= threshold).sum())
        self._remember(chunk)
        detector = self._current_detector()
        if detector is None:
            return []
        settings = self.settings.config
        events: list[TurnEvent | IdleTimeout] = [
            TurnEvent(True, e.audio_start_sample) if isinstance(e, SpeechStarted)
            else TurnEvent(False, e.audio_end_sample, settings) for e in detector.push(probs.tolist(), first)]
        idle = self._idle(chunk, detector)
        return events + ([idle] if idle is not None else [])

    def _idle(self, chunk: AudioChunk, detector: TurnDetector) -> IdleTimeout | None:
        """An idle timeout, once per answer: no speech from the last answer's end (or the buffer's start, if
        later) for the session's `idle_timeout_ms`, with no answer in progress."""
        config, ended = self.settings.config.turn_detection, self.activity.last_answer_end
        if config is None or not config.idle_timeout_ms or ended is None or ended == self._timed_out_after:
            return None
        if detector.speaking or self.activity.busy:
            return None
        since = max(round(ended * SAMPLE_RATE), self._buffer_start)
        if chunk.end_sample - since < config.idle_timeout_ms * SAMPLE_RATE // 1000:
            return None
        self._timed_out_after = ended
        return IdleTimeout(since, chunk.end_sample, self.settings.config)

    def _current_detector(self) -> TurnDetector | None:
        config = self.settings.config.turn_detection
        if config != self._config:  # a session.update changed it: a new rule from the current buffer on
            self._config = config
            self._detector = None
            if config is not None:
                semantic = config.type == "semantic_vad" and self.models.smart_turn is not None
                self._detector = TurnDetector(
                    VADSettings(config.threshold, config.prefix_padding_ms, config.silence_duration_ms),
                    WINDOW_SAMPLES, end_of_turn=self._end_of_turn if semantic else None,
                    eagerness=config.eagerness if semantic else "auto")  # type: ignore[arg-type]
                self._detector.reset(self._buffer_start)
        return self._detector

    def _remember(self, chunk: AudioChunk) -> None:
        """Keep the chunk by reference (no copy on the per-chunk path); joined only when Smart Turn asks."""
        self._recent.append(chunk)
        self._recent_samples += len(chunk.samples)
        while self._recent_samples - len(self._recent[0].samples) >= RECENT_S * SAMPLE_RATE:
            self._recent_samples -= len(self._recent.popleft().samples)

    def _end_of_turn(self, pause_start: int) -> float:
        """Smart Turn's judgement of the turn's audio so far, the pause included (as its authors feed it: the
        silence after the last word is part of what it learned to read)."""
        assert self.models.smart_turn is not None
        audio = np.concatenate([c.samples for c in self._recent]) if self._recent else np.zeros(0, np.float32)
        since = self._buffer_start - self._recent[0].start_sample if self._recent else 0
        return self.models.smart_turn.end_of_turn_probability(audio[max(0, since):])
