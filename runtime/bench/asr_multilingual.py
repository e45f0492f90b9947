"""The `multilingual` rows of `runtime bench asr-quality` (issue 53): Whisper base on German, Spanish and French
speech, the language identified and the words, beside its peers on the same clips in the same run.

The speech is espeak-ng's (installed with the project's synthetic-speech tools, docs/synthetic_speech.md): the
sentences below, written for this bench and never tuned to what the models make of them, each said by one of
espeak-ng's voice variants of its language at 140 words a minute (`VARIANTS`, in turn). espeak-ng is formant
synthesis: robotic, far from human speech, so the absolute error rates say little of a person speaking; the
rows compare systems on the same audio. The full run says the first `FULL_SENTENCES` of each language (within
its 20 minutes), `--quick` the first `QUICK_SENTENCES`, and quick leaves the `QUICK_SKIP` systems to the full run (a
row with the reason).

Systems (Whisper base, `builtin:whisper-base`, for every one):
- `whisper-base-profile`: the `whisper-base` profile's stream as a session runs it per turn (block-causal at 300 ms
  with the profile's adapter, previews every 100 ms, the offline final pass), the language detected (`lid`: the
  completed transcript's language; `lid_stream`: the language the stream's first words were shown in, detected over
  its first 2 s or more until Whisper is sure of it: causal_whisper/stream.py) and, as `...-given`, the language given.
- `whisper-base-offline`: one greedy full-context pass over the clip (padded to 30 s), the language detected over it
  (Whisper's own language identification, as openai-whisper does it), at most `TOKENS_PER_S` tokens an audio second
  (a greedy decode in the wrong language loops): the ceiling of the same model.
- `whisper-base-buffered`: the buffered LocalAgreement-2 peer, re-decoding every 1 s, the language detected on
  every decode.
- `faster-whisper-base`: CTranslate2 int8 on the same folder, greedy, its own language detection (`info.language`).

Each row: `lid` (fraction of clips whose language was identified right, where the system detects), `wer`/`cer`
(percent, pooled, after `text_norm.normalize`, which folds accents: "Küche" and "Kuche" count the same),
`compute_s_per_audio_s` (wall seconds inside the system's calls over audio seconds).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.train.text_norm import cer, wer

if TYPE_CHECKING:
    from runtime.models.asr.base import Speech, StreamingASR

WHISPER_BASE = "builtin:whisper-base"
QUICK_SENTENCES = 1
FULL_SENTENCES = 3  # the full run: the first 3 of each language (the buffered peer alone took 5-8 s an audio second)
# left out of --quick, which must stay within 3 minutes on 2 cores: measured on a loaded 2-core machine, the buffered
# peer cost 5-8 s of compute per audio second on this speech, offline base in float32 torch 2.5, the given-language row
# as much as the profile's; the quick rows (the profile, faster-whisper) took 66 s with offline base, about 30 s
# without. The full run has them all.
QUICK_SKIP = ("whisper-base-profile-given", "whisper-base-offline", "whisper-base-buffered")
WPM = 140
TOKENS_PER_S = 10  # the offline row's token budget: 10 an audio second (+ 10), twice a fast speaker's
VARIANTS = ("", "+m3", "+f2", "+m1", "+f4")  # espeak-ng voice variants, one per sentence in turn
SENTENCES = {
    "de": [
        "Heute Morgen habe ich mit meiner Schwester in der Küche gefrühstückt.",
        "Der Zug nach Hamburg fährt jeden Tag um halb neun vom Hauptbahnhof ab.",
        "Wir müssen die Fenster schließen, bevor das Gewitter beginnt.",
        "Im Sommer gehen viele Familien am Wochenende an den See zum Schwimmen.",
        "Kannst du mir bitte sagen, wo ich hier die nächste Apotheke finde?",
    ],
    "es": [
        "Esta mañana he desayunado con mi hermana en la cocina.",
        "El tren hacia Sevilla sale todos los días a las nueve de la mañana.",
        "Tenemos que cerrar las ventanas antes de que empiece la tormenta.",
        "En verano muchas familias van a la playa los fines de semana.",
        "¿Puedes decirme dónde está la farmacia más cercana, por favor?",
    ],
    "fr": [
        "Ce matin, j'ai pris le petit déjeuner avec ma sœur dans la cuisine.",
        "Le train pour Marseille part tous les jours à neuf heures du matin.",
        "Nous devons fermer les fenêtres avant que l'orage commence.",
        "En été, beaucoup de familles vont à la plage le week-end.",
        "Pouvez-vous me dire où se trouve la pharmacie la plus proche, s'il vous plaît?",
    ],
}


def speak(text: str, voice: str) -> np.ndarray:
    """`text` said by espeak-ng's `voice` at `WPM`, as 16 kHz float32."""
    import soundfile

    from runtime.train.synthesizers import resample

    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", str(WPM), "--stdout", text], capture_output=True,
                         check=True, timeout=60).stdout
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    return resample(audio, rate, SAMPLE_RATE)


