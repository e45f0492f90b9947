"""Every Whisper the runtime runs comes through here: one loader, one transcript prompt.

A reference is anything `resolve_checkpoint` takes (`builtin:whisper-tiny.en`, a hub id, a local directory,
`tiny:whisper`); a CTranslate2 directory (faster-whisper's format, and the packaged tiny.en) is converted once
into a transformers checkpoint (`whisper_ct2.py`), so the causal stream, the buffered peer, training and the
offline reference all load the same weights through `from_pretrained`.

The prompt depends on the checkpoint: English-only Whisper (`.en`, a vocabulary below 51865) was trained on
`<|startoftranscript|><|notimestamps|>` and, given a language and task token, ends the transcript at once;
multilingual Whisper takes `<|startoftranscript|><|lang|><|transcribe|><|notimestamps|>`.

Before that sequence a decoder may be given previous text, as Whisper was trained (`<|startofprev|> text...`):
the words of the turns before, so a stream cut at a pause goes on with the sentence it was in, and a user's
vocabulary (`previous_ids`; openai-whisper's `initial_prompt` and `condition_on_previous_text`). Whisper's budget
for it is n_ctx // 2 - 1 = 223 tokens; where there is more, the most recent are kept.

Whisper also says whether it hears speech at all: the probability of `<|nocaptions|>` (multilingual:
`<|nospeech|>`) right after `<|startoftranscript|>` (`no_speech_id`, read by the final pass's gate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase, WhisperForConditionalGeneration

from runtime.errors import ConfigError
from runtime.models.asr.whisper_ct2 import MULTILINGUAL_VOCAB, converted_checkpoint, is_ct2_whisper_dir
from runtime.models.loading import cache_dir, resolve_checkpoint, torch_dtype

Progress = Callable[[str], None]


def whisper_path(ref: str, progress: Progress | None = None) -> Path:
    """A transformers Whisper directory for `ref` (CTranslate2 directories converted into the cache once)."""
    path = resolve_checkpoint(ref, role="asr", progress=progress)
    if is_ct2_whisper_dir(path):
        return converted_checkpoint(path, cache_dir(), progress)
    return path


def load_whisper(ref: str, *, dtype: str = "float32", device: str = "cpu", progress: Progress | None = None
                 ) -> tuple[WhisperForConditionalGeneration, PreTrainedTokenizerBase, Path]:
    """Model (eval mode, on `device`), tokenizer and the directory they came from."""
    path = whisper_path(ref, progress)
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.to(torch.device(device)).eval(), tokenizer, path


def suppressed_ids(model: WhisperForConditionalGeneration) -> list[int]:
    """The tokens Whisper is decoded without (its generation config's `suppress_tokens`: symbols and the
    non-speech annotations such as "[BLANK_AUDIO]" or "(music)"), as openai-whisper and faster-whisper decode
    it by default; none when the checkpoint lists none (the tiny test models)."""
    ids = getattr(model.generation_config, "suppress_tokens", None) or []
    return sorted({int(i) for i in ids if 0 <= int(i) < model.config.vocab_size})


PROMPT_TOKENS = 223  # Whisper's previous-text budget: openai-whisper keeps the last n_ctx // 2 - 1 = 223 tokens
START_OF_PREV = "<|startofprev|>"


def previous_ids(tokenizer: PreTrainedTokenizerBase, previous: str, vocabulary: str = "",
                 limit: int = PROMPT_TOKENS) -> list[int]:
    """The previous-text tokens of a decoder prompt (without `<|startofprev|>`): `vocabulary` (the user's own words,
    the session's `audio.input.transcription.prompt`) first, kept whole up to `limit`, then the most recent tokens of
    `previous` (the text of the turns before) that fit. Each is encoded as openai-whisper encodes a prompt, after a
    space, so the tokens of a text's last words do not depend on how much of it came before."""
    return fit_previous(encoded(tokenizer, vocabulary), encoded(tokenizer, previous), limit)


def fit_previous(vocabulary: Sequence[int], recent: Sequence[int], limit: int = PROMPT_TOKENS) -> list[int]:
    """`vocabulary`'s first tokens up to `limit`, then as many of `recent`'s last tokens as fit."""
    vocab = list(vocabulary[: max(0, limit)])
    room = max(0, limit) - len(vocab)
    return vocab + (list(recent[len(recent) - room :]) if room > 0 and recent else [])


def encoded(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s tokens as a prompt's: its words after one space, no special tokens."""
    text = " ".join(text.split())
    return list(tokenizer.encode(" " + text, add_special_tokens=False)) if text else []


def prompt_prefix(tokenizer: PreTrainedTokenizerBase, sot: list[int], previous: list[int]) -> list[int]:
    """`<|startofprev|> previous... sot...` (Whisper's format: conditions on the text without asking the model to
    repeat it), or `sot` alone without previous text. A vocabulary without `<|startofprev|>` (the tiny test
    models) puts the previous tokens after `sot` as a forced prefix instead: context either way, never emitted."""
    if not previous:
        return list(sot)
    prev_id = tokenizer.get_vocab().get(START_OF_PREV)
    if prev_id is not None:
        return [prev_id, *previous, *sot]
    return [*sot, *previous]


def no_speech_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The token whose probability after `<|startoftranscript|>` is Whisper's "no speech here" (`<|nospeech|>` in
    multilingual vocabularies, `<|nocaptions|>` in English-only ones); None in a vocabulary with neither."""
    vocab = tokenizer.get_vocab()
    return vocab.get("<|nospeech|>", vocab.get("<|nocaptions|>"))


def is_multilingual(config: PretrainedConfig) -> bool:
    return int(config.vocab_size) >= MULTILINGUAL_VOCAB


def transcript_prompt(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, language: str) -> list[int]:
    """The start-of-transcript sequence this checkpoint was trained on (see the module docstring).

    Tokens the vocabulary lacks are skipped (a tiny test vocabulary has no `<|notimestamps|>`), except the
    language of a multilingual checkpoint: an unknown language is a configuration error, not a silent
    fallback to whatever the model guesses."""
    vocab = tokenizer.get_vocab()
    names = ["<|startoftranscript|>"]
    if is_multilingual(config):
        if f"<|{language}|>" not in vocab:
            raise ConfigError(f"asr.language {language!r}: the checkpoint has no <|{language}|> token")
        names += [f"<|{language}|>", "<|transcribe|>"]
    names.append("<|notimestamps|>")
    return [vocab[t] for t in names if t in vocab]
