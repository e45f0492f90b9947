"""Reading a GGUF file (llama.cpp's format) of the Llama family or Qwen2 into the engine's names.

The file is read with the `gguf` package (kept by the llama.cpp project): its metadata becomes a `ModelArgs`,
its tensors a state dict under transformers' checkpoint names, dequantised to float by `gguf.quants`. Two
facts of llama.cpp's converter are undone here: tensors are renamed (`blk.N.attn_q` ...), and for the `llama`
architecture the rows of the query and key projections are permuted (interleaved RoPE pairs); a Qwen2 file is
not permuted. A file without `output.weight` ties the head to the token embeddings.

4-bit blocks are also handed out raw (`q4_blocks`), so the int4 weight format can take the file's own integers
and scales instead of quantising the dequantised floats a second time.

The tokenizer and chat template come from the file's metadata through transformers' GGUF tokenizer converter
(`tokenizer.py`, which caches the result).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.lm.gguf_reader import fast_reader
from runtime.models.lm.weights import ModelArgs

ARCHITECTURES = ("llama", "qwen2")
# Tensor types `gguf.quants.dequantize` reads exactly; others (the IQ*, TQ*, FP4 families) are refused.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K")
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
Meta = str | int | float | bool | list[Any] | None  # a metadata value as `gguf` reads it
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` in a folder without a `config.json`."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise CheckpointNotFound(f"lm checkpoint {path} holds {len(found)} GGUF files; name one: "
                                     f"--set lm.model={found[0]}")
        return found[0] if found else None
    return None


def hf_name(name: str) -> str | None:
    """transformers' name for a GGUF tensor name; None for tensors the engine computes itself."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.match(name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a `llama` q/k projection (rows [heads * d], pairs interleaved back
    into transformers' half-split RoPE layout). Works on any tensor whose first dimension is those rows."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class Q4Blocks:
    """A 4-bit tensor's own blocks: w[n, k] = q[n, k] * scale[n, k // group] + low[n, k // group]."""

    q: torch.Tensor  # int32 [n, k] in 0..15
    scale: torch.Tensor  # float32 [n, k // group]
    low: torch.Tensor  # float32 [n, k // group]
    group: int = 32


@dataclass(frozen=True)
class Q8Blocks:
    """An 8-bit tensor's groups of 32: w[n, k] = q[n, k] * scale[n, k // 32]."""

    q: torch.Tensor  # int8 [n, k]
    scale: torch.Tensor  # float32 [n, k // 32]


