"""The offline reference of causal streaming Whisper: what `CausalWhisperStream` must show, computed without its
caches. One `forward_full` per segment (and one per preview, over the audio up to it), `RecomputeDecoder` (no
caches, per-position cross-attention masks), the same emission rule, block steps and resets.

Besides the transcript it records what a viewer sees after each event, in the order the stream makes them: each
block's step (the item's text so far), each reset (the new item, empty) and, with `asr.preview_ms`, each preview
(what the open block would add if it ended there), each with the sample count after which the stream can make
it. The stream makes, per call, every block its audio completes and then the latest preview only, so what it
shows after any call must be the last event available by then, whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from runtime.models.asr.causal_whisper.decoder import RecomputeDecoder
from runtime.models.asr.causal_whisper.emission import ItemDecoder, Token
from runtime.models.asr.causal_whisper.encoder import FRAME_SAMPLES, block_end, emission_sample

if TYPE_CHECKING:
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
    from runtime.models.asr.causal_whisper.carry import Carry


class Shown(NamedTuple):
    """One event: after `sample` samples the stream can show `text` as its open item's text."""

    sample: int
    text: str
    kind: str  # block | reset | preview


@dataclass
class OfflineRun:
    """What the reference computes for one clip: the stream's transcript and what it shows, event by event."""

    text: str  # the completed items' transcripts, joined
    shown: list[Shown] = field(default_factory=list)


@torch.inference_mode()
def offline_run(asr: CausalWhisperASR, audio: np.ndarray, previous: str = "", vocabulary: str = "") -> OfflineRun:
    """Transcript and shown text of `audio` by the reference computation (see the module docstring), as a stream
    given `set_context(previous, vocabulary)` shows them."""
    run = OfflineRun("")
    texts: list[str] = []
    history: list[Token] = []
    context = asr.context(previous, vocabulary)
    carry: Carry | None = asr.first_carry(context)
    item_from = 0  # absolute sample where the open item starts
    while True:
        start = carry.restart_frame * FRAME_SAMPLES if carry else 0
        seg = audio[start : start + emission_sample(asr.reset_frame)]
        frames = asr.encoder.encode_audio(seg)
        item = asr.item(RecomputeDecoder(asr.model), carry)
        done, end = 0, block_end(0, asr.block_frames)
        reset = False
        while emission_sample(end) <= len(seg):
            _previews(asr, run, item, seg, start, done, end)
            item.step(frames[done:end])
            _show(run, start + emission_sample(end), asr.text([t.id for t in item.tokens]), "block")
            done, end = end, end + asr.block_frames
            if asr.reset_due(item, done):
                reset = True
                break
        if not reset:
            _previews(asr, run, item, seg, start, done, end)
            if len(frames):
                item.step(frames[done:], final=True)
            texts.append(asr.text(asr.final_ids(item, audio[item_from:])))
            run.text = "".join(texts)
            return run
        texts.append(asr.text([t.id for t in item.tokens[: item.stable]]))
        item_from = (item.frame0 + done) * FRAME_SAMPLES
        carry = asr.carry(history, item, done, context)
        _show(run, 0, "", "reset")  # the new item starts with nothing shown


def offline_transcript(asr: CausalWhisperASR, audio: np.ndarray, previous: str = "", vocabulary: str = "") -> str:
    """The transcript the stream of `asr` (given that previous text) must complete for `audio`."""
    return offline_run(asr, audio, previous, vocabulary).text


def _show(run: OfflineRun, sample: int, text: str, kind: str) -> None:
    """Record an event; the stream never makes one before the last (re-fed audio is all there at a reset)."""
    run.shown.append(Shown(max(sample, run.shown[-1].sample if run.shown else 0), text, kind))


def _previews(
    asr: CausalWhisperASR, run: OfflineRun, item: ItemDecoder, seg: np.ndarray, start: int, done: int, end: int
) -> None:
    """The previews of the open block (frames done..end of the segment that starts at sample `start`) whose
    audio is in `seg`: each encodes the segment up to its point and decodes on, then is taken back."""
    step = asr.preview_frames
    for p in range(done + step, end, step) if step else ():
        if emission_sample(p) <= len(seg):
            partial = asr.encoder.encode_audio(seg[: emission_sample(p)], frames=p)[done:]
            _show(run, start + emission_sample(p), asr.text(item.preview(partial)), "preview")
