"""Function calls in the model's own format: the chat template's tools, its call opener, and a grammar for the call.

A model trained for tool use (Qwen2.5's "Hermes" format) reads the tools where its chat template writes them (in
the system turn: `# Tools ... <tools>...</tools>`) and calls by answering
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; a call's output comes back as a `tool` message
(`<tool_response>...</tool_response>`). Prompting it in any other format asks it to do something it was not
taught, so when the template takes tools (`tool_format` checks by rendering, not by the model's name) the local
engine prompts and decodes in this format:

- `auto`: the model decides with its first token. If it is the opener, the rest is decoded under a grammar: a JSON
  object {"name": one of the tools, "arguments": that tool's schema}, then the closer, then the end of the answer;
  otherwise the answer is text, and the opener stays forbidden (a call in the middle of text would be neither).
- `required`: the opener is forced, the model picks the name under the same grammar; a named function: the name
  is forced too (a grammar with that tool alone).
- `none`: the tools stay in the prompt and the opener is forbidden, so the prompt's head, prefilled with the
  session's tools, is kept (a new head re-prefills the whole context) and the model still knows the functions
  whose outputs the exchange holds.

`ToolCallConstraint` has `json_constraint.JsonConstraint`'s interface, so speculative decoding stays lossless under
it; `CallText` turns the call's streamed text into its name and argument pieces. A template without tools
(SmolLM2's) keeps the runtime's own prompt (`function_tools.tools_prompt`) and forced calls only.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from runtime.function_tools import FunctionTool, ToolUse, chat_tools
from runtime.models.lm.answering import PastCall
from runtime.models.lm.json_constraint import JsonConstraint
from runtime.models.lm.prompt import has_chat_template

_PROBE = {"type": "function", "function": {"name": "runtime_probe_fn", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
_PROBE_CALL = '{"name": "runtime_probe_fn", "arguments": {"x": "y"}}'  # how the Hermes format writes a call
_CLOSER = re.compile(r"(\s*)(</[^<>\s]+>)")
# JSON as `tojson` writes it (the template's own calls), so a call reads like the ones the model was taught
SEPARATORS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class ToolFormat:
    """How a template writes a call: opener, text before the call's JSON, text after it, closer; the opener's id."""

    opener: str
    before: str
    after: str
    closer: str
    opener_id: int
    closer_id: int | None  # None: the closer is several tokens


def tool_format(tokenizer: PreTrainedTokenizerBase) -> ToolFormat | None:
    """The template's call format, or None when its template ignores tools or writes calls some other way.

    Checked by rendering: the probe tool must appear in the prompt, and a probe call, rendered as an assistant
    message with `tool_calls`, must read opener + {"name": ..., "arguments": ...} + closer, the opener one token."""
    if not has_chat_template(tokenizer):
        return None
    try:
        asked = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        offered = tokenizer.apply_chat_template(asked, tools=[_PROBE], tokenize=False, add_generation_prompt=True)
        called = tokenizer.apply_chat_template(
            [*asked, {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "id": "call_1", "function": {"name": "runtime_probe_fn", "arguments": {"x": "y"}}}
            ]}], tools=[_PROBE], tokenize=False)
    except Exception:  # a template that fails on tools or tool_calls does not take them
        return None
    if "runtime_probe_fn" not in offered or not called.startswith(offered) or _PROBE_CALL not in called:
        return None
    written = called[len(offered):]
    at = written.index(_PROBE_CALL)
    opener = written[:at].strip()
    before = written[written.index(opener) + len(opener):at] if opener else ""
    closing = _CLOSER.match(written, at + len(_PROBE_CALL))
    if not opener or closing is None:
        return None
    opener_ids = tokenizer.encode(opener, add_special_tokens=False)
    closer_ids = tokenizer.encode(closing.group(2), add_special_tokens=False)
    if len(opener_ids) != 1:
        return None  # the model could not decide with one token
    return ToolFormat(opener, before, closing.group(1), closing.group(2), opener_ids[0],
                      closer_ids[0] if len(closer_ids) == 1 else None)


def call_starts(tokenizer: PreTrainedTokenizerBase, fmt: ToolFormat, vocab: int) -> torch.Tensor:
    """bool [vocab]: the tokens an answer can start a call with (after leading spaces): the opener, a piece of it,
    or an opening brace (`ToolCallConstraint` says why). Only the tokens whose piece holds the brace or the opener's
    first character are decoded (decoding a 150k vocabulary took tens of seconds here)."""
    starts = torch.zeros(vocab, dtype=torch.bool)
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(tokenizer)))))
    marks = ("{", fmt.opener[0])
    candidates = [i for i, piece in enumerate(pieces) if piece and any(m in piece for m in marks)]
    for i, text in zip(candidates, tokenizer.batch_decode([[i] for i in candidates]), strict=True):
        text = text.lstrip()
        if text and (text.startswith("{") or fmt.opener.startswith(text)):
            starts[i] = True
    starts[fmt.opener_id] = True
    return starts


def exchange_messages(calls: Sequence[PastCall]) -> list[dict[str, Any]]:
    """The calls being continued as chat messages: one assistant message with `tool_calls` (arguments as objects:
    the template writes them with `tojson`), then a `tool` message per output the client sent."""
    if not calls:
        return []
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": c.call_id, "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
        for c in calls]}]
    messages += [{"role": "tool", "tool_call_id": c.call_id, "content": c.output} for c in calls
                 if c.output is not None]
    return messages


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a call cut short by the token budget: shown as it was written
        return text


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    """{"name": the tool's name, "arguments": its schema}, name first, with the schema's definitions lifted to the
    top so its `#/$defs/...` references still resolve."""
    arguments = dict(tool.schema())
    lifted = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, **lifted, "x-guidance": SEPARATORS}


def call_grammar(fmt: ToolFormat, tools: Sequence[FunctionTool], *, opener: bool) -> str:
    """The Lark grammar (llguidance) of one call among `tools`: [opener] before {"name", "arguments"} after closer."""
    parts = [f"<[{fmt.opener_id}]>"] if opener else []
    if fmt.before:
        parts.append(json.dumps(fmt.before))
    parts.append("(" + " | ".join(f"call{i}" for i in range(len(tools))) + ")")
    if fmt.after:
        parts.append(json.dumps(fmt.after))
    parts.append(f"<[{fmt.closer_id}]>" if fmt.closer_id is not None else json.dumps(fmt.closer))
    rules = [f"call{i}: %json {json.dumps(_call_schema(tool))}" for i, tool in enumerate(tools)]
    return "\n".join([f"start: {' '.join(parts)}", *rules]) + "\n"


@dataclass(frozen=True)
class ToolPrompt:
    """What an answer on a tool-taking template gets: the tools (and choice) and the exchange it continues."""

    use: ToolUse
    calls: tuple[PastCall, ...] = ()

    def chat_tools(self) -> list[dict[str, Any]]:
        return chat_tools(self.use)

    def called(self) -> list[FunctionTool]:
        """The tools a call may name under the choice (none under `none`)."""
        if self.use.choice == "none":
            return []
        forced = self.use.choice.removeprefix("function:") if self.use.choice.startswith("function:") else None
        return [self.use.tool(forced)] if forced else list(self.use.tools)


class ToolCallConstraint:
    """One answer's choice between text and a call (the interface of `JsonConstraint`, which the decoder takes).

    States: `undecided` (auto, before the first token), `call` (the call's grammar decides every token), `text`
    (free, but the opener is forbidden, and at the first token every call start).

    The first token decides by the mass of every token that starts a call (`call_starts`: the opener, a piece of
    it, or an opening brace), moved onto the opener: these models start their calls with `{"` (Qwen2.5-Coder-0.5B)
    or `{{` (the 1.5B, whose GGUF template shows that in its example) and give the opener itself almost nothing,
    so the opener alone would never win. A sampled first token keeps the distribution over text and call."""

    def __init__(self, fmt: ToolFormat, call: JsonConstraint | None, *, decided: bool, vocab: int,
                 stop_ids: Collection[int], call_starts: torch.Tensor) -> None:
        self.fmt, self._call, self.vocab = fmt, call, vocab
        self._starts = call_starts  # bool [vocab]
        self._first = True
        self.stop_ids = frozenset(stop_ids)
        self.stop = call.stop if call is not None else min(self.stop_ids)
        self.state = "call" if decided and call is not None else "text" if call is None else "undecided"
        self._masked = torch.empty(vocab, dtype=torch.float32)
        self._own_s = 0.0

    @property
    def spent_s(self) -> float:
        return self._own_s + (self._call.spent_s if self._call is not None else 0.0)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.state == "call":
            assert self._call is not None
            return self._call.mask(logits)
        t = time.perf_counter()
        out = self._masked
        out.copy_(logits.detach().reshape(-1)[: self.vocab])
        if self.state == "undecided":
            call = torch.logsumexp(out[self._starts], 0)
            out[self._starts] = float("-inf")
            out[self.fmt.opener_id] = call
        else:  # text: no call, and at the first token nothing that starts one (`none`)
            if self._first:
                out[self._starts] = float("-inf")
            out[self.fmt.opener_id] = float("-inf")
        self._own_s += time.perf_counter() - t
        return out

    def consume(self, token: int) -> None:
        self._first = False
        if self.state == "undecided":
            self.state = "call" if token == self.fmt.opener_id else "text"
        elif self.state == "call":
            assert self._call is not None
            self._call.consume(token)

    @property
    def finished(self) -> bool:
        return self.state == "call" and self._call is not None and self._call.finished

    def keep_tree(self, tokens: Sequence[int], parents: Sequence[int], removable: Sequence[bool]) -> list[int]:
        """Which draft nodes to score (node 0, the pending token, is consumed already): the call's grammar
        decides in a call; in text a node holding the opener is dropped with its subtree."""
        if self.state == "call":
            assert self._call is not None
            return self._call.keep_tree(tokens, parents, removable)
        keep, kept = [0], {0}
        for i in range(1, len(tokens)):
            if parents[i] in kept and not (removable[i] and tokens[i] == self.fmt.opener_id):
                kept.add(i)
                keep.append(i)
        return keep


class CallText:
    """A call's text as it streams (opener, {"name": ..., "arguments": {...}}, closer) turned into its name and the
    arguments' JSON, piece by piece: the decoder's grammar wrote it, so a scan of braces and strings finds its end."""

    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.name: str | None = None
        self.arguments = ""
        self.complete = False  # the arguments' object has closed
        self._at = 0  # next character of `text` to scan
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, delta: str) -> str:
        """Take the next text; returns the arguments' new text (`name` is set once it is known)."""
        self.text += delta
        if self.name is None:
            start = self.text.find(self.fmt.opener)
            found = self._HEAD.match(self.text, start + len(self.fmt.opener)) if start >= 0 else None
            if found is None:
                return ""
            self.name, self._at = json.loads(f'"{found.group(1)}"'), found.end()
        piece = []
        while self._at < len(self.text) and not self.complete:
            c = self.text[self._at]
            self._at += 1
            if self._depth == 0 and c.isspace():
                continue
            piece.append(c)
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (c == "\\", c != '"')
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                self.complete = self._depth == 0
        new = "".join(piece)
        self.arguments += new
        return new
