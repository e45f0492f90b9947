"""One session's causal Whisper stream: audio in, transcript updates out, item by item (the model and its
emission rule: `asr.py`).

Decode points are block ends, and the stream feeds its encoder exactly up to each block's emission sample,
so the encoder and decoder see the same calls whatever the chunking: output is identical for any chunking.

Reset (the encoder holds at most 30 s): at the block end nearest below `reset_s` (or when the item's token
budget is spent) the item is completed with its stable text; its unstable tail is dropped. Without word
timestamps the text/audio alignment is approximated by emission times: a token emitted with F frames heard
describes audio before F. A fresh encoder restarts at `restart = last stable token's emission - 0.5 s`,
clamped to at most 5 s (and half the segment) before the reset point, and the buffered audio from there is
re-fed, so the dropped tail and anything not yet transcribed is heard again. The last stable tokens are
carried: those emitted after `restart` may describe re-fed audio, so they become a forced transcript prefix
(the model continues after them instead of repeating them); older ones go into the `<|startofprev|>`
prompt (see `decoder.context_ids`), after the stream's own previous text. Carried tokens are context only, never
emitted again. The new item's `start` is the previous item's end (items tile the timeline), and `end` never goes
back over re-fed audio.

At a commit (`finish`) the item can be decoded once more with all it heard (`asr.final_pass`, `final_pass.py`):
the completed event then carries that second pass, which may revise the streamed deltas.

Previews (`asr.preview_ms`): long blocks carry words that short ones lose (Whisper under 100 ms blocks stops
early, model card), but a 300 ms block shows them up to 300 ms late. At the latest `preview_ms` point a call's
audio reaches inside a block, the stream encodes the partial block as if it ended there (the front end on the
carried state, the layers on the caches) and decodes on, shows the result as the unstable tail, and takes it all
back (both caches truncated; nothing else is touched): the encoder is still fed at block ends only and the block
completes as if never previewed, so the stable text and transcripts are those of the same stream without
previews, bit for bit.

Context across turns (`set_context`, before the first chunk): a stream is one turn, and the pipeline opens it with
the text of the turns before and the user's vocabulary (`audio.input.transcription.prompt`) as Whisper's previous
text (`<|startofprev|>`, at most `prompt_tokens` = 223 tokens: the vocabulary first, then the most recent words).
Every item of the stream starts from it (after a reset, followed by the carried stable text, the most recent kept),
its previews decode on from it, and the final pass decodes with it too: the causal stream, its previews and the
final pass all read the same words before the turn.

The turn before, read on (`read_on`, before the first chunk; a captions session's, pipeline/turns_before.py): the
offline pass of the stream's first item also decodes that turn's audio and ids with its own (final_pass.py,
`TurnBefore`); `turn_before` gives the finished stream's last item for the next stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.errors import ConfigError
from runtime.events import new_id
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.asr.causal_whisper.carry import Carry, Context
from runtime.models.asr.causal_whisper.decoder import Scorer
from runtime.models.asr.causal_whisper.emission import ItemDecoder, Token
from runtime.models.asr.causal_whisper.encoder import FRAME_SAMPLES, CausalWhisperEncoder, block_end, emission_sample
from runtime.models.asr.causal_whisper.final_pass import FinalPass, OfflinePass, TurnBefore
from runtime.models.asr.whisper_language import DETECT, Speech

# A stream whose language is to detect holds its words until it has heard DETECT_S and Whisper names a language with
# at least DETECT_SURE of the language tokens' probability (faster-whisper's `language_detection_threshold`, 0.5),
# asking again once the audio heard has grown by DETECT_GROWTH (each ask encodes all of it: asks at 2.1, 2.4, 2.8, 3.3,
# 3.9 s..., about 20 up to 30 s, some eight times the audio's length encoded in all, where asking at every 300 ms
# block would encode fifty times it; the first words of the bench's espeak sentences showed at 3.3 s, median,
# against 3.0-3.15 s asking at every block); at the segment's reset point
# (`asr.reset_s`, at most Whisper's 30 s window: the held blocks must be decoded before it) or at the stream's end it
# takes the likeliest. Over 2 s of espeak-ng French or German Whisper base is often unsure (0.2-0.3) and wrong ("en",
# "ja"); by 4-5 s it is sure and right; over silence it stays at 0.35-0.4 (docs/model_card_whisper_base.md).
DETECT_S = 2.0
DETECT_SURE = 0.5
DETECT_GROWTH = 1.15


class StreamModel(Protocol):
    """What a stream reads of its model (`asr.CausalWhisperASR`, shared by every stream of it): the settings checked
    once at load, and the items' decoders and resets' carries built from them."""

    name: str
    speech: Speech  # the configured language ("" to detect) and task
    languages: dict[str, int]  # a multilingual model's language tokens (empty: English only)
    sot: list[int]  # the start-of-transcript sequence of the configured speech
    detector: object | None  # what detects the language (None: the model cannot)
    encoder: CausalWhisperEncoder
    block_frames: int
    preview_frames: int
    final_pass: FinalPass | None

    def scorer(self) -> Scorer: ...
    def item(self, scorer: Scorer, carry: Carry | None, sot: Sequence[int] | None = None) -> ItemDecoder: ...
    def reset_due(self, item: ItemDecoder, frames: int) -> bool: ...
    def carry(self, history: list[Token], item: ItemDecoder, frames: int, context: Context | None = None) -> Carry: ...
    def context(self, previous: str, vocabulary: str = "") -> Context: ...
    def first_carry(self, context: Context) -> Carry | None: ...
    def prompt_for(self, speech: Speech) -> list[int]: ...
    def detect(self, audio: np.ndarray) -> tuple[str, float]: ...
    def text(self, ids: Sequence[int]) -> str: ...
    def final_ids(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None = None,
                  before: TurnBefore | None = None) -> list[int]: ...


def settled(text: str) -> str:
    """Hold back a trailing U+FFFD: an incomplete UTF-8 character that the next token may complete."""
    return text.rstrip("\ufffd")


class _Samples:
    """The current segment's audio, grown with amortised doubling (1-sample chunks stay linear)."""

    def __init__(self, samples: np.ndarray | None = None) -> None:
        self.data = np.zeros(0 if samples is None else len(samples), np.float32)
        self.size = 0
        if samples is not None:
            self.append(samples)

    def append(self, x: np.ndarray) -> None:
        if self.size + len(x) > len(self.data):
            grown = np.zeros(max(2 * (self.size + len(x)), 4096), np.float32)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size : self.size + len(x)] = x
        self.size += len(x)

    def view(self, a: int, b: int | None = None) -> np.ndarray:
        return self.data[a : self.size if b is None else b]


