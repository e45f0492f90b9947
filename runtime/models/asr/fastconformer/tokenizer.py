"""The CTC vocabulary: SentencePiece-style pieces, held by a `tokenizers`-library `Tokenizer`.

NeMo's BPE ASR models ship a SentencePiece `tokenizer.model` (a protobuf `ModelProto`). The `sentencepiece`
package (and `protobuf`) are not dependencies here, and `tokenizers` cannot read that file itself, so the
few fields needed are read straight from the protobuf wire format: the pieces with their scores and types,
the model type, `byte_fallback` and `add_dummy_prefix`. From them a `tokenizers` Unigram model with a
Metaspace pre-tokenizer/decoder is built (what transformers' SentencePiece converters build too).

Decoding, the only thing CTC needs, is exact: ids -> pieces -> text ('▁' = space, byte pieces fused, control
pieces dropped). Encoding is exact for Unigram models; for a BPE-type SentencePiece model the Unigram
scores only approximate its merges, and SentencePiece's text normaliser (nmt_nfkc) is not applied: encoding
is used by tests and tools, never by recognition. An archive may instead carry a `tokenizer.json`
(tokenizers format), which is preferred when present; our own archives carry both.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# SentencePiece.Type values in sentencepiece_model.proto.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of one protobuf message: ints for varints, bytes for the rest."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated protobuf message")
        yield number, value


def _key(number: int, wire: int) -> bytes:
    return _enc_varint(number << 3 | wire)


def _enc_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _enc_varint(len(payload)) + payload


def parse_sentencepiece(data: bytes) -> dict[str, Any]:
    """The parts of a SentencePiece ModelProto that decoding needs."""
    pieces: list[tuple[str, float, int]] = []
    model_type, byte_fallback, dummy_prefix = 1, False, True
    for number, value in _fields(data):
        if number == 1:  # repeated SentencePiece pieces
            piece, score, kind = "", 0.0, NORMAL
            for n, v in _fields(value):
                if n == 1:
                    piece = v.decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            pieces.append((piece, score, kind))
        elif number == 2:  # TrainerSpec
            for n, v in _fields(value):
                if n == 3:
                    model_type = v
                elif n == 35:
                    byte_fallback = bool(v)
        elif number == 3:  # NormalizerSpec
            for n, v in _fields(value):
                if n == 3:
                    dummy_prefix = bool(v)
    if not pieces:
        raise ValueError("no pieces: not a SentencePiece model")
    return {
        "pieces": pieces,
        "model_type": MODEL_TYPES.get(model_type, str(model_type)),
        "byte_fallback": byte_fallback,
        "add_dummy_prefix": dummy_prefix,
    }


def write_sentencepiece(pieces: Sequence[tuple[str, float, int]], *, add_dummy_prefix: bool = True) -> bytes:
    """A minimal Unigram ModelProto (pieces, trainer_spec.model_type, normalizer_spec) that the real
    `sentencepiece` library and `parse_sentencepiece` both read."""
    out = bytearray()
    for piece, score, kind in pieces:
        body = _len_field(1, piece.encode("utf-8")) + _key(2, 5) + struct.pack("<f", score)
        body += _key(3, 0) + _enc_varint(kind)
        out += _len_field(1, body)
    out += _len_field(2, _key(3, 0) + _enc_varint(1))  # model_type UNIGRAM
    normalizer = _len_field(1, b"identity") + _key(3, 0) + _enc_varint(int(add_dummy_prefix))
    out += _len_field(3, normalizer)
    return bytes(out)


def _metaspace_tokenizer(model: models.Model, specials: list[str], dummy_prefix: bool) -> Tokenizer:
    scheme = "always" if dummy_prefix else "never"
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    metaspace = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), metaspace])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


class CTCTokenizer:
    """Ids <-> text for the CTC head; id i is output class i, the blank (= vocab_size) is not a token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def pieces(self) -> list[str]:
        """Each id's vocabulary entry as spelt there ('▁' marks a word start), what a beam search reads."""
        return [self.tokenizer.id_to_token(i) or "" for i in range(self.vocab_size)]

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    @classmethod
    def from_json(cls, text: str) -> CTCTokenizer:
        return cls(Tokenizer.from_str(text))

    @classmethod
    def from_sentencepiece(cls, data: bytes) -> CTCTokenizer:
        spm = parse_sentencepiece(data)
        pieces = spm["pieces"]
        unk = next((i for i, p in enumerate(pieces) if p[2] == UNKNOWN), 0)
        model = models.Unigram([(p, s) for p, s, _ in pieces], unk_id=unk, byte_fallback=spm["byte_fallback"])
        specials = [p for p, _, kind in pieces if kind in (UNKNOWN, CONTROL)]
        return cls(_metaspace_tokenizer(model, specials, spm["add_dummy_prefix"]))

    def to_sentencepiece(self) -> bytes:
        """This tokenizer as a SentencePiece model file (Unigram tokenizers only)."""
        data = json.loads(self.tokenizer.to_str())
        if data["model"]["type"] != "Unigram":
            raise ValueError(f"only Unigram tokenizers convert to SentencePiece, not {data['model']['type']}")
        specials = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
        unk = data["model"].get("unk_id")
        pieces = [
            (p, float(s), UNKNOWN if i == unk else CONTROL if i in specials else NORMAL)
            for i, (p, s) in enumerate(data["model"]["vocab"])
        ]
        return write_sentencepiece(pieces)


def train_unigram(lines: Sequence[str], vocab_size: int) -> CTCTokenizer:
    """A SentencePiece-style Unigram tokenizer trained with the `tokenizers` library (`<unk>` = id 0)."""
    tok = _metaspace_tokenizer(models.Unigram(), [], True)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(lines, trainer)
    # The trainer's EM scores vary slightly from run to run (parallel sums, ties): rescore its pieces by their
    # log relative frequency in the corpus so that equal corpora give byte-identical tokenizers (and builds).
    text = "".join("▁" + line.strip().replace(" ", "▁") for line in lines)
    vocab = [p for p, _ in json.loads(tok.to_str())["model"]["vocab"][1:]]
    total = sum(text.count(p) + 1 for p in vocab)
    scored = sorted(((p, round(math.log((text.count(p) + 1) / total), 6)) for p in vocab), key=lambda x: (-x[1], x[0]))
    pieces = [("<unk>", 0.0), *scored]
    return CTCTokenizer(_metaspace_tokenizer(models.Unigram(pieces, unk_id=0), ["<unk>"], True))
