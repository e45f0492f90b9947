"""Function calls in the model's own chat-template format (runtime/models/lm/tool_calls.py), on the real tokenizers:
Qwen2.5-Coder's template takes tools and writes Hermes-style calls, SmolLM2's ignores them. The prompt renders the
tools in the system turn (the head the engine prefills) and the exchange of calls and outputs after the user turn;
the constraint lets the first token decide between text and a call and holds a call to the grammar; `CallText`
reads a streamed call back into its name and arguments."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_function_calling import TIME, WEATHER
from weights_common import ON_QWEN_CODER, packaged_or_skip

from runtime.errors import CheckpointNotFound
from runtime.function_tools import ToolUse, parse_tools
from runtime.models.lm.answering import PastCall
from runtime.models.lm.json_constraint import JsonGrammars
from runtime.models.lm.kv_cache import SinkKVCache
from runtime.models.lm.prompt import TOOL_RESULTS, prompt_parts, prompt_text
from runtime.models.lm.tokenizer import load_tokenizer
from runtime.models.lm.tool_calls import (
    CallText,
    ToolCallConstraint,
    ToolPrompt,
    call_grammar,
    call_starts,
    exchange_messages,
    tool_format,
)
from runtime.models.loading import resolve_checkpoint

pytestmark = ON_QWEN_CODER  # the module's `qwen` fixture converts the 0.5B's tokenizer: on the worker that builds it

TOOLS = parse_tools([WEATHER, TIME], "tools")
CALL = PastCall("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}', "18 degrees, sunny")


def checkpoint_or_skip(name: str) -> Path:
    """A builtin checkpoint (the Qwen files are joined from their part packages); locally a missing one skips, in
    CI (make install) it fails."""
    try:
        return resolve_checkpoint(f"builtin:{name}", role="lm")
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def qwen():
    tokenizer, eos = load_tokenizer(checkpoint_or_skip("qwen2.5-coder-0.5b-instruct"))
    return tokenizer, frozenset(eos)


@pytest.fixture(scope="module")
def grammars(qwen):
    pytest.importorskip("llguidance")
    tokenizer, eos = qwen
    return JsonGrammars(tokenizer, len(tokenizer), eos)


def test_the_format_is_read_from_the_template_and_smollm2s_takes_no_tools(qwen):
    tokenizer, _ = qwen
    fmt = tool_format(tokenizer)
    assert fmt is not None
    assert (fmt.opener, fmt.before, fmt.after, fmt.closer) == ("<tool_call>", "\n", "\n", "</tool_call>")
    assert tokenizer.convert_ids_to_tokens([fmt.opener_id, fmt.closer_id]) == ["<tool_call>", "</tool_call>"]
    packaged_or_skip("smollm2-135m-instruct")
    smollm2, _ = load_tokenizer(resolve_checkpoint("builtin:smollm2-135m-instruct", role="lm"))
    assert smollm2.chat_template and tool_format(smollm2) is None  # its template renders no tools


def test_the_tools_go_in_the_head_and_the_exchange_in_the_tail(qwen):
    tokenizer, _ = qwen
    tools = ToolPrompt(ToolUse(TOOLS), (CALL,)).chat_tools()
    after = exchange_messages([CALL])
    head, tail = prompt_parts(tokenizer, "Be brief.", "What's the weather?", tools, after)
    system = head[: head.index("<|im_end|>")]
    assert system.startswith(f"<|im_start|>system\nBe brief. {TOOL_RESULTS}\n\n# Tools") and "<tools>" in system
    assert json.dumps(tools[0]) in system and '"name": "get_time"' in system  # the chat-completions shape, as is
    assert head.endswith("<|im_start|>user\nTranscript so far:\n")
    assert tail == ("\n\nQuestion: What's the weather?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
                    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
                    "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    transcript = "[00:01.0] User: hi"
    assert head + transcript + tail == prompt_text(tokenizer, "Be brief.", transcript, "What's the weather?", tools,
                                                   after)
    plain_head, _ = prompt_parts(tokenizer, "Be brief.", "What's the weather?")
    assert "# Tools" not in plain_head  # no tools: the head is today's


def test_a_call_without_its_output_yet_and_a_cut_call_still_render(qwen):
    tokenizer, _ = qwen
    cut = PastCall("call_2", "get_time", '{"city": "Pa', None)
    after = exchange_messages([cut])
    assert [m["role"] for m in after] == ["assistant"]  # no output: no tool message
    _, tail = prompt_parts(tokenizer, "S", "Q", ToolPrompt(ToolUse(TOOLS)).chat_tools(), after)
    assert '{"name": "get_time", "arguments": "{\\"city\\": \\"Pa"}' in tail


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _constraint(qwen, grammars, choice: str) -> ToolCallConstraint:
    tokenizer, eos = qwen
    fmt = tool_format(tokenizer)
    prompt = ToolPrompt(ToolUse(TOOLS, choice))
    called, decided = prompt.called(), choice != "auto"
    call = grammars.lark_constraint(call_grammar(fmt, called, opener=decided)) if called else None
    return ToolCallConstraint(fmt, call, decided=decided, vocab=len(tokenizer), stop_ids=eos,
                              call_starts=_starts(qwen))


_STARTS: dict[int, torch.Tensor] = {}


def _starts(qwen) -> torch.Tensor:
    tokenizer, _ = qwen
    if id(tokenizer) not in _STARTS:
        _STARTS[id(tokenizer)] = call_starts(tokenizer, tool_format(tokenizer), len(tokenizer))
    return _STARTS[id(tokenizer)]


def _logits_for(tokenizer, favourite: dict[str, float]) -> torch.Tensor:
    logits = torch.zeros(len(tokenizer))
    for text, value in favourite.items():
        logits[_tokens(tokenizer, text)[0]] = value
    return logits


def test_auto_counts_every_call_start_for_the_opener_and_then_holds_the_call_to_the_grammar(qwen, grammars):
    tokenizer, _ = qwen
    fmt = tool_format(tokenizer)
    # '{"' beats 'Hello' alone, as the 0.5B starts its calls: the call's mass goes to the opener
    auto = _constraint(qwen, grammars, "auto")
    masked = auto.mask(_logits_for(tokenizer, {'{"': 5.0, "Hello": 5.5, "<": 4.0}))
    assert int(masked.argmax()) == fmt.opener_id
    assert masked[_tokens(tokenizer, '{"')[0]] == float("-inf")
    auto.consume(fmt.opener_id)
    call = '\n{"name": "get_time", "arguments": {"city": "Tokyo"}}\n'
    ids = [*_tokens(tokenizer, call), fmt.closer_id]
    for token in ids:
        assert not auto.finished
        row = auto.mask(torch.zeros(len(tokenizer)))
        assert row[token] == 0.0  # allowed
        auto.consume(token)
    assert auto.finished
    # the grammar holds a call to a declared name and to that tool's schema
    other = _constraint(qwen, grammars, "auto")
    other.consume(fmt.opener_id)
    wrong = _tokens(tokenizer, '\n{"name": "get_stock", "arguments": {}}')
    assert other.keep_tree([fmt.opener_id, *wrong], [-1, *range(len(wrong))], [True] * (len(wrong) + 1)) != list(
        range(len(wrong) + 1))
    extra = _tokens(tokenizer, '\n{"name": "get_weather", "arguments": {"city": "Paris", "when": 1}}')
    assert len(other.keep_tree([fmt.opener_id, *extra], [-1, *range(len(extra))], [True] * (len(extra) + 1))) < len(
        extra) + 1


def test_auto_text_when_text_wins_and_the_opener_stays_forbidden(qwen, grammars):
    tokenizer, _ = qwen
    fmt = tool_format(tokenizer)
    auto = _constraint(qwen, grammars, "auto")
    masked = auto.mask(_logits_for(tokenizer, {'{"': 5.0, "Hello": 6.0}))
    hello = _tokens(tokenizer, "Hello")[0]
    assert int(masked.argmax()) == hello
    auto.consume(hello)
    assert auto.state == "text" and not auto.finished
    later = auto.mask(_logits_for(tokenizer, {"<tool_call>": 9.0, '{"': 8.0}))
    assert later[fmt.opener_id] == float("-inf") and int(later.argmax()) == _tokens(tokenizer, '{"')[0]
    tokens = [hello, fmt.opener_id, 11, 12]  # a draft node holding the opener is dropped with its subtree
    assert auto.keep_tree(tokens, [-1, 0, 1, 0], [True] * 4) == [0, 3]


def test_forced_choices_force_the_opener_and_none_forbids_any_call_start(qwen, grammars):
    tokenizer, _ = qwen
    fmt = tool_format(tokenizer)
    favour_text = _logits_for(tokenizer, {"Hello": 9.0})
    required = _constraint(qwen, grammars, "required")
    assert int(required.mask(favour_text).argmax()) == fmt.opener_id
    named = _constraint(qwen, grammars, "function:get_time")
    named.consume(fmt.opener_id)
    named.consume(_tokens(tokenizer, "\n")[0])
    for token in _tokens(tokenizer, '{"name": "'):
        named.consume(token)
    row = named.mask(torch.zeros(len(tokenizer)))
    assert row[_tokens(tokenizer, "get")[0]] == 0.0 and row[_tokens(tokenizer, "weather")[0]] == float("-inf")
    none = _constraint(qwen, grammars, "none")
    masked = none.mask(_logits_for(tokenizer, {"<tool_call>": 9.0, '{"': 8.0, "<": 7.0, "It": 1.0}))
    assert int(masked.argmax()) == _tokens(tokenizer, "It")[0]


def test_call_text_streams_the_name_then_exactly_the_arguments(qwen):
    tokenizer, _ = qwen
    parse = CallText(tool_format(tokenizer))
    pieces = ["<tool_call>", "\n", '{"', 'name": "get_', 'weather", "arguments":', ' {"city": "Pa', 'ris \\"}{',
              '", "unit": "celsius"}', "}\n", "</tool_call>"]
    streamed = []
    for piece in pieces:
        streamed.append(parse.feed(piece))
        if piece.startswith('weather'):
            assert parse.name == "get_weather"
    assert parse.name == "get_weather" and parse.complete
    assert "".join(streamed) == parse.arguments == '{"city": "Paris \\"}{", "unit": "celsius"}'
    assert json.loads(parse.arguments) == {"city": 'Paris "}{', "unit": "celsius"}
    assert streamed[:4] == ["", "", "", ""]


def test_a_longer_head_becomes_the_sinks_in_the_same_slots():
    cache = SinkKVCache(layers=1, kv_heads=1, head_dim=2, sink=4, window=64, reserve=8, target=8)
    capacity = cache.capacity
    cache.resplit(40)
    assert (cache.sink, cache.window, cache.capacity) == (40, 28, capacity)
    cache.append_source(3)
    with pytest.raises(RuntimeError):
        cache.resplit(50)  # only with an empty source
