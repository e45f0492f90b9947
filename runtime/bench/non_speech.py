"""A small set of sounds with no words in them, generated in code: what a caption must stay blank over.

Whisper writes words over silence and noise ("you", "Thank you.", "I'm going to go to the bathroom"), so
`runtime bench asr-quality` and the tests measure the words the runtime captions on these: the target is 0. Nothing
is downloaded or recorded: each clip is drawn from a generator seeded by its name, so the set is the same on every
machine, and the kinds are the ones a live captioner hears between or instead of speech:

- silence: digital zeros, and a quiet room (brown noise near the floor of a laptop microphone);
- noise of three colours (white, pink, brown) at a talking level;
- tones: a steady 440 Hz sine, a 1 kHz beep train, a sweep;
- music-like chords: triads of harmonic notes with attack and decay, a bar of changing chords;
- clicks: an impulse train, as a keyboard or a clock;
- a cough: bursts of band-passed noise with a fast attack, the envelope of a cough (not a recording of one).

Levels are RMS in dBFS, around speech's (-30 to -20 dBFS on the development clips) unless the kind is quiet; a
clip whose peaks would pass `PEAK` at that level (the sparse clicks) is made quieter instead.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from runtime.chunks import SAMPLE_RATE

SECONDS = 4.0  # each clip; a turn's worth, long enough for a 300 ms stream to decode a few blocks
PEAK = 0.9  # no clip peaks above this


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _at_level(x: np.ndarray, dbfs: float) -> np.ndarray:
    """`x` at an RMS of `dbfs`, or quieter where that would put a peak above PEAK (no clipping: sparse clicks)."""
    rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    peak = float(np.abs(x).max())
    gain = min(10 ** (dbfs / 20) / rms, PEAK / peak) if rms > 0 else 0.0
    return (x * gain).astype(np.float32)


def _coloured(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    """Noise whose power falls as 1/f^exponent (0 white, 1 pink, 2 brown), shaped in the frequency domain."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1 / SAMPLE_RATE)
    f[0] = f[1]
    return np.fft.irfft(spectrum / f ** (exponent / 2), n)


def _t(seconds: float = SECONDS) -> np.ndarray:
    return np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE


def _note(freq: float, t: np.ndarray, harmonics: int = 5) -> np.ndarray:
    """A harmonic tone (partials falling as 1/k), as a plucked or bowed string's."""
    return sum(np.sin(2 * np.pi * freq * k * t) / k for k in range(1, harmonics + 1))


def _envelope(t: np.ndarray, attack: float, decay: float) -> np.ndarray:
    return np.minimum(t / attack, 1.0) * np.exp(-t / decay)


def silence(name: str) -> np.ndarray:
    return np.zeros(len(_t()), np.float32)


def room(name: str) -> np.ndarray:
    return _at_level(_coloured(_rng(name), len(_t()), 2.0), -60)


def noise(exponent: float) -> Callable[[str], np.ndarray]:
    return lambda name: _at_level(_coloured(_rng(name), len(_t()), exponent), -30)


def tone(name: str) -> np.ndarray:
    return _at_level(np.sin(2 * np.pi * 440 * _t()), -25)


def beeps(name: str) -> np.ndarray:
    t = _t()
    on = (t % 0.5) < 0.2  # 200 ms beeps every 500 ms
    return _at_level(np.sin(2 * np.pi * 1000 * t) * on, -25)


def sweep(name: str) -> np.ndarray:
    t = _t()
    f0, f1 = 200.0, 4000.0  # exponential sweep over the clip
    phase = 2 * np.pi * f0 * SECONDS / np.log(f1 / f0) * (np.exp(t / SECONDS * np.log(f1 / f0)) - 1)
    return _at_level(np.sin(phase), -25)


def chord(name: str) -> np.ndarray:
    """One struck major triad (A3, C#4, E4) ringing out, struck again halfway."""
    t = _t()
    half = SECONDS / 2
    local = np.where(t < half, t, t - half)
    x = sum(_note(f, t) for f in (220.0, 277.18, 329.63)) * _envelope(local, 0.01, 0.8)
    return _at_level(x, -25)


def chords(name: str) -> np.ndarray:
    """A bar of chords (I-vi-IV-V in C, a chord every half second) over a bass note: music-like, with rhythm."""
    t = _t()
    roots = [261.63, 220.0, 174.61, 196.0]
    out = np.zeros(len(t))
    step = 0.5
    for i in range(int(SECONDS / step)):
        root = roots[i % 4]
        a, b = round(i * step * SAMPLE_RATE), round((i + 1) * step * SAMPLE_RATE)
        local = t[a:b] - t[a]
        notes = (root, root * 5 / 4, root * 3 / 2, root / 2)
        out[a:b] = sum(_note(f, local) for f in notes) * _envelope(local, 0.005, 0.3)
    return _at_level(out, -25)


def clicks(name: str) -> np.ndarray:
    rng = _rng(name)
    x = np.zeros(len(_t()))
    for at in np.cumsum(rng.uniform(0.08, 0.3, 40)):  # irregular, as typing
        i = round(at * SAMPLE_RATE)
        if i + 80 < len(x):
            x[i : i + 80] += rng.standard_normal(80) * np.exp(-np.arange(80) / 10)
    return _at_level(x, -30)


def cough(name: str) -> np.ndarray:
    """Two bursts of noise band-passed to 300-3000 Hz, each with a 10 ms attack and a 150 ms decay."""
    rng = _rng(name)
    t = _t()
    x = np.zeros(len(t))
    for at in (0.8, 1.3):
        i = round(at * SAMPLE_RATE)
        n = round(0.6 * SAMPLE_RATE)
        burst = rng.standard_normal(n) * _envelope(np.arange(n) / SAMPLE_RATE, 0.01, 0.15)
        x[i : i + n] += burst
    spectrum = np.fft.rfft(x)
    f = np.fft.rfftfreq(len(x), 1 / SAMPLE_RATE)
    spectrum[(f < 300) | (f > 3000)] = 0
    return _at_level(np.fft.irfft(spectrum, len(x)), -25)


KINDS: dict[str, Callable[[str], np.ndarray]] = {
    "silence": silence, "room": room, "white-noise": noise(0.0), "pink-noise": noise(1.0),
    "brown-noise": noise(2.0), "tone-440hz": tone, "beeps-1khz": beeps, "sweep": sweep, "chord": chord,
    "chords": chords, "clicks": clicks, "cough": cough,
}
QUICK = ("silence", "room", "pink-noise", "tone-440hz", "chords", "cough")  # one of each kind


def non_speech_set(quick: bool = False) -> list[tuple[str, np.ndarray]]:
    """(name, 16 kHz float32 audio of SECONDS) for every kind, or one of each with `quick`."""
    names = QUICK if quick else tuple(KINDS)
    return [(name, KINDS[name](name)) for name in names]
