"""Word latency of a streaming ASR, as `runtime bench asr-quality` reports it: from a word's end in the audio
to the event that shows it, and to the event that makes it final.

Events are timed on a real-time clock (`timed_stream`): the audio is fed in 100 ms pieces as it would arrive,
each call starts once both its audio has arrived and the previous call is done, and its updates appear when it
returns, so latency includes this machine's compute; `media` keeps the same events without compute (the audio
heard when the event was emitted: the algorithmic part).

`word_times` reads a stream's updates: a word of the final transcript is *shown* at the first event that
displays it with its final text (stable or unstable tail, same position in its item) and *final* at the event
after which it can no longer change (a later word is stable, or the item is complete; with `whole_words`, the
CTC beam's stable text of whole words, the event that makes it stable).

Word ends (`Aligner`): the offline full-context Whisper transcript of the clip, aligned to the audio by the
checkpoint's cross-attention alignment heads as openai-whisper's word timestamps do
(`models/asr/whisper_alignment.py`); a word ends where the next token starts. DTW puts that boundary anywhere in
a following pause, so each end is then pulled back to the word's last 20 ms frame louder than 1/20 of the clip's
loudest. Streamed words are matched to these timed words by a minimum edit-distance alignment (`matched`); only
words equal to their match are timed. The ends are approximate (tens of ms where words abut, more in noise):
read the figures as +/- 0.1 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.models.asr.whisper_alignment import TokenAligner
from runtime.train.text_norm import normalize

if TYPE_CHECKING:
    from runtime.models.asr.base import StreamingASR
    from runtime.models.asr.whisper_buffered import WhisperBuffered

FEED_MS = 100  # the pipeline's audio chunk
FRAME_S = 0.02  # Whisper encoder frame


@dataclass
class Timed:
    media: float  # audio heard when the update was emitted
    wall: float  # when it appeared on the real-time clock
    update: Any


def timed_stream(asr: StreamingASR, audio: np.ndarray) -> tuple[list[Timed], float]:
    """Feed `audio` in FEED_MS pieces as it would arrive in real time: (timed updates, compute seconds)."""
    stream = asr.open_stream()
    step, n = SAMPLE_RATE * FEED_MS // 1000, len(audio)
    timed: list[Timed] = []
    clock = compute = 0.0
    for start in [*range(0, n, step), None]:
        heard = n / SAMPLE_RATE if start is None else min(start + step, n) / SAMPLE_RATE
        began = perf_counter()
        updates = stream.finish() if start is None else stream.accept(AudioChunk(audio[start : start + step], start))
        spent = perf_counter() - began
        compute += spent
        clock = max(clock, heard) + spent  # starts once its audio has arrived and the previous call is done
        timed += [Timed(heard, clock, u) for u in updates]
    stream.close()
    return timed, compute


def transcript(timed: list[Timed]) -> str:
    return " ".join(t.update.transcript.strip() for t in timed if t.update.completed and t.update.transcript.strip())


def word_times(timed: list[Timed], *, whole_words: bool = False) -> list[tuple[str, Timed, Timed]]:
    """(word, shown, final) for each normalised word of the final transcript, in order (see the module doc).
    `whole_words`: stable and unstable text are whole words joined by a space (the CTC beam)."""
    stable: dict[str, str] = {}
    events: dict[str, list[tuple[Timed, list[str], list[str], bool]]] = {}
    for t in timed:
        u = t.update
        text = u.transcript if u.completed else stable.get(u.item_id, "") + u.delta
        stable[u.item_id] = text
        tail = (" " if whole_words else "") + u.unstable if u.unstable and not u.completed else ""
        events.setdefault(u.item_id, []).append((t, normalize(text).split(), normalize(text + tail).split(),
                                                 u.completed))
    out = []
    for evs in events.values():
        if not evs[-1][3]:
            continue
        for i, word in enumerate(evs[-1][1]):
            done = next(t for t, st, _, completed in evs
                        if completed or (len(st) > i + (0 if whole_words else 1) and st[i] == word))
            shown = next(t for t, _, sh, _ in evs if len(sh) > i and sh[i] == word)
            out.append((word, shown if shown.wall <= done.wall else done, done))
    return out


def matched(ref: list[str], hyp: list[str]) -> list[tuple[int, int]]:
    """(i, j) with ref[i] == hyp[j] on a minimum edit-distance alignment."""
    n, m = len(ref), len(hyp)
    d = np.zeros((n + 1, m + 1), np.int32)
    d[:, 0], d[0, :] = np.arange(n + 1), np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]))
    pairs, i, j = [], n, m
    while i and j:
        if d[i, j] == d[i - 1, j - 1] + (ref[i - 1] != hyp[j - 1]):
            if ref[i - 1] == hyp[j - 1]:
                pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif d[i, j] == d[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def latencies(ends: list[tuple[str, float]], words: list[tuple[str, Timed, Timed]]) -> dict[str, list[float]]:
    """Seconds from each matched word's end to its shown/final events, on both clocks."""
    out: dict[str, list[float]] = {"shown": [], "final": [], "shown_media": [], "final_media": []}
    for i, j in matched([w for w, _ in ends], [w for w, _, _ in words]):
        end, (_, shown, final) = ends[i][1], words[j]
        out["shown"].append(shown.wall - end)
        out["final"].append(final.wall - end)
        out["shown_media"].append(shown.media - end)
        out["final_media"].append(final.media - end)
    return out


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None}
    return {"median": round(float(np.median(values)), 3), "p90": round(float(np.percentile(values, 90)), 3)}


