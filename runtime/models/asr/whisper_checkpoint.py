"""Every Whisper the runtime runs comes through here: one loader, one transcript prompt.

A reference is anything `resolve_checkpoint` takes (`builtin:whisper-tiny.en`, a hub id, a local directory,
`tiny:whisper`); a CTranslate2 directory (faster-whisper's format, and the packaged tiny.en) is converted once
into a transformers checkpoint (`whisper_ct2.py`), so the causal stream, the buffered peer, training and the
offline reference all load the same weights through `from_pretrained`.

The prompt depends on the checkpoint: English-only Whisper (`.en`, a vocabulary below 51865) was trained on
`<|startoftranscript|><|notimestamps|>` and, given a language and task token, ends the transcript at once;
multilingual Whisper takes `<|startoftranscript|><|lang|><|transcribe|><|notimestamps|>`.
"""

from __future__ import annotations

from collections.abc import Callable
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
