"""`FastConformerASR`: the cache-aware FastConformer-CTC behind the `StreamingASR` interface.

What the frames spell is decoding.py's job (`asr.decoder`): greedy CTC needs no search and no revision, so
every token is stable (`delta`) at once and `unstable` is always ""; the beam search with a word LM holds
back the words its hypotheses still disagree on as the unstable tail. Where items end is decided here, from
each frame's argmax label, the same for both decoders: an item is completed at a pause (`pause_s`, 0.8 s
of consecutive blank argmax frames after a non-blank one) and at `finish()`; its start is the frame of its
first non-blank label and its end the frame after its last (80 ms per frame at 8x subsampling, from the
stream's first sample). Repeats are collapsed across chunk boundaries by carrying the previous frame's label.
The look-ahead (`asr.lookahead_ms`: 0 | 80 | 480 | 1040 for NVIDIA's 8x models, 0 | 40 | 240 | 520 for the
4x demo model) picks one of the model's trained [left, right]
attention contexts at run time; the same weights serve all of them.

Item text is re-read from the decoder on each update (tokens -> text is not piecewise for byte pieces);
that costs microseconds per token and items end at pauses. The encoder's per-chunk work is flat.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig
from runtime.errors import CheckpointNotFound, ConfigError
from runtime.events import new_id
from runtime.models.asr.base import Speech, TranscriptUpdate
from runtime.models.asr.fastconformer.cache_aware_encoder import CacheAwareEncoderStream
from runtime.models.asr.fastconformer.checkpoint import (
    CHECKPOINT_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    is_checkpoint_dir,
    load_checkpoint,
)
from runtime.models.asr.fastconformer.decoding import DECODERS, BeamParts, GreedyText, ItemText, find_word_lm
from runtime.models.asr.fastconformer.model import FastConformerCTC
from runtime.models.asr.fastconformer.nemo import load_nemo
from runtime.models.asr.fastconformer.tokenizer import CTCTokenizer
from runtime.models.loading import load_progress, resolve_checkpoint, torch_dtype

PAUSE_S = 0.8


def context_for_lookahead(model: FastConformerCTC, lookahead_ms: int) -> tuple[int, int]:
    """The model's [left, right] attention context whose look-ahead is `lookahead_ms`."""
    offered = {model.cfg.lookahead_ms(c): c for c in model.cfg.att_context_sizes}
    if lookahead_ms not in offered:
        known = ", ".join(str(ms) for ms in sorted(offered))
        raise ConfigError(f"asr.lookahead_ms={lookahead_ms} is not offered by this model (one of {known})")
    return offered[lookahead_ms]


def find_checkpoint(ref: str, progress: Callable[[str], None] | None = None) -> Path:
    """What `asr.model` names: a checkpoint directory of our own format (model.safetensors + config.json, see
    checkpoint.py; it wins when a directory holds both kinds) or a `.nemo` file (`ref` itself, or the single
    `.nemo` in the directory `ref` resolves to)."""
    path = Path(ref).expanduser()
    if path.is_file():
        if path.name in CHECKPOINT_FILES:  # a file inside a checkpoint directory: the directory is meant
            return path.parent
        return path
    directory = resolve_checkpoint(ref, role="asr", progress=progress)
    if is_checkpoint_dir(directory):
        return directory
    found = sorted(directory.glob("*.nemo"))
    if len(found) == 1:
        return found[0]
    partial = [name for name in (WEIGHTS_FILE, CONFIG_FILE) if (directory / name).is_file()]
    if partial:
        lacking = next(name for name in (WEIGHTS_FILE, CONFIG_FILE) if name not in partial)
        raise CheckpointNotFound(f"asr checkpoint {ref!r}: {directory} holds {partial[0]} but no {lacking}")
    what = "no .nemo file" if not found else f"{len(found)} .nemo files ({', '.join(p.name for p in found)})"
    raise CheckpointNotFound(f"asr checkpoint {ref!r}: {directory} holds {what} and no {WEIGHTS_FILE} + "
                             f"{CONFIG_FILE}; point asr.model at a checkpoint directory or one .nemo file")


def find_nemo(ref: str, progress: Callable[[str], None] | None = None) -> Path:
    """A `.nemo` file: `ref` itself, or the single `.nemo` in the checkpoint directory `ref` resolves to."""
    found = find_checkpoint(ref, progress)
    if found.is_dir():
        raise CheckpointNotFound(f"asr checkpoint {ref!r}: {found} is a safetensors checkpoint, not a .nemo file")
    return found


def load_any(path: Path) -> tuple[FastConformerCTC, CTCTokenizer]:
    """Load what `find_checkpoint` found: a checkpoint directory or a `.nemo` archive."""
    return load_checkpoint(path) if path.is_dir() else load_nemo(path)


