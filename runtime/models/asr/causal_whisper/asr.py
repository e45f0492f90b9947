"""Causal streaming Whisper (CarelessWhisper, design.md §3): the checkpoint read as a streaming model, and the
emission rule its streams run.

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

A session's audio runs through a `CausalWhisperStream` (`stream.py`: block ends, resets, previews, the turns
before, the final pass); this module holds what every stream of the model shares (the model, its tokens, its
settings checked once, the final pass) and builds each item's decoder (`item`) and each reset's carry (`carry`,
`carry.py`).

`reference.offline_run` is the exactness reference (`reference.offline_transcript` its transcript): one
`forward_full` per segment, `RecomputeDecoder` (no caches, per-position cross-attention masks), the same rule,
steps, resets and previews.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase, WhisperFeatureExtractor, WhisperForConditionalGeneration

from runtime.config import ASRConfig
from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.asr.causal_whisper.carry import (
    CARRY_TOKENS,
    MAX_OVERLAP_S,
    RESTART_MARGIN_S,
    Carry,
    Context,
    plan_reset,
)
from runtime.models.asr.causal_whisper.decoder import IncrementalDecoder, Scorer, context_ids
from runtime.models.asr.causal_whisper.emission import ItemDecoder, Token
from runtime.models.asr.causal_whisper.encoder import (
    FRAME_MS,
    CausalWhisperEncoder,
    block_frames_for,
)
from runtime.models.asr.causal_whisper.final_pass import DecoderPass, FinalPass, OfflinePass, TurnBefore, check
from runtime.models.asr.causal_whisper.graph_choice import pass_graph, stream_graphs, wants_graphs
from runtime.models.asr.causal_whisper.onnx_decoder import OnnxDecoder, OnnxStep
from runtime.models.asr.causal_whisper.onnx_encoder import OnnxEncoderLayers
from runtime.models.asr.causal_whisper.onnx_export import check_encoder_weights, check_runtime
from runtime.models.asr.causal_whisper.stream import CausalWhisperStream
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
    Speech,
    check_english_only,
    language_ids,
    speech_prompt,
)
from runtime.models.loading import load_progress, resolve_dtype, torch_dtype


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
                pass_dtype = resolve_dtype(cfg.final_pass_dtype, device) or dtype
                own = cfg.adapter or pass_dtype != dtype or graphs
                offline = offline_decoder(copy.deepcopy(model) if own else model, tokenizer, path, cfg, device,
                                          pass_dtype)
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

    def detect(self, audio: np.ndarray) -> tuple[str, float]:
        """(the language spoken in `audio` (at most its first 30 s), its probability among the language tokens), by
        the offline pass's model (`WhisperBuffered.detect`); ("en", 1.0) for an English-only model."""
        if not self.languages:
            return "en", 1.0
        assert self.detector is not None, "checked at load"
        return self.detector.detect(self.detector.encode(audio))

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