class CausalWhisperStream:
    """One session: its encoder stream, decoder caches, emission state and segment audio."""

    def __init__(self, asr: StreamModel) -> None:
        self._asr = asr
        self._next_sample: int | None = None  # where the next chunk must start
        self._speech_until: int | None = None  # the final pass's last sample, once turn detection heard the speech end
        self._before: TurnBefore | None = None  # the turn before, for the first item's final pass (`read_on`)
        self._finished: TurnBefore | None = None  # its own last item, once finished (`turn_before`)
        self._history: list[Token] = []
        self._state = "open"
        self._item_start = 0.0
        self._item_from = 0  # the open item's first sample in the segment's audio
        self._heard = 0.0
        self._context = Context([], [])
        self._speech = asr.speech
        # the language the stream decodes in ("" while it is to detect: `_sot` None, the first frames held)
        self._language = asr.speech.language or ("" if asr.languages else "en")
        self._sot: list[int] | None = list(asr.sot) if self._language else None
        self._held: list[torch.Tensor] = []  # encoder blocks heard while the language is to detect
        self._detect: tuple[str, float] = ("", 0.0)  # the last detection (language, probability) while holding
        self._asked_at = 0  # samples heard at that detection
        self._first: Carry | None = None  # the first item's carry (its previous text)
        self._open_segment(0, None, _Samples())

    def set_speech(self, speech: Speech) -> None:
        """The language spoken (`DETECT`: detected from the stream's first `DETECT_S`, then by the final pass over the
        whole turn) and the task; before the first chunk. What the model cannot do is a ConfigError here."""
        if self._next_sample is not None or self._state != "open":
            raise RuntimeError("set_speech must come before the stream's first chunk")
        asr = self._asr
        sot = asr.prompt_for(Speech(speech.language or "en", speech.task))  # checks the language and the task
        if speech.language == DETECT and asr.languages and asr.detector is None:
            raise ConfigError(f"{asr.name}: detecting the language needs asr.final_pass = \"offline\"; give it")
        self._speech = speech
        self._language = speech.language or ("" if asr.languages else "en")
        self._sot = sot if self._language else None
        self._open_segment(0, self._first, _Samples())

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        """The text of the turns before this one and the user's vocabulary, as every item's previous text (module
        docstring); before the first chunk."""
        if self._next_sample is not None or self._state != "open":
            raise RuntimeError("set_context must come before the stream's first chunk")
        self._context = self._asr.context(previous, vocabulary)
        self._first = self._asr.first_carry(self._context)
        self._open_segment(0, self._first, _Samples())

    def read_on(self, before: object | None) -> None:
        """The turn before this one (another stream's `turn_before`), which the final pass of this stream's first
        item reads first (module docstring); before the first chunk. None, at any time before `finish`: no turn
        before (the pause after it was too long for this turn to go on from it)."""
        if before is None:
            self._before = None
            return
        if self._next_sample is not None or self._state != "open":
            raise RuntimeError("read_on must come before the stream's first chunk")
        if not isinstance(before, TurnBefore):
            raise TypeError(f"read_on takes a causal Whisper stream's turn_before, not {type(before).__name__}")
        self._before = before

    def turn_before(self) -> TurnBefore | None:
        """After `finish`: its last item as the next stream's turn before (`read_on`); None when it held no words."""
        return self._finished

    def _open_segment(self, start_sample: int, carry: Carry | None, audio: _Samples) -> None:
        asr = self._asr
        self._seg_start = start_sample  # absolute sample of the segment's first sample
        self._audio = audio
        self._fed = 0  # samples fed to the encoder
        self._frames = 0  # encoder frames received
        self._end = block_end(0, asr.block_frames)  # next block end
        self._encoder = asr.encoder.open_audio()
        self._item = asr.item(asr.scorer(), carry, self._sot)
        self._item_id = new_id("item")
        self._emitted = ""  # stable text already sent as deltas
        self._unstable = ""
        self._previewed = 0  # the segment's last previewed frame

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        if self._state != "open":
            raise RuntimeError(f"ASR stream is {self._state}; it accepts no more audio")
        if self._next_sample is None:
            self._next_sample = self._seg_start = chunk.start_sample
            self._item_start = self._heard = chunk.start
        elif chunk.start_sample != self._next_sample:
            kind = "gap" if chunk.start_sample > self._next_sample else "overlap"
            raise ValueError(
                f"audio chunk starts at sample {chunk.start_sample}, expected {self._next_sample} ({kind})"
            )
        self._next_sample += len(chunk.samples)
        self._audio.append(chunk.samples)
        return self._drain()

    def _drain(self) -> list[TranscriptUpdate]:
        """Feed the encoder block by block, exactly up to each block's emission sample, and step."""
        asr, updates = self._asr, []
        while self._audio.size >= (point := emission_sample(self._end)):
            frames = self._encoder.accept(self._audio.view(self._fed, point))
            self._fed = point
            assert self._frames + len(frames) == self._end, "encoder emitted an unexpected block"
            self._frames = self._end
            self._end += asr.block_frames
            if self._sot is None:  # the language is to detect: hold the blocks until Whisper is sure of it
                self._held.append(frames)
                if not self._sure():
                    continue
                frames = self._detected(frames)
            self._item.step(frames)
            if asr.reset_due(self._item, self._frames):
                updates.append(self._reset())
            elif update := self._update():
                updates.append(update)
        if self._asr.preview_frames and (update := self._preview()):
            updates.append(update)
        return updates

    def _sure(self) -> bool:
        """Whether the language to detect is known now (DETECT_S, DETECT_SURE, DETECT_GROWTH above): if so it is
        `self._detect`'s, for `_detected`."""
        heard, full = self._audio.size, self._asr.reset_due(self._item, self._frames)
        if not full and (heard < DETECT_S * SAMPLE_RATE or heard < self._asked_at * DETECT_GROWTH):
            return False
        if heard != self._asked_at or not self._detect[0]:
            self._detect, self._asked_at = self._asr.detect(self._audio.view(0)), heard
        return self._detect[1] >= DETECT_SURE or full

    def _detected(self, frames: torch.Tensor, *, end: bool = False) -> torch.Tensor:
        """Open the first item in the language detected (`_sure`'s; at the stream's `end`, over all it heard) and
        give back every block held meanwhile (`frames` among them) as one."""
        if end and (self._asked_at != self._audio.size or not self._detect[0]):  # audio came since the last ask
            self._detect, self._asked_at = self._asr.detect(self._audio.view(0)), self._audio.size
        self._language = self._detect[0]
        self._sot = self._asr.prompt_for(Speech(self._language, self._speech.task))
        self._item = self._asr.item(self._asr.scorer(), self._first, self._sot)
        held, self._held = self._held, []
        return torch.cat(held) if held else frames

    def _preview(self) -> TranscriptUpdate | None:
        """At the latest preview point the audio has reached inside the open block (if not previewed yet): what
        the block would add if it ended there, as the unstable tail; then taken back (`ItemDecoder.preview`).
        Points passed within one call are skipped: only the latest is shown."""
        step = self._asr.preview_frames
        if self._sot is None:
            return None
        point = (self._audio.size - FRAME_SAMPLES // 2) // FRAME_SAMPLES // step * step
        if point <= max(self._frames, self._previewed):
            return None
        self._previewed = point
        # the encoder itself is fed at block ends only, whatever the previews, so its states never depend on them
        frames = self._encoder.preview(self._audio.view(self._fed, emission_sample(point)))
        assert len(frames) == point - self._frames, "the encoder previewed an unexpected span"
        return self._show("", self._asr.text(self._item.preview(frames)), point)

    def _reset(self) -> TranscriptUpdate:
        asr, item = self._asr, self._item
        carry = asr.carry(self._history, item, self._frames, self._context)
        update = self._complete([t.id for t in item.tokens[: item.stable]], end_frame=self._frames)
        restart = (carry.restart_frame - item.frame0) * FRAME_SAMPLES
        item_from = self._frames * FRAME_SAMPLES - restart  # the next item starts where this one ended
        self._open_segment(self._seg_start + restart, carry, _Samples(self._audio.view(restart)))
        self._item_from = item_from
        self._before = None  # the next item is not the turn's start: its pass reads no turn before it
        return update

    def finish(self) -> list[TranscriptUpdate]:
        if self._state != "open":
            return []
        self._state = "finished"
        if self._next_sample is None:
            return []
        tail = torch.cat([self._encoder.accept(self._audio.view(self._fed)), self._encoder.flush()])
        frames = tail
        if self._sot is None:  # every block held, the tail among them, decoded now in the language detected over all
            self._held.append(tail)
            frames = self._detected(tail, end=True)
        if self._frames + len(tail):
            self._item.step(frames, final=True)
        self._frames += len(tail)
        final = self._asr.final_pass if isinstance(self._asr.final_pass, OfflinePass) else None
        if final is not None:
            final.last_language = ""  # set again only if the pass runs on this item (one worker thread runs both)
        speech = Speech(self._speech.language, self._speech.task)
        audio = self._final_audio()
        ids = self._asr.final_ids(self._item, audio, speech, self._before)
        reads_on = final is not None and final.reads_on  # (the next stream's pass reads it: kept only then)
        if final is not None and final.last_language:
            self._language = final.last_language
        self._finished = (TurnBefore(audio.copy(), tuple(ids), Speech(self._language, speech.task))
                          if ids and reads_on else None)
        return [self._complete(ids, end_frame=None, revisable=self._asr.final_pass is not None)]

    def end_speech(self, until_sample: int | None) -> str | None:
        """Turn detection heard the speech end: the final pass is to read the item's audio up to `until_sample` (the
        speech end plus a tail; what follows is silence), and with the offline pass its costly parts are computed now,
        during the pause (`OfflinePass.prepare`), which returns the open item's likely final transcript. None: speech
        went on, and the pass reads all the audio again."""
        self._speech_until = until_sample
        final = self._asr.final_pass
        if until_sample is None or self._state != "open" or self._next_sample is None:
            return None
        if not isinstance(final, OfflinePass):
            return None
        ids = final.prepare(self._item, self._final_audio(), Speech(self._speech.language, self._speech.task))
        return None if ids is None else self._asr.text(ids)

    def _final_audio(self) -> np.ndarray:
        """The open item's audio the final pass reads: all of it, or up to the speech end `end_speech` gave."""
        if self._speech_until is None:
            return self._audio.view(self._item_from)
        stop = min(self._audio.size, self._speech_until - self._seg_start)
        return self._audio.view(self._item_from, max(self._item_from, stop))

    def close(self) -> None:
        self._state = "closed"
        self._audio = _Samples()
        self._item = None  # type: ignore[assignment]  # drops the decoder caches
        self._encoder = None  # type: ignore[assignment]

    def _time(self, frame: int | None) -> float:
        """Media time decoded up to (the end of input if None); monotone: re-fed overlap never goes back."""
        if frame is None:
            t = self._next_sample / SAMPLE_RATE if self._next_sample is not None else 0.0
        else:
            t = (self._seg_start + frame * FRAME_SAMPLES) / SAMPLE_RATE
        self._heard = max(self._heard, t)
        return self._heard

    def _update(self) -> TranscriptUpdate | None:
        """The step's update: newly stable text and the tail; None when nothing changed."""
        item, text = self._item, self._asr.text
        stable = settled(text([t.id for t in item.tokens[: item.stable]]))
        delta = stable[len(self._emitted) :] if stable.startswith(self._emitted) else ""
        self._emitted += delta
        return self._show(delta, text([t.id for t in item.tokens]), self._frames)

    def _show(self, delta: str, full: str, frame: int) -> TranscriptUpdate | None:
        """The update that shows `full` as the item's text, heard up to `frame`: the emitted deltas (`delta` the
        newest of them) and the rest as the unstable tail; None when what is shown does not change."""
        unstable = full[len(self._emitted) :] if full.startswith(self._emitted) else ""
        if not delta and unstable == self._unstable:
            return None
        self._unstable = unstable
        return TranscriptUpdate(self._item_id, delta, unstable, self._item_start, self._time(frame),
                                language=self._language)

    def _complete(self, ids: Sequence[int], *, end_frame: int | None, revisable: bool = False) -> TranscriptUpdate:
        """The item's completion: its text must extend the emitted deltas, unless a final pass `revisable`y
        wrote it (the completed event then says what the item finally is, deltas notwithstanding)."""
        text = self._asr.text(ids)
        transcript = text if text.startswith(self._emitted) or revisable else self._emitted
        end = self._time(end_frame)
        delta = transcript[len(self._emitted) :] if transcript.startswith(self._emitted) else ""
        update = TranscriptUpdate(self._item_id, delta, "", self._item_start, end, completed=True,
                                  transcript=transcript, language=self._language)
        self._item_start = end
        return update