def open_gguf(path: Path) -> GGUFCheckpoint:
    """The file's `GGUFCheckpoint`, parsed once per process while the file stays as it was.

    Why: the header is parsed in Python, and a vocabulary is an array of tens of thousands of strings (the 1.5B's
    header takes 0.9 s on a 2.0 GHz core, `gguf_reader`). The tokenizer's end-of-turn ids and the weights are read
    from the same file at every load; parsed once, a second load (or a test's) reads them for nothing."""
    path = Path(path).resolve()
    stat = path.stat() if path.is_file() else None
    return _open_gguf(path, None if stat is None else (stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)  # the reader memory-maps the file: a few open files cost address space only
def _open_gguf(path: Path, version: tuple[int, int] | None) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def close_gguf_files() -> None:
    """Drop the files `open_gguf` keeps open. A file read whole (a packing reads every weight) keeps its pages in
    the process's resident memory while mapped: 1.1 GB for the 1.5B's file, for the life of a server."""
    _open_gguf.cache_clear()


class GGUFCheckpoint:
    """One GGUF file: its architecture, `ModelArgs`, weights and tokenizer metadata (`open_gguf` keeps one per file)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.reader = fast_reader()(str(self.path))
        except (ValueError, OSError) as err:
            raise CheckpointNotFound(f"lm checkpoint {self.path} is not a readable GGUF file ({err})") from None
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"lm checkpoint {self.path}: GGUF architecture {self.arch!r} is not supported by the "
                              f"engine (supported: {', '.join(ARCHITECTURES)})")
        bad = sorted({t.tensor_type.name for t in self.reader.tensors} - set(TENSOR_TYPES))
        if bad:
            raise ConfigError(f"lm checkpoint {self.path}: GGUF tensor types {', '.join(bad)} are not supported "
                              f"(supported: {', '.join(TENSOR_TYPES)})")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default: Meta = None) -> Meta:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _arch(self, key: str, default: Meta = None) -> Meta:
        return self.field(f"{self.arch}.{key}", default)

    def _required(self, key: str) -> int:
        value = self._arch(key)
        if value is None:
            raise CheckpointNotFound(f"lm checkpoint {self.path}: the GGUF metadata lacks {self.arch}.{key}")
        return int(value)

    @cached_property
    def args(self) -> ModelArgs:
        heads = self._required("attention.head_count")
        hidden = self._required("embedding_length")
        vocab = self._arch("vocab_size") or len(self.field("tokenizer.ggml.tokens", []))
        scaling: dict[str, Any] = {}
        kind = self._arch("rope.scaling.type", "none")
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(self._arch("rope.scaling.factor"))}
        elif "rope_freqs.weight" in self.tensors:  # Llama 3.1's frequency factors, stored as a tensor
            factors = self.tensor("rope_freqs.weight")
            scaling = {"rope_type": "factors", "factors": [float(f) for f in factors]}
        elif kind not in ("none", None):
            raise ConfigError(f"lm checkpoint {self.path}: GGUF rope scaling {kind!r} is not supported by the "
                              "engine (supported: none, linear, llama3 frequency factors)")
        qwen = self.arch == "qwen2"
        return ModelArgs(
            model_type="qwen2" if qwen else "llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=self._required("block_count"),
            num_heads=heads,
            num_kv_heads=int(self._arch("attention.head_count_kv", heads)),
            head_dim=int(self._arch("attention.key_length", hidden // heads)),
            intermediate_size=self._required("feed_forward_length"),
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            o_bias="blk.0.attn_output.bias" in self.tensors,
            mlp_bias="blk.0.ffn_up.bias" in self.tensors,
            tie_word_embeddings="output.weight" not in self.tensors,
            max_position_embeddings=int(self._arch("context_length", 2048)),
        )

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantised to float32, in the row-major shape transformers uses ([out, in] for weights)."""
        from gguf import quants

        t = self.tensors[name]
        out = quants.dequantize(t.data, t.tensor_type)  # float32 tensors come back as views of the mapped file
        return np.array(out, dtype=np.float32, copy=not out.flags.writeable)

    def _rows_heads(self, hf: str) -> int | None:
        """Heads whose row permutation to undo for this weight, or None (only `llama` q/k are permuted)."""
        if self.arch != "llama":
            return None
        if hf.endswith("self_attn.q_proj.weight") or hf.endswith("self_attn.q_proj.bias"):
            return self.args.num_heads
        if hf.endswith("self_attn.k_proj.weight") or hf.endswith("self_attn.k_proj.bias"):
            return self.args.num_kv_heads
        return None

    def state_dict(self, dtype: torch.dtype = torch.float32,
                   skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Every weight under transformers' names, dequantised, un-permuted and cast to `dtype`; those named in
        `skip` only as meta tensors of their shape (weights the int4 format takes from their blocks instead)."""
        state: dict[str, torch.Tensor] = {}
        for name, t in self.tensors.items():
            hf = hf_name(name)
            if hf is None:
                continue
            if hf in skip:
                state[hf] = torch.empty(tuple(int(n) for n in reversed(t.shape)), dtype=dtype, device="meta")
                continue
            w = self.tensor_as(name, dtype)
            if (heads := self._rows_heads(hf)) is not None:
                w = unpermute(w, heads)
            state[hf] = w
        return state

    def tensor_as(self, name: str, dtype: torch.dtype, rows: int = 8192) -> torch.Tensor:
        """`tensor(name)` cast to `dtype`, dequantised `rows` rows at a time: a float32 copy of a whole 151,936-row
        vocabulary (0.9 GB for the 1.5B) never exists at once."""
        from gguf import quants

        t = self.tensors[name]
        data = t.data
        if data.ndim < 2 or data.shape[0] <= rows:
            return torch.from_numpy(self.tensor(name)).to(dtype)
        first = quants.dequantize(data[:1], t.tensor_type)
        out = torch.empty((data.shape[0], *first.shape[1:]), dtype=dtype)
        for start in range(0, data.shape[0], rows):
            part = quants.dequantize(data[start : start + rows], t.tensor_type)
            out[start : start + rows] = torch.from_numpy(np.asarray(part, dtype=np.float32))
        return out

    def q4_blocks(self, hf: str) -> Q4Blocks | None:
        """The 4-bit blocks of the weight transformers calls `hf`, when the file stores it as Q4_0, Q4_1 or Q4_K;
        None for any other storage. Each is a 32-value group w = q * scale + low with q in 0..15:
        - Q4_0 / Q4_1: a float16 scale [and minimum], then 16 bytes whose low nibbles are values 0..15 and high
          nibbles values 16..31 (Q4_0: w = (q - 8) * d);
        - Q4_K (llama.cpp's k-quants): a 256-value super-block of float16 d and dmin, eight 6-bit (scale, min)
          pairs, then 4 x 32 bytes whose low nibbles are group 2j and high nibbles group 2j + 1: w = d * sc * q -
          dmin * m. Groups of 32 are exactly the int4 kernel's, so the file's integers are kept as they are."""
        name = self._names.get(hf)
        if name is None or self.tensors[name].tensor_type.name not in ("Q4_0", "Q4_1", "Q4_K"):
            return None
        t = self.tensors[name]
        raw = np.asarray(t.data, dtype=np.uint8)
        rows = raw.shape[0]
        if t.tensor_type.name == "Q4_K":
            q, scale, low = _q4_k_groups(raw)
        else:
            lead = 4 if t.tensor_type.name == "Q4_1" else 2
            blocks = raw.reshape(rows, -1, lead + 16)
            scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
            # Q4_1 stores the block's minimum; Q4_0 has w = (q - 8) * d
            low = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if lead == 4 else -8.0 * scale
            nib = blocks[..., lead:]
            q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(rows, -1).astype(np.int32)
        out = [torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(low)]
        if (heads := self._rows_heads(hf)) is not None:
            out = [unpermute(x, heads) for x in out]
        return Q4Blocks(*out)

    def four_bit(self, hf: str) -> bool:
        """Whether the weight transformers calls `hf` is stored in 4-bit blocks (`q4_blocks` hands them out)."""
        name = self._names.get(hf)
        return name is not None and self.tensors[name].tensor_type.name in ("Q4_0", "Q4_1", "Q4_K")

    @cached_property  # on the instance: a method cache would keep every file it saw mapped (`close_gguf_files`)
    def _names(self) -> dict[str, str]:
        return {hf: name for name in self.tensors if (hf := hf_name(name)) is not None}

    def q8_blocks(self, hf: str) -> Q8Blocks | None:
        """The 8-bit groups of the weight transformers calls `hf`, when the file stores it as Q8_0 or Q5_0 (each
        block a float16 d, then 32 values q with w = d * q: Q8_0's int8, Q5_0's 5-bit value less 16); None for any
        other storage. The values are read back from gguf's own dequantisation (w / d is exact: a float16 times a
        small integer is exact in float32)."""
        name = self._names.get(hf)
        if name is None or self.tensors[name].tensor_type.name not in ("Q8_0", "Q5_0"):
            return None
        raw = np.asarray(self.tensors[name].data, dtype=np.uint8)
        rows = raw.shape[0]
        size = 34 if self.tensors[name].tensor_type.name == "Q8_0" else 22
        d = raw.reshape(rows, -1, size)[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        w = self.tensor(name).reshape(rows, -1, 32)
        q = np.where(d[..., None] == 0, 0, np.round(w / np.where(d == 0, 1, d)[..., None])).astype(np.int8)
        out = [torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(d)]
        if (heads := self._rows_heads(hf)) is not None:
            out = [unpermute(x, heads) for x in out]
        return Q8Blocks(*out)

    @property
    def eos_ids(self) -> list[int]:
        """End of sequence and, where the file names them, end of turn and of message (Llama 3's
        `<|eot_id|>` / `<|eom_id|>` end an instruct answer while eos is `<|end_of_text|>`)."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        return sorted({int(v) for v in (self.field(k) for k in keys) if v is not None})


def _q4_k_groups(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int32 [rows, k], scale and low float32 [rows, k // 32]) of a Q4_K tensor's rows of 144-byte
    super-blocks; the 6-bit scales and minimums unpacked by gguf's own reader (`Q4_K.get_scale_min`)."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 144)
    n = blocks.shape[1]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(rows * n, 12).copy())
    scale = (d[..., None] * sc.reshape(rows, n, 8).astype(np.float32)).reshape(rows, n * 8)
    low = -(dmin[..., None] * m.reshape(rows, n, 8).astype(np.float32)).reshape(rows, n * 8)
    qs = blocks[..., 16:].reshape(rows, n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, n * 256).astype(np.int32)
    return q, scale, low