class FastConformerASR:
    """A loaded model shared by sessions; each `open_stream()` carries its own caches."""

    def __init__(
        self,
        model: FastConformerCTC,
        tokenizer: CTCTokenizer,
        cfg: ASRConfig,
        *,
        name: str = "fastconformer",
        pause_s: float = PAUSE_S,
        checkpoint: Path | None = None,
    ) -> None:
        """`checkpoint` is where the model was read from: a beam decoder looks there for its lm.arpa."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.name = name
        self.context = context_for_lookahead(model, cfg.lookahead_ms)
        self.pause_frames = max(1, round(pause_s / model.cfg.frame_seconds))
        if cfg.decoder not in DECODERS:
            raise ConfigError(f"asr.decoder={cfg.decoder!r} is not one of {', '.join(DECODERS)}")
        self.beam: BeamParts | None = None
        if cfg.decoder == "beam":
            lm = find_word_lm(cfg, checkpoint) if checkpoint is not None or cfg.lm else None
            self.beam = BeamParts(tokenizer, model.blank, lm, cfg, model.cfg.frame_seconds)

    def item_text(self) -> ItemText:
        """A fresh decoder of one stream's items (greedy or beam, per `asr.decoder`)."""
        return self.beam.open() if self.beam is not None else GreedyText(self.tokenizer, self.model.blank)

    @classmethod
    def load(
        cls, cfg: ASRConfig, *, device: str, dtype: str, progress: Callable[[str], None] | None = None
    ) -> FastConformerASR:
        with load_progress(progress, "asr", cfg.model, device, dtype):
            checkpoint = find_checkpoint(cfg.model, progress)
            model, tokenizer = load_any(checkpoint)
            model.to_runtime(device, torch_dtype(dtype))
            return cls(model, tokenizer, cfg, name=cfg.model, checkpoint=checkpoint)

    def open_stream(self) -> FastConformerStream:
        return FastConformerStream(self)


class FastConformerStream:
    """One session: encoder caches, the previous CTC label and the open item."""

    def __init__(self, asr: FastConformerASR) -> None:
        self._asr = asr
        self._encoder: CacheAwareEncoderStream | None = CacheAwareEncoderStream(asr.model, asr.context)
        self._blank = asr.model.blank
        self._frame_s = asr.model.cfg.frame_seconds
        self._next_sample: int | None = None
        self._origin = 0.0  # media seconds of the stream's first sample
        self._frames = 0  # encoder frames decoded so far
        self._previous: int | None = None  # label of the last frame: repeats collapse across chunks
        self._blank_run = 0
        self._state = "open"
        self.token_ids: list[int] = []  # every greedy token so far, across items (what the argmax spells)
        self._text = asr.item_text()
        self._new_item()

    def _new_item(self) -> None:
        self._item_id = new_id("item")
        self._heard = False  # a non-blank label since the item began
        self._emitted = ""
        self._unstable = ""
        self._first_frame = 0
        self._last_frame = 0

    def _time(self, frame: int) -> float:
        return self._origin + frame * self._frame_s

    def accept(self, chunk: AudioChunk) -> list[TranscriptUpdate]:
        if self._state != "open" or self._encoder is None:
            raise RuntimeError(f"ASR stream is {self._state}; it accepts no more audio")
        if self._next_sample is None:
            self._next_sample = chunk.start_sample
            self._origin = chunk.start_sample / SAMPLE_RATE
        elif chunk.start_sample != self._next_sample:
            kind = "gap" if chunk.start_sample > self._next_sample else "overlap"
            raise ValueError(
                f"audio chunk starts at sample {chunk.start_sample}, expected {self._next_sample} ({kind})"
            )
        self._next_sample = chunk.end_sample
        return self._decode(self._encoder.accept(chunk.samples))

    def set_context(self, previous: str, vocabulary: str = "") -> None:
        """Nothing: a CTC model reads no text before the audio (its word LM is the checkpoint's own)."""

    def set_speech(self, speech: Speech) -> None:
        """The shipped FastConformers hear English and write it: anything else is refused, never ignored."""
        if speech.language not in ("", "en") or speech.task != "transcribe":
            raise ConfigError("the FastConformer ASR transcribes English only (no other language, no translation; "
                              "use --profile whisper-base)")

    def finish(self) -> list[TranscriptUpdate]:
        if self._state != "open" or self._encoder is None:
            return []
        self._state = "finished"
        updates = self._decode(self._encoder.finish())
        if self._heard:
            updates.append(self._complete())
        return updates

    def close(self) -> None:
        self._state = "closed"
        self._encoder = None

    @torch.inference_mode()
    def _decode(self, frames: torch.Tensor) -> list[TranscriptUpdate]:
        if frames.shape[0] == 0:
            return []
        logprobs = self._asr.model.decoder(frames.unsqueeze(0))[0].float().cpu()
        labels = logprobs.argmax(-1).tolist()
        rows = logprobs.numpy()
        updates: list[TranscriptUpdate] = []
        for label, row in zip(labels, rows, strict=True):
            frame = self._frames
            self._frames += 1
            self._text.push(label, row)
            if label == self._blank:
                self._blank_run += 1
            else:
                self._blank_run = 0
                if not self._heard:
                    self._heard = True
                    self._first_frame = frame
                if label != self._previous:
                    self.token_ids.append(label)
                self._last_frame = frame
            self._previous = label
            if self._heard and self._blank_run >= self._asr.pause_frames:
                updates.append(self._complete())
        if self._heard:
            text, unstable = self._text.stable(), self._text.unstable()
            delta = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
            if delta or unstable != self._unstable:
                self._emitted += delta
                self._unstable = unstable
                # the item spans its speech: it ends after its last spoken frame, however much silence was heard
                start, end = self._time(self._first_frame), self._time(self._last_frame + 1)
                updates.append(TranscriptUpdate(self._item_id, delta, unstable, start, end))
        return updates

    def _complete(self) -> TranscriptUpdate:
        text = self._text.finish()
        transcript = text if text.startswith(self._emitted) else self._emitted
        update = TranscriptUpdate(
            self._item_id,
            transcript[len(self._emitted) :],
            "",
            self._time(self._first_frame),
            self._time(self._last_frame + 1),
            completed=True,
            transcript=transcript,
        )
        self._new_item()
        return update