class Aligner:
    """Word end times of Whisper's own transcript of a clip, from its cross-attention alignment heads."""

    def __init__(self, offline: WhisperBuffered, path: Path) -> None:
        self.offline = offline  # the WhisperBuffered whose encoder states and transcripts are aligned
        self.tokens = TokenAligner.load(path, offline.prompt_ids, offline.eos_id)

    def word_ends(self, audio: np.ndarray, ids: list[int]) -> list[tuple[str, float]]:
        """(normalised word, end seconds) of transcript `ids` (no prompt, no eos) of `audio`."""
        states = self.offline.encode(audio).states.to("cpu", torch.float32)  # the aligner runs on the cpu
        starts = np.array(self.tokens.starts(audio, ids, states)) * FRAME_S  # each token's, then eos's
        loud = _loud_frames(audio)
        words: list[list[Any]] = []  # [raw text, start, end]
        for k, tok in enumerate(ids):
            piece = self.offline.text([tok])
            if piece.startswith(" ") or not words:
                words.append([piece, float(starts[k]), None])
            else:
                words[-1][0] += piece
            if normalize(piece):  # punctuation does not move a word's end
                words[-1][2] = float(starts[k + 1])
        out_words = []
        for raw, start, end in words:
            end = min(end if end is not None else start, len(audio) / SAMPLE_RATE)
            span = loud[int(start / FRAME_S) : int(np.ceil(end / FRAME_S))]
            if span.any():
                end = (int(start / FRAME_S) + int(np.flatnonzero(span)[-1]) + 1) * FRAME_S
            out_words += [(word, end) for word in normalize(raw).split()]
        return out_words


def _loud_frames(audio: np.ndarray) -> np.ndarray:
    hop = round(FRAME_S * SAMPLE_RATE)
    n = max(1, len(audio) // hop)
    rms = np.sqrt(np.mean(np.square(audio[: n * hop].reshape(n, hop) if len(audio) >= hop else audio[None]), -1))
    return rms >= rms.max() / 20 if rms.max() > 0 else np.zeros(n, bool)


def summary(lat: dict[str, list[float]]) -> dict[str, Any]:
    """{shown, final: {median, p90}, media_only: {...}, words_timed} of `latencies` pooled over clips."""
    return {"shown": _spread(lat["shown"]), "final": _spread(lat["final"]),
            "media_only": {"shown": _spread(lat["shown_media"]), "final": _spread(lat["final_media"])},
            "words_timed": len(lat["shown"])}
