"""A language model's tokenizer, chat template and end-of-turn ids, from a checkpoint folder or a GGUF file.

A transformers checkpoint keeps them in `tokenizer.json` / `tokenizer_config.json` (a VLM's template may sit in
`chat_template.json`) and `generation_config.json`. A GGUF file keeps them in its metadata; transformers'
GGUF converter turns that into a fast tokenizer in about a second, so the result is saved once in the runtime
cache under the file's name, size and modification time and read back from there afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

from runtime.errors import CheckpointNotFound
from runtime.models.build_lock import building
from runtime.models.lm.gguf_checkpoint import gguf_file, open_gguf
from runtime.models.loading import cache_dir

EOS_FILE = "runtime-eos-ids.json"  # beside the saved tokenizer: the file's end-of-turn ids (reading them parses it)
# beside it too, where checked true: the folder read by its class alone is the saved tokenizer (`_check_reads_alone`)
ALONE_FILE = "runtime-reads-alone.json"


def _gguf_tokenizer(file: Path) -> tuple[PreTrainedTokenizerBase, list[int]]:
    """(tokenizer, end-of-turn ids) of a GGUF file, from the runtime cache when it was converted before: parsing the
    file's 151k-token vocabulary and merges again would take a second or more on every load."""
    cached = converted_folder(file)
    if cached.is_dir():
        return _read_converted(cached, file)
    with building(cached):  # processes started together: one converts, the others read what it saved
        if cached.is_dir():
            return _read_converted(cached, file)
        ckpt = open_gguf(file)
        try:
            tokenizer = _convert(file, ckpt.arch)
        except (KeyError, ValueError, TypeError) as err:  # transformers' converter on incomplete metadata
            raise CheckpointNotFound(f"lm checkpoint {file}: no usable tokenizer in the GGUF metadata "
                                     f"({type(err).__name__}: {err})") from None
        template = ckpt.field("tokenizer.chat_template")
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = str(template)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=cached.parent))
        try:
            tokenizer.save_pretrained(tmp)
            (tmp / EOS_FILE).write_text(json.dumps(ckpt.eos_ids))
            _check_reads_alone(tmp)
            try:
                os.rename(tmp, cached)
            except OSError:  # another process saved it first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer, ckpt.eos_ids


def converted_folder(file: Path) -> Path:
    """Where the tokenizer converted from GGUF `file` is kept: under the file's name, size and modification time."""
    stat = file.stat()
    return cache_dir() / "gguf-tokenizers" / f"{file.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _convert(file: Path, arch: str) -> PreTrainedTokenizerBase:
    """The tokenizer transformers converts from `file`, of the class AutoTokenizer would choose for it.

    Why not AutoTokenizer alone: to choose the class it first builds the architecture's whole model config, for
    Qwen2 and Llama files by parsing every field of the file again with gguf's reader (16 of the 17 s for Qwen2.5's
    151k-token vocabulary; the tokenizer itself converts in 1 s). The file's architecture is that model type: a type
    with a tokenizer class of its own (Qwen2) gets it, one without (Llama) the generic fast tokenizer AutoTokenizer
    falls back to (tests/test_gguf.py: both equal AutoTokenizer's)."""
    if arch in TOKENIZER_MAPPING_NAMES:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, tokenizer_type=arch)
    return PreTrainedTokenizerFast.from_pretrained(file.parent, gguf_file=file.name)


def _read_converted(cached: Path, file: Path) -> tuple[PreTrainedTokenizerBase, list[int]]:
    eos_file = cached / EOS_FILE
    if not eos_file.is_file():  # converted by an older runtime: saved now
        _write_atomic(eos_file, json.dumps(open_gguf(file).eos_ids))
    eos = list(json.loads(eos_file.read_text()))
    if not (cached / ALONE_FILE).is_file():  # saved by an older runtime: checked once now
        _check_reads_alone(cached)
    cls = _named_class(cached)
    alone = json.loads((cached / ALONE_FILE).read_text())
    if cls is not None and alone["same"]:
        tokenizer = cls.from_pretrained(cached)
        if alone["drop_normalizer"]:
            tokenizer.backend_tokenizer.normalizer = None
        return tokenizer, eos
    # the saved backend handed over whole: read from the folder alone, a class with a pre-tokenizer of its own (Qwen2's)
    # puts that in place of the file's, which a GGUF of that architecture with another pre-tokenizer does not use
    backend = Tokenizer.from_file(str(cached / "tokenizer.json"))
    return (cls or AutoTokenizer).from_pretrained(cached, tokenizer_object=backend), eos


def _named_class(folder: Path) -> type | None:
    """The class the folder names, as AutoTokenizer would choose it, but without the model config AutoTokenizer first
    resolves from the folder (about 1 s of a 2.4 s load for Qwen2.5's vocabulary on a 2 GHz core)."""
    named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    return (named and tokenizer_class_from_name(named)) or None


def _check_reads_alone(folder: Path) -> None:
    """Record whether `folder`'s class, reading the folder by itself, builds exactly the saved backend, once its
    normalizer is dropped where the saved one has none.

    Why: handing the class the saved backend (`tokenizer_object`) costs a deep copy and a second parse of the JSON,
    2.4 s a load of Qwen2.5's tokenizer on a 2 GHz core against 1.2 s read alone. Read alone, though, a class may put
    its own parts in: Qwen2's adds Unicode NFC normalization, which the GGUF's tokenizer (and llama.cpp) does not do,
    and another architecture's class might swap a pre-tokenizer. So the two are compared once, when converted
    (the backends' whole JSON), and a load reads alone only where they were equal."""
    saved = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cls = _named_class(folder)
    record = {"same": False, "drop_normalizer": False}
    if cls is not None:
        alone = cls.from_pretrained(folder)
        record["drop_normalizer"] = saved.normalizer is None and alone.backend_tokenizer.normalizer is not None
        if record["drop_normalizer"]:
            alone.backend_tokenizer.normalizer = None
        record["same"] = alone.backend_tokenizer.to_str() == saved.to_str()
    _write_atomic(folder / ALONE_FILE, json.dumps(record))


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".eos-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_tokenizer(path: Path) -> tuple[PreTrainedTokenizerBase, list[int] | None]:
    """(tokenizer with its chat template, the checkpoint's end-of-turn ids or None for the tokenizer's own)."""
    if (file := gguf_file(path)) is not None:
        tokenizer, eos = _gguf_tokenizer(file)
        return tokenizer, eos or None
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = path / "chat_template.json"  # VLM checkpoints keep the template beside the processor
    if not getattr(tokenizer, "chat_template", None) and template.is_file():
        tokenizer.chat_template = json.loads(template.read_text()).get("chat_template")
    eos = None
    if (path / "generation_config.json").is_file():
        found = GenerationConfig.from_pretrained(path).eos_token_id
        eos = None if found is None else [found] if isinstance(found, int) else list(found)
    return tokenizer, eos


def line_end_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids of the tokens that hold a newline: where a copy drafter stops (`NgramDrafter`). Read from the token
    strings (byte-level BPE writes a newline "Ċ", SentencePiece's byte fallback "<0x0A>"), 0.15 s for Qwen2.5's
    151k ids where decoding each would take 1.8 s. The same set as decoding each: tested on a small byte-level
    vocabulary (tests/test_drafters.py), and checked once on Qwen2.5's and SmolLM2's (2,178 and 129 ids)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return frozenset(i for i, p in enumerate(pieces) if p is not None and ("Ċ" in p or "\n" in p or p == "<0x0A>"))
