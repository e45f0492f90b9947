"""Every prompt text the language model reads, and every use of the tokenizer's chat template.

An answer's prompt frames the transcript and the question in the user turn, after the system prompt:

    <system prompt> <"Transcript so far:\\n"> <transcript> <"\\n\\nQuestion: ..."> <assistant header>

`prompt_text` writes it whole (the generate answerer prefills it at question time); `prompt_parts` cuts the
same text in two where the transcript goes, so the engine can prefill the head and the transcript as they
stream in and add the tail at question time: head + transcript + tail == prompt_text, exactly (tested).
A base model without a chat template gets the same parts in plain text, ending in "Answer:". With function
tools, a template that takes them (`tool_calls.tool_format`) renders them and the exchange being continued.

The video memory's labels (`MEMORY_INTRO`, `HEADINGS`; `runtime.models.vlm.prompt` builds the pieces) and the
question a segment note answers (`NOTE_QUESTION`) are prompt text too, so they live here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

CUT_MARK = "... "  # prefixed to a context that was cut from the front
EMPTY_CONTEXT = "(nothing yet)"  # the transcript before anything was heard
NOTE_QUESTION = "In one short sentence, what happens in these video frames?"  # a closed video segment's note
# what an answer after `idle_timeout_ms` of silence answers
IDLE_QUESTION = "(The user has said nothing for a while.) In one short sentence, invite them to go on."
MEMORY_INTRO = "\n\nVideo memory (times are m:ss of the stream):"  # opens the video-memory suffix
HEADINGS = {  # one per kind of memory block, before the first block of that kind
    "temporal": "\nEarlier (consolidated):",
    "abstract": "\nOverview:",
    "retrieved": "\nMoments:",
    "spatial": "\nNow:",
}
# Said after the system prompt when functions are offered: a profile's prompt limits answers to what the transcript
# and the screen say ("... reply: Not known yet"), and a function's output is neither, so without it the 0.5B answered
# "Not known yet." with the output right before it.
TOOL_RESULTS = "The functions' results (tool responses) are facts you can answer from too."
_MARK = "<<runtime:context>>"  # where the transcript goes, while the prompt is cut in two

Content = Callable[[str], str | list[dict[str, str]]]  # a message's text as the template wants it
Tools = list[dict[str, Any]] | None  # functions in chat-completions' shape ({"type": "function", "function": ...})
Messages = Sequence[dict[str, Any]]  # chat messages after the user turn (`tool_calls.exchange_messages`)
# How the prompt starts its lines: the context's (a timestamp, "[00:42.0] ...", conversation.py) and the question's
# (`user_turn`). An answer that starts a line so is writing the conversation on, not answering (AnswerText).
_FRAMING = re.compile(r"\n(?:\[\d+:\d|Question:|Transcript so far:)")
_STAMP_START = re.compile(r"\[\d*:?")  # what a timestamp's line can start as before it is one
_FRAMING_WORDS = ("Question:", "Transcript so far:")


def framing_line(text: str) -> int | None:
    """Where in an answer's `text` a line starts as the prompt frames its lines (the newline's index), if any."""
    found = _FRAMING.search(text)
    return None if found is None else found.start()


def may_become_framing(text: str) -> bool:
    """Whether `text`'s last line (after its last newline) could still grow into a framing line."""
    if "\n" not in text:
        return False
    last = text[text.rindex("\n") + 1 :]
    return (last == "" or _STAMP_START.fullmatch(last) is not None
            or any(word.startswith(last) for word in _FRAMING_WORDS))


def plain_content(text: str) -> str:
    """Message content as a plain string (text chat models)."""
    return text


def typed_content(text: str) -> list[dict[str, str]]:
    """Message content as typed parts (VLM templates such as LLaVA's)."""
    return [{"type": "text", "text": text}]


def user_turn(context: str, question: str) -> str:
    return f"Transcript so far:\n{context}\n\nQuestion: {question}"


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer: PreTrainedTokenizerBase, system_prompt: str, user: str,
              content: Content = plain_content, tools: Tools = None, after: Messages = ()) -> str:
    """The chat template applied to a system and a user message, ending with the assistant's header. `tools`
    (chat-completions shape) and `after` (the exchange being continued: an assistant message with `tool_calls`,
    then `tool` messages) go to the template as they are: where and how it writes them is the model's format."""
    if tools:
        system_prompt = f"{system_prompt} {TOOL_RESULTS}"
    messages = [{"role": "system", "content": content(system_prompt)}, {"role": "user", "content": content(user)},
                *after]
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)


def plain_text(system_prompt: str, user: str) -> str:
    """The prompt of a base model without a chat template."""
    return f"{system_prompt}\n\n{user}\nAnswer:"


def prompt_text(tokenizer: PreTrainedTokenizerBase, system_prompt: str, context: str, question: str,
                tools: Tools = None, after: Messages = ()) -> str:
    """The whole prompt for answering `question` about `context` (empty: `EMPTY_CONTEXT`); `tools` and `after`
    reach a chat template only (`chat_text`)."""
    user = user_turn(context or EMPTY_CONTEXT, question)
    if has_chat_template(tokenizer):
        return chat_text(tokenizer, system_prompt, user, tools=tools, after=after)
    return plain_text(system_prompt, user)


def prompt_parts(tokenizer: PreTrainedTokenizerBase, system_prompt: str, question: str, tools: Tools = None,
                 after: Messages = ()) -> tuple[str, str]:
    """(head, tail): head + transcript + tail is exactly `prompt_text(..., transcript, question, tools, after)`
    for a non-empty transcript. A template that writes the tools into its system turn (Qwen's) puts them in the
    head, the exchange after the user turn in the tail. Templates that want typed message parts (VLM templates)
    get them when plain string contents lose the transcript."""
    user = user_turn(_MARK, question)
    text = plain_text(system_prompt, user)
    if has_chat_template(tokenizer):
        for content in (plain_content, typed_content):
            chat = chat_text(tokenizer, system_prompt, user, content, tools=tools, after=after)
            if _MARK in chat:
                text = chat
                break
    head, tail = text.split(_MARK, 1)
    return head, tail
