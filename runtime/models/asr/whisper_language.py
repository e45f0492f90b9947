"""What a Whisper stream is asked to hear and write: the spoken language and the task (`Speech`).

Why a module of its own: multilingual Whisper (base) was trained on `<|startoftranscript|><|lang|><|task|>`, where
`<|lang|>` is the language spoken and `<|task|>` is `<|transcribe|>` (captions in that language) or `<|translate|>`
(captions in English). The language can be given (the profile's `asr.language`, a session's
`audio.input.transcription.language`) or left to Whisper itself: its language identification is the decoder's
distribution over the language tokens right after `<|startoftranscript|>`, read over the encoder states of the first
30 s window (openai-whisper's `detect_language`, faster-whisper's `detect_language`): one decoder step.

English-only Whisper (tiny.en) has no language or task tokens (given them it ends the transcript at once), so it
can only transcribe English: asking it for another language or for translation is a configuration error here,
never a silent English transcript of German speech.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from runtime.errors import ConfigError
from runtime.models.asr.base import DETECT, Speech, check_task

__all__ = ["DETECT", "Speech", "check_english_only", "check_task", "detected", "language_ids", "speech_prompt"]

_CODE = re.compile(r"[a-z]{2,3}")  # Whisper's language codes: ISO 639-1, and "haw", "yue"


def language_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Language code -> its token id, for every `<|xx|>` language token of the vocabulary ({} in English-only
    vocabularies)."""
    vocab = tokenizer.get_vocab()
    sot = vocab.get("<|startoftranscript|>")
    if sot is None or "<|translate|>" not in vocab:
        return {}
    # the language tokens are the ones right after <|startoftranscript|>, up to the task tokens (openai-whisper)
    names = {i: t for t, i in vocab.items() if sot < i < vocab["<|translate|>"]}
    return {names[i][2:-2]: i for i in sorted(names) if _CODE.fullmatch(names[i][2:-2] or "")}


def speech_prompt(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, speech: Speech,
                  name: str = "asr.model") -> list[int]:
    """The start-of-transcript sequence for `speech` with its language known (see the module docstring); for an
    English-only checkpoint `<|startoftranscript|><|notimestamps|>`, and an error for any other language or for
    translation. Tokens a tiny test vocabulary lacks are skipped, as `transcript_prompt` does."""
    from runtime.models.asr.whisper_checkpoint import is_multilingual

    check_task(speech.task)
    vocab = tokenizer.get_vocab()
    names = ["<|startoftranscript|>"]
    if is_multilingual(config):
        if not speech.language or f"<|{speech.language}|>" not in vocab:
            raise ConfigError(f"language {speech.language!r}: {name} has no <|{speech.language}|> token "
                              f"(known: {', '.join(sorted(language_ids(tokenizer))) or 'none'})")
        names += [f"<|{speech.language}|>", f"<|{speech.task}|>"]
    else:
        check_english_only(speech, name)
    names.append("<|notimestamps|>")
    return [vocab[t] for t in names if t in vocab]


def check_english_only(speech: Speech, name: str) -> None:
    """An English-only Whisper hears English and writes English: anything else asked of it is refused."""
    check_task(speech.task)
    if speech.language not in (DETECT, "en"):
        raise ConfigError(f"{name} is English-only: it cannot transcribe language {speech.language!r} "
                          "(use a multilingual model: --profile whisper-base)")
    if speech.task != "transcribe":
        raise ConfigError(f"{name} is English-only: it cannot translate (use a multilingual model: --profile "
                          "whisper-base)")


def detected(logits: torch.Tensor, languages: dict[str, int]) -> tuple[str, float]:
    """(the most probable language, its probability among the language tokens) from the decoder's logits [vocab]
    after `<|startoftranscript|>`."""
    codes: Sequence[str] = list(languages)
    probs = logits.float()[[languages[c] for c in codes]].softmax(-1)
    best = int(probs.argmax())
    return codes[best], float(probs[best])
