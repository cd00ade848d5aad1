"""Tool-call syntaxes: the text of a model's turn -> the tool calls it makes.

A registry, so that more formats can be added by name (`rollout.multi_turn.format`). Built in:
`hermes`, the form the Qwen2.5 and Qwen3 chat templates teach their models:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

A parser never raises on what a model wrote: a call it cannot read becomes a `ToolCall` with an
`error` (bad JSON, no name, arguments that are not an object), which the loop answers with a tool
error message to the model and counts in `tool/error_rate`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCall:
    name: str                                            # the tool the model named ("" when unreadable)
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None                             # why the call could not be read (None: it could)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every <tool_call>...</tool_call> block of `text`, in order; an unclosed block is a call too
    (an error: the model stopped inside it)."""
    calls = []
    for match in re.finditer(r"<tool_call>(.*?)(</tool_call>|$)", text, flags=re.DOTALL):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall("", error="the <tool_call> block is not closed by </tool_call>"))
            continue
        calls.append(_call_from_json(body))
    return calls


def _call_from_json(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall("", error='a tool call is a JSON object {"name": ..., "arguments": {...}} with a tool name')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error=f"the arguments of {value['name']!r} must be a JSON object, got "
                                             f"{type(arguments).__name__}")
    return ToolCall(value["name"], arguments)


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}
