"""Causal streaming Whisper (CarelessWhisper, design.md §3): the emission rule, cache resets, the stream.

Audio goes into a block-causal `AudioEncoderStream`; after each block of encoder frames the decoder
(`IncrementalDecoder`, cross-attention K/V appended per block) runs the emission rule (`ItemDecoder.step`):

1. re-check the unstable tail (the last `lookback_tokens` tokens not yet stable): a token stays if its
   probability under the new encoder context did not fall (against its last evaluation), or it is still
   the argmax; at the first that fails, it and everything after it are cut (self-attention KV rolled back);
2. greedily decode on until eos, a loop, `block_tokens` new tokens, or the item's token budget
   (`emission.py` holds the rule);
3. with `asr.refresh_ms`, a block that stopped on eos or a loop while the decoder's positions were fed that long
   ago does steps 1-2 once more with every position re-fed on all the frames heard.

Tokens older than the look-back window are stable: emitted once as `delta`, never retracted. Deltas are the
difference between decodes of the whole stable prefix (byte-level BPE safe; a trailing incomplete UTF-8
character is held back). At finish the encoder is flushed, the last step decodes to eos and all is stable.

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

The turn before, read on (`read_on`, before the first chunk; a captions session's, pipeline/audio.py): the offline
pass of the stream's first item also decodes that turn's audio and ids with its own (final_pass.py, `TurnBefore`);
`turn_before` gives the finished stream's last item for the next stream.

`reference.offline_run` is the exactness reference (`reference.offline_transcript` its transcript): one
`forward_full` per segment, `RecomputeDecoder` (no caches, per-position cross-attention masks), the same rule,
steps, resets and previews.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, WhisperFeatureExtractor, WhisperForConditionalGeneration

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig
from runtime.errors import CheckpointNotFound, ConfigError
from runtime.events import new_id
from runtime.models.asr.base import TranscriptUpdate
from runtime.models.asr.causal_whisper.decoder import IncrementalDecoder, Scorer, context_ids
from runtime.models.asr.causal_whisper.emission import ItemDecoder, Token
from runtime.models.asr.causal_whisper.encoder import (
    FRAME_MS,
    FRAME_SAMPLES,
    CausalWhisperEncoder,
    block_end,
    block_frames_for,
    emission_sample,
)
from runtime.models.asr.causal_whisper.final_pass import DecoderPass, FinalPass, OfflinePass, TurnBefore, check
from runtime.models.asr.causal_whisper.graph_choice import pass_graph, stream_graphs, wants_graphs
from runtime.models.asr.causal_whisper.onnx_decoder import OnnxDecoder, OnnxStep
from runtime.models.asr.causal_whisper.onnx_encoder import OnnxEncoderLayers
from runtime.models.asr.causal_whisper.onnx_export import check_encoder_weights, check_runtime
from runtime.models.asr.whisper_buffered import WhisperBuffered
from runtime.models.asr.whisper_checkpoint import (
    PROMPT_TOKENS,
    encoded,
    fit_previous,
    is_multilingual,
    load_whisper,
    suppressed_ids,
    transcript_prompt,
)
from runtime.models.asr.whisper_head import check_decoder, check_head, quantize_decoder, quantize_head
from runtime.models.asr.whisper_language import (
    DETECT,
    Speech,
    check_english_only,
    language_ids,
    speech_prompt,
)
from runtime.models.loading import load_progress, torch_dtype

DETECT_S = 2.0  # a stream whose language is to detect holds its words until it has heard this much (or its end)
RESTART_MARGIN_S = 0.5  # re-feed from this long before the last stable token's emission
MAX_OVERLAP_S = 5.0  # ... but never more than this (nor half the segment) before the reset point
CARRY_TOKENS = 64  # stable tokens carried across a reset as prompt / forced prefix


@dataclass(frozen=True)
class Context:
    """A stream's previous text as tokens (`CausalWhisperASR.context`): the user's vocabulary, kept whole, and the
    text of the turns before, of which the most recent tokens are kept."""

    vocabulary: list[int]
    recent: list[int]


@dataclass(frozen=True)
class Carry:
    """What crosses a reset: where the new segment starts and the decoder context of its item."""

    restart_frame: int  # absolute encoder frame where the new encoder starts
    previous: list[int]  # prompt text (emitted before restart)
    forced: list[int]  # forced transcript prefix (emitted after restart: may describe re-fed audio)


def plan_reset(history: Sequence[Token], reset_frame: int, segment_start: int, *, margin: int,
               max_overlap: int) -> Carry:
    """Where to restart and what to carry; `history` = the carried stable tokens so far (oldest first),
    frames absolute. The restart lies in [reset - overlap, reset] with overlap <= half the segment, so
    every reset advances the audio by at least half a segment."""
    overlap = min(max_overlap, (reset_frame - segment_start) // 2)
    anchor = history[-1].frame if history else segment_start
    restart = min(reset_frame, max(reset_frame - overlap, anchor - margin))
    first = next((i for i, t in enumerate(history) if t.frame > restart), len(history))
    return Carry(restart, [t.id for t in history[:first]], [t.id for t in history[first:]])


def settled(text: str) -> str:
    """Hold back a trailing U+FFFD: an incomplete UTF-8 character that the next token may complete."""
    return text.rstrip("\ufffd")


class CausalWhisperASR:
    """A Whisper checkpoint (optionally with a merged LoRA adapter) read as a causal streaming model."""

    def __init__(self, model: WhisperForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, cfg: ASRConfig,
                 *, name: str = "causal-whisper", final_pass: FinalPass | None = None,
                 onnx_step: OnnxStep | None = None, encoder_graph: OnnxEncoderLayers | None = None) -> None:
        """`final_pass` re-decodes each committed item (None: the streamed text is final); `onnx_step` and
        `encoder_graph` run the streams' decoders and encoder layers (`asr.graph_runtime = onnxruntime`; None: torch
        runs `model`'s)."""
        self.block_frames = block_frames_for(cfg.chunk_ms)
        if cfg.preview_ms and not (0 < cfg.preview_ms < cfg.chunk_ms and cfg.preview_ms % FRAME_MS == 0
                                   and cfg.chunk_ms % cfg.preview_ms == 0):
            raise ConfigError(f"asr.preview_ms must be a multiple of {FRAME_MS} ms that divides asr.chunk_ms "
                              f"({cfg.chunk_ms}) and is smaller, got {cfg.preview_ms} (0: no previews)")
        self.preview_frames = cfg.preview_ms // FRAME_MS
        if cfg.lookback_tokens < 0 or cfg.loop_repeats < 0 or cfg.refresh_ms < 0:
            raise ConfigError(f"asr.lookback_tokens, asr.loop_repeats and asr.refresh_ms must be >= 0, got "
                              f"{cfg.lookback_tokens}, {cfg.loop_repeats} and {cfg.refresh_ms}")
        self.refresh_frames = math.ceil(cfg.refresh_ms / FRAME_MS)
        self.model, self.tokenizer, self.cfg, self.name = model, tokenizer, cfg, name
        self.final_pass = final_pass
        self.onnx_step, self.encoder_graph = onnx_step, encoder_graph
        self.encoder = CausalWhisperEncoder(model, block_frames=self.block_frames, graph=encoder_graph)
        b = self.block_frames
        # The last block end whose emission fits the encoder's 30 s (1500 frames; frame 1500 needs flush).
        limit = min(round(cfg.reset_s * 50), self.encoder.max_frames - 1)
        self.reset_frame = (limit // b) * b
        if not 0 < cfg.reset_s <= 30 or self.reset_frame < 2 * b:
            raise ConfigError(f"asr.reset_s must be in (0, 30] and hold two chunks of {cfg.chunk_ms} ms, "
                              f"got {cfg.reset_s:g}")
        # the language and task (whisper_language.py): `sot` is the start-of-transcript sequence of the model's own
        # speech, or while a stream's language is still to detect the English one, which gives it its length
        self.speech = Speech(cfg.language, cfg.task)
        self.languages = language_ids(tokenizer) if is_multilingual(model.config) else {}
        if self.languages:
            self.sot = speech_prompt(tokenizer, model.config, Speech(cfg.language or "en", cfg.task), name)
        else:
            check_english_only(self.speech, name)
            self.sot = transcript_prompt(tokenizer, model.config, cfg.language)
        # a language to detect is detected by the offline pass's full-context model (the block-causal states of a stock
        # checkpoint are no language identifier)
        self.detector = final_pass.offline if isinstance(final_pass, OfflinePass) else None
        if self.languages and not cfg.language and self.detector is None:
            raise ConfigError("asr.language = \"\" (detect the language) needs asr.final_pass = \"offline\": its "
                              "full-context model identifies the language; or give the language")
        self.suppress = suppressed_ids(model)
        if not self.sot:
            raise ConfigError(f"asr.model {name!r}: its tokenizer has no <|startoftranscript|>; is it Whisper?")
        self.eos_id = int(tokenizer.eos_token_id)
        positions = model.config.max_target_positions - len(self.sot) - 1
        self.max_tokens = min(cfg.max_new_tokens, positions // 2)
        if self.max_tokens <= cfg.lookback_tokens:
            raise ConfigError(f"asr.max_new_tokens ({self.max_tokens} usable) must exceed asr.lookback_tokens")
        self.carry_tokens = min(CARRY_TOKENS, positions - self.max_tokens)
        self.prompt_tokens = min(PROMPT_TOKENS, positions - self.max_tokens)  # previous text an item may start with
        self.block_tokens = max(2, math.ceil(cfg.chunk_ms / 100))
        self.margin = round(RESTART_MARGIN_S * 50)
        self.max_overlap = round(MAX_OVERLAP_S * 50)

    @classmethod
    def load(cls, cfg: ASRConfig, *, device: str, dtype: str,
             progress: Callable[[str], None] | None = None) -> CausalWhisperASR:
        """Load model and tokenizer; a `cfg.adapter` LoRA is merged into the weights (no inference cost). The
        `offline` final pass keeps the checkpoint as it was before the merge: full context needs no adapter."""
        kind = check(cfg.final_pass)
        check_head(cfg.head_weights)
        check_decoder(cfg.decoder_weights)
        check_runtime(cfg.graph_runtime)
        check_encoder_weights(cfg.encoder_weights)
        with load_progress(progress, "asr", cfg.model, device, dtype):
            model, tokenizer, path = load_whisper(cfg.model, dtype=dtype, progress=progress)
            final: FinalPass | None = DecoderPass() if kind == "decoder" else None
            if kind == "offline":  # its own copy where the stream's model is changed: merged, cast, exported
                graphs = wants_graphs(cfg, device, dtype)
                own = cfg.adapter or cfg.final_pass_dtype not in ("", dtype) or graphs
                offline = offline_decoder(copy.deepcopy(model) if own else model, tokenizer, path, cfg, device,
                                          cfg.final_pass_dtype or dtype)
                searched = graphs and cfg.final_pass_beam == 1  # the graph runs greedy searches only
                final = OfflinePass(offline, pass_graph(copy.deepcopy(model), offline, cfg, device, progress)
                                    if searched else None, read_on=cfg.final_pass_read_on)
            if cfg.adapter:
                from runtime.models.asr.causal_whisper.lora import load_adapter

                try:
                    model = load_adapter(model, cfg.adapter).merge_and_unload()
                except (OSError, ValueError) as err:
                    raise CheckpointNotFound(f"asr adapter {cfg.adapter!r} cannot be loaded ({err}); point "
                                             "--set asr.adapter= at a directory written by `runtime train`") from None
            model = model.to(device).eval()
            step, encoder = stream_graphs(model, cfg, progress)
            if step is None:
                model = quantize_decoder(quantize_head(model, cfg.head_weights), cfg.decoder_weights)
        return cls(model, tokenizer, cfg, name=cfg.model, final_pass=final, onnx_step=step, encoder_graph=encoder)

    def scorer(self) -> Scorer:
        """A new item's decoder state: the ONNX Runtime graph's, or torch's over the model."""
        return OnnxDecoder(self.onnx_step) if self.onnx_step is not None else IncrementalDecoder(self.model)

    def open_stream(self) -> CausalWhisperStream:
        return CausalWhisperStream(self)

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def context(self, previous: str, vocabulary: str = "") -> Context:
        """A stream's previous text as tokens: `vocabulary` (the user's words) and `previous` (the turns before)."""
        return Context(encoded(self.tokenizer, vocabulary)[: self.prompt_tokens],
                       encoded(self.tokenizer, previous)[-self.prompt_tokens :])

    def first_carry(self, context: Context) -> Carry | None:
        """What a stream's first item starts from: its previous text (None without any)."""
        previous = fit_previous(context.vocabulary, context.recent, self.prompt_tokens)
        return Carry(0, previous, []) if previous else None

    def prompt_for(self, speech: Speech) -> list[int]:
        """The start-of-transcript sequence of `speech`, its language given (a ConfigError for one the model lacks,
        or for anything but English transcripts of an English-only model)."""
        if not self.languages:
            check_english_only(speech, self.name)
            return list(self.sot)
        return speech_prompt(self.tokenizer, self.model.config, speech, self.name)

    def detect(self, audio: np.ndarray) -> str:
        """The language spoken in `audio` (at most its first 30 s), by the offline pass's model
        (`WhisperBuffered.detect`)."""
        if not self.languages:
            return "en"
        assert self.detector is not None, "checked at load"
        return self.detector.detect(self.detector.encode(audio))[0]

    def item(self, scorer: Scorer, carry: Carry | None, sot: Sequence[int] | None = None) -> ItemDecoder:
        """A new item's decoder after `carry`'s text and the start-of-transcript sequence `sot` (default `self.sot`)."""
        previous, forced = (carry.previous, carry.forced) if carry else ([], [])
        context = context_ids(self.tokenizer, self.sot if sot is None else sot, previous) + forced
        return ItemDecoder(scorer, context, eos_id=self.eos_id, lookback=self.cfg.lookback_tokens,
                           max_tokens=self.max_tokens, block_tokens=self.block_tokens,
                           frame0=carry.restart_frame if carry else 0, loop_repeats=self.cfg.loop_repeats,
                           suppress=self.suppress, refresh=self.refresh_frames,
                           previous=fit_previous([], [*previous, *forced], self.prompt_tokens))

    def reset_due(self, item: ItemDecoder, frames: int) -> bool:
        """After a non-final step with `frames` frames in the segment: is it time to reset?"""
        return frames >= self.reset_frame or item.full

    def carry(self, history: list[Token], item: ItemDecoder, frames: int, context: Context | None = None) -> Carry:
        """Extend `history` with the item's stable tokens (kept to CARRY_TOKENS) and plan the reset; the new item's
        previous text is the stream's `context` followed by the carried text before the restart, the vocabulary and
        the most recent tokens kept within `prompt_tokens` (less the forced prefix)."""
        history += item.tokens[: item.stable]
        del history[: -self.carry_tokens or len(history)]
        carry = plan_reset(history, item.frame0 + frames, item.frame0, margin=self.margin,
                           max_overlap=self.max_overlap)
        context = context or Context([], [])
        room = max(0, self.prompt_tokens - len(carry.forced))
        return replace(carry, previous=fit_previous(context.vocabulary, [*context.recent, *carry.previous], room))

    def final_ids(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None = None,
                  before: TurnBefore | None = None) -> list[int]:
        """The committed item's final ids: its stream's, or the final pass's when the stream heard any words or the
        pass judges speech itself (the `offline` pass: a stream given the turns before as context sometimes writes
        nothing for a short turn, "two" after "one", that the pass hears; over silence Whisper's no-speech
        probability empties it)."""
        ids = [t.id for t in item.tokens]
        if self.final_pass is None or not (self.final_pass.judges_speech or self.text(ids).strip()):
            return ids
        return self.final_pass.revise(item, audio, speech, before)


def offline_decoder(model: WhisperForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, path: Path,
                    cfg: ASRConfig, device: str, dtype: str) -> WhisperBuffered:
    """Full-context Whisper over the same checkpoint (the `offline` final pass), in `dtype`, its encoder on
    `cfg.final_pass_window_s` windows, its head in `cfg.head_weights`, its decoder in `cfg.decoder_weights`, searching
    with `cfg.final_pass_beam` beams (1: greedy)."""
    model = quantize_head(model.to(device=device, dtype=torch_dtype(dtype)).eval(), cfg.head_weights)
    model = quantize_decoder(model, cfg.decoder_weights)
    return WhisperBuffered(model, tokenizer, WhisperFeatureExtractor.from_pretrained(path),
                           replace(cfg, backend="whisper-buffered"), name=cfg.model, window_s=cfg.final_pass_window_s,
                           beams=cfg.final_pass_beam)


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

    def __init__(self, asr: CausalWhisperASR) -> None:
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

    def read_on(self, before: object) -> None:
        """The turn before this one (another stream's `turn_before`), which the final pass of this stream's first
        item reads first (module docstring); before the first chunk."""
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
            if self._sot is None:  # the language is to detect: hold the blocks until DETECT_S is heard
                self._held.append(frames)
                if self._audio.size < DETECT_S * SAMPLE_RATE:
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

    def _detected(self, frames: torch.Tensor) -> torch.Tensor:
        """Detect the language over the audio heard so far, open the first item in it, and give back every block
        held meanwhile (`frames` among them) as one."""
        self._language = self._asr.detect(self._audio.view(0))
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
        frames = torch.cat([self._encoder.accept(self._audio.view(self._fed)), self._encoder.flush()])
        if self._sot is None:
            frames = self._detected(torch.cat([*self._held, frames]))
        if self._frames + len(frames):
            self._item.step(frames, final=True)
        self._frames += len(frames)
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
