"""Constrained decoding: an answer that is exactly one JSON value valid under a JSON Schema (function calling).

Before each token is chosen, the grammar's bitmask of allowed next tokens sets every other logit to -inf; the
token is then chosen from the masked logits by the configured rule (greedy or sampled), so a small model still
produces a valid call. The library is llguidance, picked by `runtime bench grammar` on this CPU (docs/llm.md):
its per-token mask costs about 15 us (xgrammar: about 4 us), both far under 1 % of a decode step, but it compiles
a realistic schema in milliseconds where xgrammar took over a second (a `maxLength`), and it installs one 3 MB
wheel without dependencies, where xgrammar pulls triton (286 MB).

The grammar is compact JSON (no whitespace between tokens), and once the value is complete it allows nothing but
an end-of-sequence token: `finished` then ends the answer without a forward for that token.

Speculative decoding stays lossless because the verifier chooses each token from the *masked* target logits at
its node, advancing the grammar through exactly the tokens it keeps; draft nodes the grammar rejects are dropped
before the forward (checked without advancing), since the masked target could never choose them.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from runtime.errors import InvalidSchema, UserError

if TYPE_CHECKING:  # an optional dependency (the `tools` extra): imported when a schema is first asked for
    from llguidance import LLMatcher

INSTALL = "pip install 'llguidance==1.9.1'"  # also: pip install -e '.[tools]'
MAX_ROLLBACK = 64


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """bool[vocab] from a bitmask of int32 words, bit j of word i = token 32 i + j (the libraries' layout)."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab].view(bool)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The token ids a bitmask allows (tests and the bench)."""
    return torch.from_numpy(np.flatnonzero(unpack_bitmask(bitmask, vocab)))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 CPU copy of `logits` [vocab] (into `out` when given) with every token the bitmask forbids at
    -inf, in one vectorised pass (unpack the bits, masked copy). Pass `out` on every token: a fresh 200 kB buffer
    costs page faults that measured 0.4 to 7 ms a token here, the masking itself about 30 us."""
    logits = logits.detach().reshape(-1)
    if out is None:
        out = logits.to(device="cpu", dtype=torch.float32, copy=True)
    else:
        out.copy_(logits)
    np.copyto(out.numpy(), np.float32(-np.inf), where=~unpack_bitmask(bitmask, out.shape[0]))
    return out


def _llguidance() -> ModuleType:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise UserError(f"a JSON schema (function calling on the local engine) needs llguidance: {INSTALL}") from None
    return llguidance


class JsonGrammars:
    """Compiles schemas for one tokenizer: the library's view of the vocabulary is built once (about 0.5 s) and
    each schema's matcher is kept (by its canonical JSON), so a session's repeated calls compile nothing."""

    cache_size = 64

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab: int, stop_ids: Collection[int]) -> None:
        self.vocab = vocab
        self.stop_ids = frozenset(stop_ids)
        self.stop = min(self.stop_ids)  # the id a finished value ends with (any stop id ends it the same way)
        self._lib = _llguidance()
        self._tokenizer = self._lib.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=sorted(self.stop_ids))
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    def constraint(self, schema: dict[str, Any]) -> JsonConstraint:
        """A fresh matcher for one answer; an invalid schema is one UserError naming what is wrong."""
        if not isinstance(schema, dict):
            raise InvalidSchema(f"a JSON schema must be an object, not {type(schema).__name__}")
        return self._constraint(json.dumps(schema, sort_keys=True), lambda lib: lib.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}))

    def lark_constraint(self, grammar: str) -> JsonConstraint:
        """A fresh matcher for a Lark grammar (llguidance's dialect: `%json {...}` embeds a schema, `<[id]>` is a
        token): a function call in the model's own format (`tool_calls.call_grammar`)."""
        return self._constraint("lark:" + grammar, lambda lib: lib.LLMatcher.grammar_from_lark(grammar))

    def _constraint(self, key: str, compile_grammar: Callable[[ModuleType], str]) -> JsonConstraint:
        pristine = self._compiled.pop(key, None)
        if pristine is None:
            lib = self._lib
            pristine = lib.LLMatcher(self._tokenizer, compile_grammar(lib), log_level=0)
            if pristine.is_error():
                raise InvalidSchema(f"unusable JSON schema: {pristine.get_error().splitlines()[0]}")
        self._compiled[key] = pristine
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return JsonConstraint(pristine.deep_copy(), self.vocab, self.stop_ids, self.stop)


class JsonConstraint:
    """One answer's grammar state: what the tokens chosen so far allow next."""

    def __init__(self, matcher: LLMatcher, vocab: int, stop_ids: frozenset[int], stop: int) -> None:
        self._matcher = matcher
        self.vocab, self.stop_ids, self.stop = vocab, stop_ids, stop
        self._bitmask = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)
        self._masked = torch.empty(vocab, dtype=torch.float32)  # reused by every `mask` (see `apply_bitmask`)
        self._fresh = False  # whether `_bitmask` is the current state's
        self.spent_s = 0.0  # wall seconds in the grammar (masks, consumes, draft checks): its share of decoding

    def _fill(self) -> torch.Tensor:
        if not self._fresh:
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
            self._check()
            self._fresh = True
        return self._bitmask

    def _check(self) -> None:
        if self._matcher.is_error():  # a token the mask forbade was consumed: a bug, never the model's doing
            raise RuntimeError(f"JSON constraint: {self._matcher.get_error()}")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] for the next token with what the grammar forbids at -inf: a float32 CPU copy, valid
        until the next call (one buffer is reused; callers choose a token from it at once)."""
        t = time.perf_counter()
        out = apply_bitmask(logits, self._fill(), self._masked)
        self.spent_s += time.perf_counter() - t
        return out

    def allowed(self) -> torch.Tensor:
        """The current bitmask (int32 words; tests)."""
        return self._fill().clone()

    def consume(self, token: int) -> None:
        """Advance past a chosen token (chosen under the mask, so the grammar accepts it)."""
        t = time.perf_counter()
        self._matcher.consume_token(token)
        self._check()
        self._fresh = False
        self.spent_s += time.perf_counter() - t

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` consumed tokens."""
        if tokens:
            self._matcher.rollback(tokens)
            self._check()
            self._fresh = False

    @property
    def finished(self) -> bool:
        """The value is complete and nothing may follow but the end of the answer."""
        return bool(self._matcher.is_stopped())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar would accept in order from here (nothing is consumed)."""
        return int(self._matcher.validate_tokens(list(tokens))) if tokens else 0

    def keep_tree(self, tokens: Sequence[int], parents: Sequence[int], removable: Sequence[bool]) -> list[int]:
        """Which nodes of a draft tree to score: node 0 is the pending token (consumed already); a node whose
        path from the root the grammar rejects is dropped when `removable` (its subtree with it)."""
        t = time.perf_counter()
        keep, path = [0], {0: ()}
        for i in range(1, len(tokens)):
            parent = parents[i]
            if parent not in path:
                continue
            nodes = (*path[parent], i)
            if removable[i] and self.valid_prefix([tokens[n] for n in nodes]) < len(nodes):
                continue
            path[i] = nodes
            keep.append(i)
        self.spent_s += time.perf_counter() - t
        return keep
