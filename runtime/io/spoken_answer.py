"""`runtime ask FILE QUESTION --speak answer.wav`: the answer spoken by the voice and written as one wav file.

The answer is spoken as it decodes, not after: each text delta goes through the clause splitter, and each clause
it completes is synthesised at once by a job on the device worker (`Priority.SPEECH`, ahead of further decode
steps), so the voice works while the model writes the rest. The jobs are awaited in order, so the file holds the
clauses in the order they were written whatever order they finish in. Nothing here runs model compute on the event
loop: `on_event` only splits strings and schedules jobs.

The wav keeps the voice's own rate (22,050 Hz for Piper's medium voices), 16-bit mono: no resampling for a file.
`first_clause_s` (from the answer's first text delta to its first clause's audio being ready) is reported: the
part of a voice-to-voice latency that the voice adds.
"""

from __future__ import annotations

import asyncio
import time
import wave
from pathlib import Path

import numpy as np

from runtime.events import Event, ResponseTextDelta
from runtime.models.tts.clauses import ClauseSplitter
from runtime.models.tts.voice import Speech, Voice
from runtime.worker import DeviceWorker, Priority


class SpokenAnswer:
    def __init__(self, voice: Voice, worker: DeviceWorker, path: Path, speed: float = 1.0) -> None:
        self.voice = voice
        self.worker = worker
        self.path = path
        self.speed = speed
        self.splitter = ClauseSplitter()
        self.clauses: list[str] = []
        self._jobs: list[asyncio.Task[Speech]] = []
        self._first_delta: float | None = None
        self.first_clause_s: float | None = None

    def on_event(self, event: Event) -> None:
        """The session's publish hook, on the event loop: the answer's text deltas are split and spoken."""
        if isinstance(event, ResponseTextDelta):
            if self._first_delta is None:
                self._first_delta = time.perf_counter()
            for clause in self.splitter.push(event.delta):
                self._speak(clause)

    def _speak(self, clause: str) -> None:
        self.clauses.append(clause)
        job = asyncio.create_task(self.worker.run(Priority.SPEECH, self.voice.synthesize, clause, self.speed))
        if len(self._jobs) == 0:
            job.add_done_callback(self._first_ready)
        self._jobs.append(job)

    def _first_ready(self, job: asyncio.Task[Speech]) -> None:
        if self._first_delta is not None and not job.cancelled() and job.exception() is None:
            self.first_clause_s = time.perf_counter() - self._first_delta

    async def finish(self) -> float:
        """Speak what the splitter still holds, wait for every clause and write the wav; its duration in seconds."""
        for clause in self.splitter.finish():
            self._speak(clause)
        speeches = [await job for job in self._jobs]
        samples = np.concatenate([s.int16() for s in speeches]) if speeches else np.zeros(0, dtype=np.int16)
        await asyncio.to_thread(write_wav, self.path, samples, self.voice.sample_rate)
        return len(samples) / self.voice.sample_rate


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    """16-bit mono PCM `samples` as a wav file at `rate` Hz."""
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.ascontiguousarray(samples, dtype="<i2").tobytes())