def clips(quick: bool) -> dict[str, list[tuple[np.ndarray, str]]]:
    """Language -> [(audio, text)] of its first `FULL_SENTENCES` sentences (`QUICK_SENTENCES` with `quick`)."""
    return {lang: [(speak(text, lang + VARIANTS[i % len(VARIANTS)]), text)
                   for i, text in enumerate(texts[:QUICK_SENTENCES if quick else FULL_SENTENCES])]
            for lang, texts in SENTENCES.items()}


def streamed(asr: StreamingASR, audio: np.ndarray, speech: Speech | None) -> tuple[str, str, str]:
    """(completed text, language of the completed transcript, language of the first words shown: "" when none were)
    of `audio` through one stream in 100 ms chunks (one turn)."""
    stream = asr.open_stream()
    if speech is not None:
        stream.set_speech(speech)
    step = SAMPLE_RATE // 10
    updates = [u for i in range(0, len(audio), step) for u in stream.accept(AudioChunk(audio[i : i + step], i))]
    updates += stream.finish()
    stream.close()
    shown = next((u.language for u in updates if u.delta.strip() or u.unstable.strip()), "")
    done = [u for u in updates if u.completed]
    final = done[-1].language if done else ""
    return " ".join(u.transcript.strip() for u in done if u.transcript.strip()), final, shown


def _row(refs: list[str], hyps: list[str], langs: list[str] | None, lang: str, seconds: float,
         audio_s: float, stream_langs: list[str] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"utterances": len(refs), "wer": round(100 * wer(refs, hyps), 2),
                           "cer": round(100 * cer(refs, hyps), 2),
                           "compute_s_per_audio_s": round(seconds / audio_s, 3)}
    if langs is not None:
        row["lid"] = round(sum(x == lang for x in langs) / len(langs), 3)
        row["languages"] = langs
    if stream_langs is not None:
        row["lid_stream"] = round(sum(x == lang for x in stream_langs) / len(stream_langs), 3)
    return row


