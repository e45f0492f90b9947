"""The offline speech synthesisers and the acoustic augmentation behind `runtime train synth-speech`.

Which voices are installed (espeak-ng's English accents x variants, flite's and festival's recorded-unit
voices), which of them are held out, one utterance spoken by one voice with random prosody, and what every clip
then goes through: speed perturbation, resampling to 16 kHz, silence trimming, room reverb and noise. Pure
functions of their inputs and the generator passed in, so a dataset is a function of its seed.

Why a formant shift (flite only, off unless asked): flite has four training voices, and a model trained on them
meets its held-out voice (rms) as a stranger. Reading a clip at `a` times its rate moves every formant by `a`,
like a shorter or longer vocal tract; asking flite for `1/a` times the pitch and `a` times the duration first
cancels what the same reading does to pitch and tempo. Each shift is a new speaker of the same
recorded voice, where plain speed perturbation moves pitch, tempo and formants together. (Measured once: it did
not lower the demo model's rms error; docs/training_fastconformer.md.)
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError, MediaError
from runtime.train.text_norm import expand

MIN_SECONDS, MAX_SECONDS = 1.0, 8.0

ESPEAK_ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-gbclan", "en-gb-x-rp", "en-gb-x-gbcwmd",
                  "en-029", "en-us-nyc")
ESPEAK_EXCLUDED_VARIANTS = frozenset({"whisper", "whisperf"})  # unvoiced: nothing like the demo's speech
HELDOUT_ESPEAK_VARIANTS = frozenset({"f4", "m6", "klatt3", "Andrea", "iven2", "steph2", "max", "travis"})
FLITE_VOICES = ("kal", "kal16", "awb", "rms", "slt")  # not awb_time: it only says times of day
HELDOUT_VOICES = frozenset({"flite:rms"})
FESTIVAL_VOICE_DIRS = (Path("/usr/share/festival/voices/english"), Path("/usr/share/festival/voices/us"))
ENGINE_WEIGHTS = {"espeak": 0.6, "flite": 0.2, "festival": 0.2}
ENGINES = tuple(ENGINE_WEIGHTS)
PACKAGES = {"espeak": "espeak-ng", "flite": "flite",
            "festival": "festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts"}


@dataclass(frozen=True)
class Voice:
    engine: str
    name: str  # espeak: "en-gb+f3"; flite: "slt"; festival: "kal_diphone"

    @property
    def id(self) -> str:
        return f"{self.engine}:{self.name}"

    @property
    def heldout(self) -> bool:
        if self.engine == "espeak":
            return self.name.split("+", 1)[1] in HELDOUT_ESPEAK_VARIANTS
        return self.id in HELDOUT_VOICES


# -- finding the installed voices ---------------------------------------------------------------------------
def _run(cmd: Sequence[str], stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(cmd), input=None if stdin is None else stdin.encode(), capture_output=True,
                          timeout=timeout, check=False)


def espeak_variants() -> list[str]:
    """espeak-ng's voice variants (`espeak-ng --voices=variant`, file column `!v/NAME`), sorted, minus the
    whispering ones."""
    out = _run(["espeak-ng", "--voices=variant"]).stdout.decode(errors="replace")
    names = {m.group(1) for m in re.finditer(r"!v/(\S+(?: \S+)*)", out)}  # "Mr serious" has a space
    return sorted(names - ESPEAK_EXCLUDED_VARIANTS)


def find_voices(engines: Sequence[str] | None = None) -> list[Voice]:
    """Every usable voice of the requested engines (default: all installed; espeak-ng is required)."""
    wanted = list(engines) if engines else [e for e in ENGINES if e == "espeak" or _installed(e)]
    unknown = set(wanted) - set(ENGINES)
    if unknown:
        raise ConfigError(f"unknown synthesiser {sorted(unknown)}: known {list(ENGINES)}")
    voices: list[Voice] = []
    for engine in wanted:
        if not _installed(engine):
            raise ConfigError(f"synthesiser {engine} is not installed (Debian: apt-get install {PACKAGES[engine]})")
        if engine == "espeak":
            voices += [Voice("espeak", f"{a}+{v}") for a in ESPEAK_ACCENTS for v in espeak_variants()]
        elif engine == "flite":
            listed = _run(["flite", "-lv"]).stdout.decode(errors="replace").split()
            voices += [Voice("flite", v) for v in FLITE_VOICES if v in listed]
        else:
            voices += [Voice("festival", d.name) for root in FESTIVAL_VOICE_DIRS if root.is_dir()
                       for d in sorted(root.iterdir()) if d.is_dir()]
    return voices


def _installed(engine: str) -> bool:
    return shutil.which({"espeak": "espeak-ng", "flite": "flite", "festival": "text2wave"}[engine]) is not None


# -- synthesis ----------------------------------------------------------------------------------------------
def synthesize(voice: Voice, text: str, rng: np.random.Generator,
               formant: float = 1.0) -> tuple[np.ndarray, int, dict[str, float]]:
    """(float32 mono samples, sample rate, the prosody drawn) for `text` as said by `voice`. `formant` (flite
    only) pre-compensates a later reading at `formant` times the rate: pitch / formant, duration x formant."""
    with tempfile.TemporaryDirectory(prefix="synth-") as tmp:
        wav = Path(tmp) / "out.wav"
        if voice.engine == "espeak":
            params = {"rate": int(rng.integers(120, 211)), "pitch": int(rng.integers(20, 81)),
                      "amplitude": int(rng.integers(60, 151))}
            cmd = ["espeak-ng", "-v", voice.name, "-s", str(params["rate"]), "-p", str(params["pitch"]),
                   "-a", str(params["amplitude"]), "-w", str(wav)]
            proc = _run(cmd, stdin=text)
        elif voice.engine == "flite":
            params = {"duration_stretch": round(float(rng.uniform(0.8, 1.3)), 3),
                      "f0_scale": round(float(rng.uniform(0.85, 1.2)), 3)}
            f0 = 105.0 if voice.name in ("kal", "kal16", "awb", "rms") else 175.0
            text_file = Path(tmp) / "in.txt"
            text_file.write_text(text, encoding="utf-8")
            proc = _run(["flite", "-voice", voice.name,
                         "--setf", f"duration_stretch={params['duration_stretch'] * formant:.4f}",
                         "--setf", f"int_f0_target_mean={f0 * params['f0_scale'] / formant:.1f}", "-f", str(text_file),
                         "-o", str(wav)])
        elif voice.engine == "festival":
            params = {"duration_stretch": round(float(rng.uniform(0.8, 1.3)), 3)}
            text_file = Path(tmp) / "in.txt"
            text_file.write_text(text, encoding="utf-8")
            proc = _run(["text2wave", "-eval", f"(voice_{voice.name})", "-eval",
                         f"(Parameter.set 'Duration_Stretch {params['duration_stretch']})", "-o", str(wav),
                         str(text_file)])
        else:
            raise ConfigError(f"unknown synthesiser {voice.engine}")
        if proc.returncode != 0 or not wav.exists():
            raise MediaError(f"{voice.id} failed on {text!r}: {proc.stderr.decode(errors='replace')[-500:]}")
        data, rate = soundfile.read(io.BytesIO(wav.read_bytes()), dtype="float32", always_2d=True)
    return data.mean(axis=1), int(rate), params


def resample(x: np.ndarray, rate_in: int, rate_out: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited resampling with libswresample (PyAV), so no aliasing is baked into the training audio."""
    import av

    if rate_in == rate_out or len(x) == 0:
        return x.astype(np.float32)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x, dtype=np.float32).reshape(1, -1), format="flt",
                                       layout="mono")
    frame.sample_rate = rate_in
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate_out)
    pieces = [f.to_ndarray().reshape(-1) for f in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def _trim(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Cut the synthesiser's own leading/trailing silence to a random 50-300 ms margin on each side."""
    peak = float(np.abs(x).max()) if len(x) else 0.0
    if peak == 0.0:
        return x
    active = np.flatnonzero(np.abs(x) > 0.02 * peak)
    margin = (rng.uniform(0.05, 0.3, size=2) * SAMPLE_RATE).astype(int)
    start, end = max(0, active[0] - margin[0]), min(len(x), active[-1] + 1 + margin[1])
    return np.concatenate([x[start:end], np.zeros(max(0, margin[1] - (len(x) - active[-1] - 1)), np.float32)])


def _fft_convolve(x: np.ndarray, h: np.ndarray) -> np.ndarray:
    n = 1 << int(np.ceil(np.log2(len(x) + len(h) - 1)))
    return np.fft.irfft(np.fft.rfft(x, n) * np.fft.rfft(h, n), n)[: len(x)].astype(np.float32)


def reverb(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, float]]:
    """A simple room: the dry path plus a late tail of exponentially decaying noise (RT60 0.15-0.7 s, 2-15 ms
    pre-delay) at a random wet level; crude next to a measured room response, but it smears phones in time the
    way rooms do, which is what the model must learn to ignore."""
    rt60, wet, predelay = float(rng.uniform(0.15, 0.7)), float(rng.uniform(0.1, 0.6)), float(rng.uniform(0.002, 0.015))
    n = int(rt60 * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    tail = rng.standard_normal(n) * np.exp(-6.908 * t / rt60)  # -60 dB at rt60
    tail[: int(predelay * SAMPLE_RATE)] = 0.0
    tail *= wet / max(1e-9, float(np.sqrt(np.sum(tail**2))))
    return x + _fft_convolve(x, tail.astype(np.float32)), {"rt60": round(rt60, 3), "wet": round(wet, 3)}


def noise(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
    """White, pink or brown noise (1/f^0, 1/f, 1/f^2 power) at 10-40 dB SNR against the speech's active level."""
    color = ("white", "pink", "brown")[int(rng.integers(3))]
    snr = float(rng.uniform(10, 40))
    spectrum = np.fft.rfft(rng.standard_normal(len(x)))
    f = np.maximum(np.fft.rfftfreq(len(x), 1 / SAMPLE_RATE), 20.0)
    spectrum /= f ** ({"white": 0.0, "pink": 0.5, "brown": 1.0}[color])  # amplitude ~ f^-(alpha/2)
    n = np.fft.irfft(spectrum, len(x))
    peak = float(np.abs(x).max())
    active = x[np.abs(x) > 0.05 * peak] if peak > 0 else x
    speech_rms = float(np.sqrt(np.mean(active**2))) if len(active) else 0.0
    n *= speech_rms / max(1e-9, float(np.sqrt(np.mean(n**2)))) / 10 ** (snr / 20)
    return (x + n).astype(np.float32), {"noise": color, "snr_db": round(snr, 1)}


def render(voice: Voice, text: str, rng: np.random.Generator,
           formant_shift: float = 0.0) -> tuple[np.ndarray, dict[str, Any]]:
    """The finished clip: synthesis, speed perturbation to 16 kHz, trimming, padding to 1 s, reverb, noise,
    level. `formant_shift` F > 0 moves a flite clip's formants by a factor drawn log-uniformly in
    [1/(1+F), 1+F], pitch and tempo kept (the module docstring says why); 0 draws nothing, so datasets made
    without it are unchanged."""
    formant = 1.0
    if formant_shift > 0 and voice.engine == "flite":
        formant = float(np.exp(rng.uniform(-np.log1p(formant_shift), np.log1p(formant_shift))))
    raw, rate, params = synthesize(voice, expand(text), rng, formant)
    speed = float(rng.uniform(0.9, 1.1))
    # read at rate*speed*formant: faster and higher when > 1 (the formant part was pre-compensated)
    x = _trim(resample(raw, round(rate * speed * formant)), rng)
    if float(np.abs(x).max() if len(x) else 0.0) < 1e-4:
        raise MediaError(f"{voice.id} produced silence for {text!r}")
    short = int(MIN_SECONDS * SAMPLE_RATE) - len(x)
    if short > 0:
        lead = int(rng.integers(short + 1))
        x = np.concatenate([np.zeros(lead, np.float32), x, np.zeros(short - lead, np.float32)])
    info: dict[str, Any] = {**params, "speed": round(speed, 3)}
    if formant != 1.0:
        info["formant"] = round(formant, 3)
    if rng.random() < 0.5:
        x, room = reverb(x, rng)
        info.update(room)
    if rng.random() < 0.8:
        x, noisy = noise(x, rng)
        info.update(noisy)
    level = float(rng.uniform(0.1, 0.9))
    x = x * (level / max(1e-9, float(np.abs(x).max())))
    info["peak"] = round(level, 3)
    return np.clip(x, -1.0, 1.0).astype(np.float32), info
