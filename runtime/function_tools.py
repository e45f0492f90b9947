"""Function calling, in the OpenAI Realtime API's shape: the tools a client declares and how it lets the model use them.

A client declares `session.tools` (and may override them per `response.create`), each a function with a JSON
Schema for its arguments, and a `tool_choice`: `auto` (the model decides), `none` (text only), `required` (some
call) or `{"type": "function", "name": ...}` (that call). A call the model makes becomes a `function_call` item;
the client runs it and sends a `function_call_output` item, and the next `response.create` answers from it.

Two backends make calls differently, and both read these types:
- a remote server (`lm.backend = openai`) gets them as chat-completions `tools` (`chat_tools`, `chat_tool_choice`);
- the local engine, on a model whose chat template takes tools (Qwen2.5's), prompts and calls in that template's
  format and lets the model decide under `auto` (`models/lm/tool_calls.py`); on one whose template ignores them
  (SmolLM2's) it decodes a forced call's arguments under the function's schema (`arguments_schema`), so even a
  135M model's call is valid JSON, and with `auto` answers in text (a 135M model is a poor judge of when to call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("auto", "none", "required")


class ToolError(ValueError):
    """A tool or tool choice a client sent that cannot be used; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments object

    def to_api(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.schema()}

    def schema(self) -> dict[str, Any]:
        """The arguments' schema; a function declared without one takes none (not any object the model invents)."""
        return self.parameters or {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    """What a response may call: its tools and the choice (a mode, or the one function's name)."""

    tools: tuple[FunctionTool, ...] = ()
    choice: str = "auto"  # auto | none | required | function:<name>

    @property
    def forced(self) -> str | None:
        """The function every answer must call, when the choice names one (or `required` leaves one)."""
        if self.choice.startswith("function:"):
            return self.choice.removeprefix("function:")
        if self.choice == "required" and len(self.tools) == 1:
            return self.tools[0].name
        return None

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def tool(self, name: str) -> FunctionTool:
        return next(t for t in self.tools if t.name == name)

    def choice_to_api(self) -> str | dict[str, str]:
        forced = self.choice.removeprefix("function:") if self.choice.startswith("function:") else None
        return {"type": "function", "name": forced} if forced else self.choice


def parse_tools(value: object, param: str) -> tuple[FunctionTool, ...]:
    if not isinstance(value, list):
        raise ToolError(param, f"{param} must be a list of tools")
    tools: list[FunctionTool] = []
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type", f"{where}: only tools of type 'function' are supported")
        name = tool.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
            raise ToolError(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, '_' or '-'")
        if any(t.name == name for t in tools):
            raise ToolError(f"{where}.name", f"{where}.name {name!r} is declared twice")
        description = tool.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"{where}.description", f"{where}.description must be a string")
        parameters = tool.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type") != "object"):
            raise ToolError(f"{where}.parameters", f"{where}.parameters must be a JSON Schema with type 'object'")
        tools.append(FunctionTool(name, description, parameters))
    return tuple(tools)


def parse_choice(value: object, param: str) -> str:
    if isinstance(value, str):
        if value not in MODES:
            raise ToolError(param, f"{param} must be one of {', '.join(MODES)} or {{'type': 'function', 'name': ...}}")
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return f"function:{value['name']}"
    raise ToolError(param, f"{param} must be one of {', '.join(MODES)} or {{'type': 'function', 'name': ...}}")


def checked(use: ToolUse, param: str) -> ToolUse:
    """`use` once its choice is possible: a named function must be declared, `required` needs a tool."""
    forced = use.choice.removeprefix("function:") if use.choice.startswith("function:") else None
    if forced is not None and all(t.name != forced for t in use.tools):
        raise ToolError(param, f"{param} names {forced!r}, which is not among the declared tools")
    if use.choice == "required" and not use.tools:
        raise ToolError(param, f"{param} is 'required' but no tools are declared")
    return use


def chat_tools(use: ToolUse) -> list[dict[str, Any]]:
    """The tools as chat-completions' `tools` field."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.schema()}}
            for t in use.tools]


def chat_tool_choice(use: ToolUse) -> str | dict[str, Any]:
    forced = use.choice.removeprefix("function:") if use.choice.startswith("function:") else None
    return {"type": "function", "function": {"name": forced}} if forced else use.choice


def arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    """The JSON Schema a forced call's arguments are decoded under."""
    return tool.schema()


def names_schema(use: ToolUse) -> dict[str, Any]:
    """The schema of a choice among the tools (the local engine's first step under `required`)."""
    return {"type": "string", "enum": [t.name for t in use.tools]}


def tools_prompt(use: ToolUse, max_description: int = 160) -> str:
    """What a local model is told about the functions it may call (a line each, descriptions cut to fit)."""
    lines = [f"- {t.name}: {(t.description or '(no description)')[:max_description]}" for t in use.tools]
    return "Functions you can call:\n" + "\n".join(lines)
