"""gguf's `GGUFReader`, made fast at the metadata a tokenizer lives in.

Why: the reader walks every metadata value in Python, building numpy views of its memory map for each. A language
model's vocabulary is an array of tens of thousands of strings and its merges as many again (Qwen2.5's: 151,646
tokens and 151,387 merges), so parsing the 1.5B's header took 9 s of a 2.0 GHz core before any weight was read, at
the first start (packing the weights, converting the tokenizer) and in every process that reads the file's header.

Two changes, each leaving what the reader returns unchanged (`tests/test_gguf_reader.py` compares every field with
gguf's own reader, on the real files where they are installed):
- it reads through a plain ndarray view of its memory map: every slice of an `np.memmap` runs memmap's
  `__array_finalize__` in Python, 1.2 million calls for SmolLM2's vocabulary; a plain slice is made in C. The view
  shares the same mapping, so nothing is read into memory;
- an array of strings or of numbers is walked in one loop that slices the map directly (a string's length read with
  `int.from_bytes`), instead of one recursive call per element, each converting its type and making three views.
  The fields keep gguf's layout: the array's item type and length, then a length and a bytes view per string or one
  view per number, `data` indexing the values. Only a little-endian file on a little-endian machine takes this
  path; a byte-swapped file is read by gguf's own code.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np


@functools.cache
def fast_reader() -> type:
    """The reader class (built on first use: only GGUF users pay for importing gguf)."""
    from gguf import GGUFReader, GGUFValueType

    class FastReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # the one assignment of GGUFReader.__init__
            self._plain = mapped.view(np.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            if (raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little"):
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = self._get(orig_offs, np.uint32)
            length = self._get(orig_offs + 4, np.uint64)
            itype = GGUFValueType(int(item_type[0]))
            scalar = self.gguf_scalar_to_np.get(itype)
            if itype != GGUFValueType.STRING and scalar is None:  # arrays of arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            count, offs = int(length[0]), orig_offs + 12
            parts: list[Any] = [item_type, length]
            raw = self._plain
            if itype == GGUFValueType.STRING:
                view = memoryview(raw)
                for _ in range(count):
                    n = int.from_bytes(view[offs : offs + 8], "little")
                    parts.append(raw[offs : offs + 8].view(np.uint64))
                    parts.append(raw[offs + 8 : offs + 8 + n])
                    offs += 8 + n
                data = list(range(3, 3 + 2 * count, 2))
            else:
                size = np.dtype(scalar).itemsize
                values = raw[offs : offs + size * count].view(scalar)
                parts += [values[i : i + 1] for i in range(count)]
                offs += size * count
                data = list(range(2, 2 + count))
            types = [GGUFValueType.ARRAY] + ([itype] if count else [])
            return offs - orig_offs, parts, data, types

    return FastReader