def multilingual_part(args: Any, device: str, dtype: str, status: Callable[[str], None],  # noqa: ANN401 - argparse's
                      skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """{"systems": {system: {language: row}}, "settings", "sentences"}; rows with a `reason` where espeak-ng, the
    weights or faster-whisper are missing. `skip`: systems left out (a row saying so)."""
    if shutil.which("espeak-ng") is None:
        return {"reason": "espeak-ng is not installed (apt-get install espeak-ng)"}
    from runtime.bench.asr_systems import faster_whisper
    from runtime.config import ASRConfig
    from runtime.errors import CheckpointNotFound
    from runtime.models.asr.base import Speech
    from runtime.models.asr.registry import load_asr
    from runtime.models.asr.whisper_buffered import WhisperBuffered
    from runtime.models.loading import resolve_checkpoint
    from runtime.profile_files import load_profile

    try:
        folder = resolve_checkpoint(WHISPER_BASE, role="asr")
    except CheckpointNotFound as err:
        return {"reason": str(err)}
    status("multilingual: espeak-ng German, Spanish and French ...")
    sets = clips(bool(args.quick))
    table: dict[str, dict[str, Any]] = {}
    settings: dict[str, str] = {}

    def each(system: str, run: Callable[[np.ndarray, str], tuple[str, str | None, str | None]]) -> None:
        """`run(audio, language) -> (text, detected language or None, stream's language or None)`, timed."""
        table[system] = {}
        if system in skip or (args.quick and system in QUICK_SKIP):
            why = "left out of this run" if system in skip else "the full run only (too slow for --quick)"
            table[system] = {lang: {"utterances": 0, "reason": why} for lang in sets}
            return
        for lang, pairs in sets.items():
            status(f"multilingual: {system} on {lang} ({len(pairs)} clips) ...")
            hyps, langs, shown, seconds = [], [], [], 0.0
            for audio, _ in pairs:
                started = time.perf_counter()
                text, detected, first = run(audio, lang)
                seconds += time.perf_counter() - started
                hyps.append(text)
                langs.append(detected or "")
                shown.append(first or "")
            table[system][lang] = _row([t for _, t in pairs], hyps, langs if any(langs) else None, lang, seconds,
                                       sum(len(a) for a, _ in pairs) / SAMPLE_RATE,
                                       shown if any(shown) else None)

    profile = load_profile("whisper-base").asr
    asr = load_asr(replace(profile, graph_runtime=getattr(args, "graph_runtime", None) or profile.graph_runtime),
                   device=device, dtype=dtype, progress=status)
    warm = next(iter(sets.values()))[0][0][:SAMPLE_RATE]
    streamed(asr, warm, Speech("de"))
    settings["whisper-base-profile"] = (f"the whisper-base profile's ASR: block-causal at 300 ms with the adapter "
                                        f"{profile.adapter or '(none)'}, previews every 100 ms, offline final pass; "
                                        "the language detected")
    each("whisper-base-profile", lambda audio, lang: streamed(asr, audio, None))
    settings["whisper-base-profile-given"] = "the same, the language given (audio.input.transcription.language)"
    each("whisper-base-profile-given", lambda audio, lang: (streamed(asr, audio, Speech(lang))[0], None, None))

    settings["whisper-base-offline"] = ("Whisper base, greedy over the whole clip padded to 30 s, the language "
                                        "detected over it (float32, torch)")
    settings["whisper-base-buffered"] = "LocalAgreement-2 re-decoding every 1 s, the language detected on each decode"
    if args.quick:
        for system in ("whisper-base-offline", "whisper-base-buffered"):  # QUICK_SKIP: each() writes the reason
            each(system, lambda audio, lang: ("", None, None))
    else:
        buffered = load_asr(ASRConfig(backend="whisper-buffered", model=WHISPER_BASE, language="", step_s=1.0,
                                      segment_s=10.0, max_new_tokens=96), device=device, dtype=dtype,
                            progress=status)
        assert isinstance(buffered, WhisperBuffered)

        def offline(audio: np.ndarray, lang: str) -> tuple[str, str, None]:
            encoded = buffered.encode(audio)
            sot, detected = buffered.sot_for(encoded)
            # a greedy decode of robotic speech in the wrong language may loop: at most TOKENS_PER_S an audio second
            budget = replace(buffered.cfg, max_new_tokens=round(TOKENS_PER_S * len(audio) / SAMPLE_RATE) + 10)
            capped = WhisperBuffered(buffered.model, buffered.tokenizer, buffered.feature_extractor, budget,
                                     name=WHISPER_BASE)
            return capped.text(capped.decode(encoded, sot=sot)), detected, None

        offline(warm, "de")
        each("whisper-base-offline", offline)
        each("whisper-base-buffered", lambda audio, lang: (streamed(buffered, audio, None)[0], None, None))

    fw, why = faster_whisper(folder, "")
    if fw is None:
        table["faster-whisper-base"] = {lang: {"utterances": 0, "reason": why} for lang in sets}
    else:
        from faster_whisper import WhisperModel

        from runtime.bench.asr_systems import FW_THREADS

        model = WhisperModel(str(folder), device="cpu", compute_type="int8", cpu_threads=FW_THREADS)

        def faster(audio: np.ndarray, lang: str) -> tuple[str, str, None]:
            segments, info = model.transcribe(audio, beam_size=1, temperature=0.0, without_timestamps=True,
                                              condition_on_previous_text=False)
            return "".join(s.text for s in segments), info.language, None

        faster(warm, "de")
        settings["faster-whisper-base"] = (f"faster-whisper on {folder}: int8, cpu_threads={FW_THREADS}, beam 1, "
                                           "its own language detection")
        each("faster-whisper-base", faster)
    return {"systems": table, "settings": settings,
            "sentences": {lang: len(pairs) for lang, pairs in sets.items()},
            "voices": f"espeak-ng <language>{'|'.join(VARIANTS)} in turn, {WPM} words a minute"}
