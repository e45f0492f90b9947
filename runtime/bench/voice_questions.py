"""What the user says in `runtime bench voice`'s voice-to-voice rows (voice_latency.py times the answers): the facts
put into the conversation, and the spoken questions about them as the 100 ms chunks of 24 kHz PCM16 a microphone
client sends (`SILENCE`: the chunk it sends while it waits for an answer).

The questions are espeak-ng speech (`en-us`, 22,050 Hz, resampled to the API's 24 kHz by linear interpolation), with
`LEAD_S` of digital silence before the speech. Each clip ends at its last speech sample (the last above `QUIET`),
padded with digital silence to whole chunks, so that `speech_end_s` is where the measured latency starts.
"""

from __future__ import annotations

import base64
import io
import subprocess
import wave
from dataclasses import dataclass

import numpy as np

from runtime.errors import UserError

RATE = 24_000
CHUNK_S = 0.1
CHUNK = int(RATE * CHUNK_S)
LEAD_S = 0.4
QUIET = 1e-3
FACTS = ("Here are my notes for today. The team meeting moved to Thursday at three. The budget report is in the blue "
         "folder. The train to Boston leaves from platform four. The red car outside belongs to our neighbor Tom. "
         "Lunch is at the Italian place on Main Street.")
# (spoken question, words one of which the answer should hold): each one Whisper tiny.en heard word for word from
# espeak-ng (several first drafts it did not: "Who is bringing the budget?" became "This bringing the market")
QUESTIONS = (
    ("What day is the meeting?", ("thursday",)),
    ("Where is the budget report?", ("blue", "folder")),
    ("Where does the train to Boston leave from?", ("four", "4")),
    ("Who does the red car belong to?", ("tom", "neighbor")),
    ("Where are we having lunch?", ("italian", "main")),
)


@dataclass(frozen=True)
class Question:
    text: str
    expect: tuple[str, ...]
    chunks: list[str]  # base64 PCM16 at 24 kHz, 100 ms each
    speech_end_s: float  # offset of the last speech sample from the clip's start


def espeak(text: str) -> np.ndarray:
    """`text` spoken by espeak-ng (en-us), float32 mono at 24 kHz."""
    try:
        wav = subprocess.run(["espeak-ng", "-v", "en-us", "--stdout", text], check=True, capture_output=True).stdout
    except FileNotFoundError:
        raise UserError("runtime bench voice speaks its questions with espeak-ng: apt-get install espeak-ng") from None
    with wave.open(io.BytesIO(wav)) as w:
        rate = w.getframerate()
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768
    t = np.arange(round(len(samples) * RATE / rate)) / RATE
    return np.interp(t, np.arange(len(samples)) / rate, samples).astype(np.float32)


def question(text: str, expect: tuple[str, ...]) -> Question:
    speech = espeak(text)
    loud = np.flatnonzero(np.abs(speech) > QUIET)
    speech = speech[: int(loud[-1]) + 1]
    clip = np.concatenate([np.zeros(int(LEAD_S * RATE), np.float32), speech])
    clip = np.concatenate([clip, np.zeros(-len(clip) % CHUNK, np.float32)])
    raw = (np.clip(clip, -1, 32767 / 32768) * 32768).astype("<i2").tobytes()
    chunks = [base64.b64encode(raw[i : i + 2 * CHUNK]).decode() for i in range(0, len(raw), 2 * CHUNK)]
    return Question(text, expect, chunks, LEAD_S + len(speech) / RATE)


SILENCE = base64.b64encode(bytes(2 * CHUNK)).decode()
