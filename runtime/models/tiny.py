"""Tiny random models built from configs, for tests and for the `tiny` profile.

They have the real architectures (Whisper, Qwen2) at toy sizes, so every code path that loads, caches and
decodes a real checkpoint runs on CPU in milliseconds. Their weights are random: what they say is noise,
and no accuracy number may ever be reported from them. Builds are seeded and deterministic, so two builds
with the same seed are byte-identical and `loading.resolve_checkpoint` can cache them under a content hash.
Tokenizers are trained here with the `tokenizers` library because a Whisper/Qwen tokenizer constructed
without its files is silently empty.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config

from runtime.errors import ConfigError

# The model classes are imported by the builders that use them: importing any of transformers' modelling modules
# costs about 3.6 s (torch's distributed and compiler packages come with it), and every process that resolves a
# checkpoint imports this module (loading.py), most of them never building a tiny model.

# Bump when a builder changes in a way the content hash would not see (it hashes this file's source too).
TINY_VERSION = 1
VOCAB_SIZE = 1000

WHISPER_SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML as Qwen2.5-Instruct writes it, including its default system message.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
Good morning, everyone. Today we are going to talk about how speech becomes text in real time.
A streaming model listens to short chunks of audio and writes down what it hears as soon as it can.
When the speaker pauses, the transcript settles and the next sentence begins on a new line.
She said that the meeting would start at nine o'clock, but nobody arrived before half past nine.
Can you tell me what the weather will be like tomorrow afternoon in the north of the country?
It will be cloudy in the morning, with some rain later in the day and a cold wind from the sea.
The camera shows a kitchen table with two cups of coffee, an open laptop and a pile of letters.
He picked up the red book, turned a few pages and started reading the first chapter aloud.
What did the speaker say about the budget for next year, and who is responsible for it?
The answer is that the budget will grow by ten percent, and the finance team will manage it.
Please remember to turn off the lights, close the door and take your keys when you leave the house.
Numbers such as one, two, three, four, five, six, seven, eight, nine and ten are easy to say.
The train to the city leaves every twenty minutes from the station near the old market square.
Questions are welcome at any time; just raise your hand or type them into the chat window.
Music was playing softly in the background while the children were building a castle of sand.
A good assistant answers briefly, quotes what was said when it helps, and admits what it does not know.
The doctor asked the patient how long the pain had lasted and whether it was getting any better.
Our team has finished the first version of the product and will show it to customers next week.
Listen carefully: the last word of this sentence is the most important one, and that word is river.
They walked along the river, talked about their plans for the summer and watched the boats go by.
Water boils at one hundred degrees, but at the top of a high mountain it boils at a lower temperature.
If you have any problems with the software, restart it first and then call the help desk.
The history of writing begins with small marks on clay, long before paper and printed books.
Seventeen people joined the call from London, Paris, Berlin, Madrid, Rome and Amsterdam yesterday.
The engineer explained why the bridge was closed: heavy traffic, strong winds and urgent repairs.
Please write your name, your address, your phone number and the date of your birthday below.
The garden behind the school is full of flowers, vegetables, small trees and very busy bees.
Our favourite restaurant serves fresh bread, grilled fish, green salad and chocolate cake.
In the afternoon the museum was quiet, so we looked at every painting and sculpture twice.
Thank you very much for listening, and I hope to see all of you again at the next meeting.
"""


def train_tokenizer(special_tokens: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """ByteLevel BPE (the GPT-2/Whisper/Qwen scheme) trained on CORPUS; any byte string round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    return tok


def _wrap(tok: Tokenizer, special: list[str], eos: str, max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token=eos,
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        extra_special_tokens=[t for t in special if t not in ("<|endoftext|>", eos)],
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
    )


def build_whisper(out_dir: Path, seed: int) -> None:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tokenizer = _wrap(train_tokenizer(WHISPER_SPECIAL), WHISPER_SPECIAL, "<|endoftext|>", 128)
    ids = tokenizer.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=128,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        init_std=0.3,  # large random weights: varied, audio-dependent output exercises more code paths
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        alignment_heads=[[1, 0], [1, 1]],  # any heads: what the token-timing code reads, not what they learned
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    WhisperFeatureExtractor().save_pretrained(out_dir)


def _chat_tokenizer(extra: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    special = [*CHAT_SPECIAL, *extra]
    tokenizer = _wrap(train_tokenizer(special), special, "<|im_end|>", 4096)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _qwen2_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    ids = tokenizer.convert_tokens_to_ids
    eot, im_end = ids("<|endoftext|>"), ids("<|im_end|>")
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        initializer_range=0.3,  # large random weights: varied text (incl. partial UTF-8) exercises more
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
    )


def _generation_config(config: Qwen2Config) -> GenerationConfig:
    eot, im_end = config.bos_token_id, config.eos_token_id
    return GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=False)


def build_qwen2(out_dir: Path, seed: int) -> None:
    from transformers import Qwen2ForCausalLM

    tokenizer = _chat_tokenizer()
    config = _qwen2_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = _generation_config(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def build_llava_onevision(out_dir: Path, seed: int) -> None:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, SiglipVisionConfig

    """LLaVA-OneVision at toy size: a SigLIP tower over 64x64 frames (8x8 patches) and the tiny Qwen2."""
    tokenizer = _chat_tokenizer(("<image>", "<video>"))
    text = _qwen2_config(tokenizer)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=64, patch_size=8, vision_use_head=False)
    ids = tokenizer.convert_tokens_to_ids
    config = LlavaOnevisionConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                  image_token_index=ids("<image>"), video_token_index=ids("<video>"),
                                  tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config)
    model.generation_config = _generation_config(text)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    preprocessor = {"size": {"height": 64, "width": 64}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                    "rescale_factor": 1 / 255, "do_resize": True}
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))


def build_fastconformer(out_dir: Path, seed: int) -> None:
    """A tiny cache-aware FastConformer-CTC written as a `.nemo` archive, so it loads like NVIDIA's."""
    from runtime.models.asr.fastconformer.tiny import build_tiny_fastconformer  # lazy: it imports loading

    build_tiny_fastconformer(out_dir, seed)


TINY_MODELS: dict[str, Callable[[Path, int], None]] = {
    "whisper": build_whisper,
    "qwen2": build_qwen2,
    "llava-onevision": build_llava_onevision,
    "fastconformer": build_fastconformer,
}
# Code outside this file that shapes a tiny build; its source is part of the build's cache key.
TINY_SOURCES: dict[str, tuple[str, ...]] = {
    "fastconformer": tuple(f"runtime.models.asr.fastconformer.{m}" for m in ("tiny", "model", "nemo", "tokenizer",
                                                                                "features")),
}


def build_tiny(name: str, out_dir: Path, seed: int = 0) -> None:
    """Write tiny model `name` (weights, tokenizer, extras) into `out_dir`, which is created if needed."""
    builder = TINY_MODELS.get(name)
    if builder is None:
        raise ConfigError(f"unknown tiny model {name!r} (known: {', '.join(sorted(TINY_MODELS))})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    builder(out_dir, seed)
