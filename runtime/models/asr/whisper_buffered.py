"""The slice's ASR model: an unmodified Whisper that the buffered peer re-decodes, and its decoding.

`WhisperBuffered` is the loaded checkpoint shared by sessions; each session's buffer and its LocalAgreement-2
policy (the peer the causal streaming backends must beat) are `whisper_buffered_stream.py`'s, which `open_stream`
gives.

Decoding is our own greedy loop over the decoder with a KV cache (or, for the final pass that borrows this class,
`whisper_beam.py`'s beam search over the same decoder): Whisper's `generate()` needs a generation config with many
attributes (alignment heads, language maps, ...) that checkpoints and the tiny test model do not all have, and it
runs the whole policy-free search we do not want here. The final pass encodes on windows shorter than 30 s and
silence's states after them (`whisper_window.py`): the cross-attention keys and values of those silent frames are
computed here once, and each turn projects only its own frames.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    PreTrainedTokenizerBase,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)
from transformers.models.whisper.modeling_whisper import WhisperDecoder

from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.transcript_draft import greedy
from runtime.models.asr.whisper_beam import beam_search
from runtime.models.asr.whisper_buffered_stream import WhisperBufferedStream
from runtime.models.asr.whisper_checkpoint import (
    is_multilingual,
    load_whisper,
    no_speech_id,
    previous_ids,
    prompt_prefix,
    suppressed_ids,
    transcript_prompt,
)
from runtime.models.asr.whisper_language import Speech, check_english_only, detected, language_ids, speech_prompt
from runtime.models.asr.whisper_window import Encoded, WindowedEncoder
from runtime.models.loading import load_progress

MAX_BUFFER_S = 30.0  # Whisper's encoder sees exactly 30 s
# transformers 5.x renamed the decoder's `past_key_values` argument to `cache` (the old name warns on every call)
CACHE_ARG = "cache" if "cache" in inspect.signature(WhisperDecoder.forward).parameters else "past_key_values"


class WhisperBuffered:
    """A Whisper checkpoint shared by sessions; `open_stream()` gives each session its own buffer."""

    def __init__(
        self,
        model: WhisperForConditionalGeneration,
        tokenizer: PreTrainedTokenizerBase,
        feature_extractor: WhisperFeatureExtractor,
        cfg: ASRConfig,
        *,
        name: str = "whisper",
        window_s: float = MAX_BUFFER_S,
        beams: int = 1,
    ) -> None:
        """`window_s` < 30 encodes only the audio padded to the next multiple of `window_s` (`whisper_window.py`):
        the `offline` final pass's setting; the buffered peer keeps Whisper's 30 s. `beams` > 1 decodes by beam
        search (`whisper_beam.py`), as the final pass may; 1 is greedy."""
        if cfg.step_s <= 0 or not 0 < cfg.segment_s <= MAX_BUFFER_S:
            raise ConfigError(
                f"asr.step_s must be > 0 and asr.segment_s in (0, {MAX_BUFFER_S:g}] "
                f"(got {cfg.step_s:g}, {cfg.segment_s:g})"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.cfg = cfg
        self.name = name
        if beams < 1:
            raise ConfigError(f"asr.final_pass_beam must be >= 1, got {beams}")
        self.beams = beams
        self.encoder = WindowedEncoder(model.model.encoder, feature_extractor, window_s)
        silence = self.encoder.silence
        self.silence_kv = None if silence is None else self.cross_kv(silence)
        # the language and task the model is asked for (Speech: "" detects the language from each audio's
        # encoder states); `prompt_ids` is the start-of-transcript sequence when none is given: its language's, or in
        # detection the English one, which gives the prompt its length (every language's is as long)
        self.speech = Speech(cfg.language, cfg.task)
        self.languages = language_ids(tokenizer) if is_multilingual(model.config) else {}
        if self.languages:
            self.prompt_ids = speech_prompt(tokenizer, model.config, Speech(cfg.language or "en", cfg.task), cfg.model)
        else:
            check_english_only(self.speech, cfg.model)
            self.prompt_ids = transcript_prompt(tokenizer, model.config, cfg.language)
        self.suppress = suppressed_ids(model)
        self.eos_id = tokenizer.eos_token_id
        self.no_speech_id = no_speech_id(tokenizer)
        self.max_positions = model.config.max_target_positions
        # Prompt + hypothesis must fit the decoder's learned positions.
        self.max_tokens = min(cfg.max_new_tokens, model.config.max_target_positions - len(self.prompt_ids))

    def prefix(self, previous: Sequence[int] = (), sot: Sequence[int] | None = None) -> list[int]:
        """The decoder's prompt: `previous` text (`<|startofprev|>`, whisper_checkpoint.prompt_prefix), then the
        start-of-transcript sequence `sot` (default `prompt_ids`)."""
        return prompt_prefix(self.tokenizer, list(self.prompt_ids if sot is None else sot), list(previous))

    def prompt_for(self, speech: Speech) -> list[int]:
        """The start-of-transcript sequence of `speech` with its language known (an error for a language the
        checkpoint lacks, or, English-only, for anything but English transcripts)."""
        if not self.languages:
            check_english_only(speech, self.cfg.model)
            return list(self.prompt_ids)
        return speech_prompt(self.tokenizer, self.model.config, speech, self.cfg.model)

    def sot_for(self, encoded: Encoded, speech: Speech | None = None) -> tuple[list[int], str]:
        """(start-of-transcript sequence, language) for `encoded` audio: `speech`'s (default the model's), its
        language detected from the audio when not given; English-only checkpoints: English."""
        speech = speech or self.speech
        if not self.languages:
            return self.prompt_for(speech), "en"
        language = speech.language or self.detect(encoded)[0]
        return self.prompt_for(Speech(language, speech.task)), language

    @torch.inference_mode()
    def detect(self, encoded: Encoded) -> tuple[str, float]:
        """Whisper's language identification (whisper_language.py): the most probable language token after
        `<|startoftranscript|>` over the encoded audio, with its probability; ("en", 1.0) when English-only."""
        if not self.languages:
            return "en", 1.0
        states = encoded.states
        ids = torch.tensor([self.prompt_ids[:1]], device=states.device)
        hidden = self.model.model.decoder(input_ids=ids, encoder_hidden_states=states, use_cache=True,
                                          **{CACHE_ARG: self.cache(encoded)}).last_hidden_state
        return detected(self.model.proj_out(hidden[0, -1:])[0], self.languages)

    def context_ids(self, previous: str, vocabulary: str = "") -> list[int]:
        return previous_ids(self.tokenizer, previous, vocabulary)

    def budget(self, prefix: Sequence[int]) -> int:
        """Transcript tokens that fit after `prefix` (previous text takes positions from the transcript's 448)."""
        return max(0, min(self.max_tokens, self.max_positions - len(prefix) - 1))

    @classmethod
    def load(
        cls, cfg: ASRConfig, *, device: str, dtype: str, progress: Callable[[str], None] | None = None
    ) -> WhisperBuffered:
        with load_progress(progress, "asr", cfg.model, device, dtype):
            model, tokenizer, path = load_whisper(cfg.model, dtype=dtype, device=device, progress=progress)
            feature_extractor = WhisperFeatureExtractor.from_pretrained(path)
        return cls(model, tokenizer, feature_extractor, cfg, name=cfg.model)

    def open_stream(self) -> WhisperBufferedStream:
        return WhisperBufferedStream(self, step_s=self.cfg.step_s, segment_s=self.cfg.segment_s)

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @torch.inference_mode()
    def encode(self, audio: np.ndarray) -> Encoded:
        """Encoder states [1, 1500, d] of up to 30 s of audio, with how many were encoded from it: Whisper's own
        30 s window, or with `window_s` < 30 the audio's windows and silence after them (`whisper_window.py`)."""
        return self.encoder(audio)

    @torch.inference_mode()
    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention keys and values [1, heads, frames, head_dim] of `states`."""
        out = []
        for layer in self.model.model.decoder.layers:
            attn = layer.encoder_attn
            shape = (1, -1, attn.num_heads, attn.head_dim)
            keys, values = (proj(states).view(shape).transpose(1, 2).contiguous()
                            for proj in (attn.k_proj, attn.v_proj))
            out.append((keys, values))
        return out

    @torch.inference_mode()
    def cache(self, encoded: Encoded) -> EncoderDecoderCache:
        """A decoder cache for `encoded`: its cross-attention keys and values filled in already where silence's are
        known (only the audio's frames projected), else left to the decoder's first call (all 1500 frames)."""
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if self.silence_kv is None or encoded.frames >= encoded.states.shape[1]:
            return cache
        frames = encoded.frames
        for i, (keys, values) in enumerate(self.cross_kv(encoded.states[:, :frames])):
            silent_keys, silent_values = self.silence_kv[i]
            cache.cross_attention_cache.update(torch.cat([keys, silent_keys[:, :, frames:]], dim=2),
                                               torch.cat([values, silent_values[:, :, frames:]], dim=2), i)
            cache.is_updated[i] = True
        return cache

    def _next_logits(self, ids: torch.Tensor, states: torch.Tensor, cache: EncoderDecoderCache | None,
                     last: int = 0) -> torch.Tensor:
        """Next-token logits [rows, vocab] after each row of `ids`, suppressed tokens at -inf; with `last` > 0, after
        each of the one row's last `last` positions instead ([last, vocab])."""
        hidden = self.model.model.decoder(
            input_ids=ids, encoder_hidden_states=states, use_cache=cache is not None, **{CACHE_ARG: cache}
        ).last_hidden_state
        logits = self.model.proj_out(hidden[0, -last:] if last else hidden[:, -1])
        if self.suppress:
            logits[:, self.suppress] = float("-inf")
        return logits

    @torch.inference_mode()
    def hypothesis(self, audio: np.ndarray, forced: Sequence[int] = (), previous: Sequence[int] = (),
                   speech: Speech | None = None) -> list[int]:
        """Transcript ids (no prompt, no eos) of `audio`, continuing the `forced` prefix after the `previous` text,
        as `speech` asks (default the model's; a language not given is detected from `audio`): greedy, or by beam
        search with `beams` > 1."""
        encoded = self.encode(audio)
        return self.decode(encoded, forced, previous=previous, sot=self.sot_for(encoded, speech)[0])

    @torch.inference_mode()
    def decode(self, encoded: Encoded, forced: Sequence[int] = (), beams: int | None = None,
               draft: Sequence[int] = (), previous: Sequence[int] = (), sot: Sequence[int] | None = None) -> list[int]:
        """`hypothesis` from encoder states (`encode`), with `beams` instead of the decoder's own if given, after the
        start-of-transcript sequence `sot` (default: the model's speech, `sot_for`). A greedy search checks `draft` (a
        transcript of the same audio, as the causal stream's) a stretch at a time and keeps what it would have chosen
        anyway (transcript_draft.py): the same ids in fewer decoder calls."""
        beams = self.beams if beams is None else beams
        prefix = self.prefix(previous, self.sot_for(encoded)[0] if sot is None else sot)
        budget = self.budget(prefix)
        if beams == 1 or len(forced) >= budget:
            return self._drafted(encoded, forced, draft, prefix)
        rows = _BeamRows(self, encoded)
        return list(forced) + beam_search(rows, prefix + list(forced), beams=beams, eos=self.eos_id,
                                          max_tokens=budget - len(forced))

    @torch.inference_mode()
    def judge(self, encoded: Encoded, ids: Sequence[int], previous: Sequence[int] = (),
              sot: Sequence[int] | None = None) -> tuple[float, float]:
        """What Whisper says of its own transcript `ids` of `encoded` (one decoder call over prompt, ids and eos):
        the no-speech probability (`<|nocaptions|>` after `<|startoftranscript|>`, before any suppression, as
        openai-whisper reads it; 0.0 for a vocabulary without it) and the average log probability of the ids and
        the eos, suppressed tokens excluded (openai-whisper's `avg_logprob`). `sot` as `decode`'s."""
        prefix = self.prefix(previous, self.sot_for(encoded)[0] if sot is None else sot)
        sot = prefix.index(self.prompt_ids[0])
        seq = [*prefix, *ids, self.eos_id]
        states = encoded.states
        hidden = self.model.model.decoder(input_ids=torch.tensor([seq], device=states.device),
                                          encoder_hidden_states=states, use_cache=True,
                                          **{CACHE_ARG: self.cache(encoded)}).last_hidden_state[0]
        rows = [sot, *range(len(prefix) - 1, len(seq) - 1)]
        logits = self.model.proj_out(hidden[rows]).float()
        no_speech = 0.0 if self.no_speech_id is None else float(logits[0].softmax(-1)[self.no_speech_id])
        scored = logits[1:]
        if self.suppress:
            scored[:, self.suppress] = float("-inf")
        logp = scored.log_softmax(-1)
        targets = torch.tensor([*ids, self.eos_id], device=logp.device)
        return no_speech, float(logp.gather(1, targets[:, None]).mean())

    @torch.inference_mode()
    def hypothesis_uncached(self, audio: np.ndarray, forced: Sequence[int] = ()) -> list[int]:
        """The greedy search re-running the whole decoder every step: the reference the cache must match."""
        return self._uncached(self.encode(audio), forced)

    def _drafted(self, encoded: Encoded, forced: Sequence[int], draft: Sequence[int], prefix: list[int]) -> list[int]:
        """Greedy decoding after `prefix` over the KV cache, checking `draft` (transcript_draft.greedy)."""
        states, cache = encoded.states, self.cache(encoded)

        def score(ids: list[int], rows: int) -> torch.Tensor:
            return self._next_logits(torch.tensor([ids], device=states.device), states, cache, last=rows)

        return greedy(score, lambda n: cache.crop(-n), prefix, forced, eos=self.eos_id,
                      max_tokens=self.budget(prefix), draft=draft)

    def _uncached(self, encoded: Encoded, forced: Sequence[int]) -> list[int]:
        """Greedy decoding that runs the whole decoder again for every token, over all 1500 states."""
        out = list(forced)
        while len(out) < self.max_tokens:
            ids = torch.tensor([self.prompt_ids + out], device=self.model.device)
            token = int(self._next_logits(ids, encoded.states, None)[0].argmax())
            if token == self.eos_id:
                break
            out.append(token)
        return out


class _BeamRows:
    """`whisper_beam.BeamDecoder` over a `WhisperBuffered`'s decoder: one row per beam in the self-attention cache,
    reordered as beams are kept; the cross-attention K/V, the same for every beam, stay one row that every beam
    reads (`expand`, no copy)."""

    def __init__(self, whisper: WhisperBuffered, encoded: Encoded) -> None:
        self._whisper, self._states = whisper, encoded.states
        self._cache = whisper.cache(encoded)

    def _logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        states = self._states.expand(len(ids), -1, -1)
        return torch.log_softmax(self._whisper._next_logits(ids, states, self._cache).float(), dim=-1)

    def start(self, prefix: Sequence[int]) -> torch.Tensor:
        return self._logprobs(torch.tensor([list(prefix)], device=self._states.device))

    def extend(self, sources: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        device = self._states.device
        self._cache.self_attention_cache.reorder_cache(sources.to(device))
        cross = self._cache.cross_attention_cache
        for layer in cross.layers:
            layer.keys = layer.keys[:1].expand(len(sources), -1, -1, -1)
            layer.values = layer.values[:1].expand(len(sources), -1, -1, -1)
        return self._logprobs(tokens.to(device)[:, None])
