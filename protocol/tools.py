"""Tools, tool choice, tool calls and tool results in requests: validation into the shapes chat templates expect.

Pure data. A tool is OpenAI's ``{type: "function", function: {name,
description?, parameters?}}``; an assistant message may carry
``tool_calls: [{id?, type?, function: {name, arguments}}]`` and a ``tool``
message ``tool_call_id`` / ``name``. Chat templates (Qwen, Hermes, Llama 3,
Mistral) read ``tool_call.function.arguments`` as a mapping and render it
with ``tojson``, so arguments given as a JSON string (OpenAI's way) are
parsed here: the template then writes back exactly the JSON the model
emitted, and the next turn of an agent loop matches the cached tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import ErrorCode, RpcError

MAX_TOOLS = 256
AUTO, NONE, REQUIRED, FUNCTION = "auto", "none", "required", "function"
FINISH_TOOL_CALLS = "tool_calls"  # a generate's finish_reason when its answer called tools


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the answer may (auto), must not (none) or must (required, or the named ``function``) call a tool."""

    mode: str = AUTO
    function: str | None = None  # mode FUNCTION: the tool it must call

    @property
    def forces_call(self) -> bool:
        return self.mode in (REQUIRED, FUNCTION)


def _invalid(message: str, param: str | None = None) -> RpcError:
    """INVALID_PARAMS; ``param`` names the field at fault, as the error's data ({"param": ...})."""
    return RpcError(ErrorCode.INVALID_PARAMS, message, {"param": param} if param else None)


def parse_tools(tools: Any) -> tuple[dict[str, Any], ...] | None:
    """``tools`` as a tuple of {type: "function", function: {...}} maps (None when absent or empty)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, (list, tuple)) or len(tools) > MAX_TOOLS:
        raise _invalid(
            f"'tools' must be an array of at most {MAX_TOOLS} {{type: \"function\", function: {{name, ...}}}} maps",
            "tools",
        )
    parsed = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise _invalid(
                f"'{where}' must be {{type: \"function\", function: {{name, description?, parameters?}}}}", where
            )
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _invalid(f"'{where}.function.name' must be a non-empty string", f"{where}.function.name")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise _invalid(f"'{where}.function.description' must be a string", f"{where}.function.description")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _invalid(
                f"'{where}.function.parameters' must be a JSON schema object", f"{where}.function.parameters"
            )
        parsed.append({"type": "function", "function": dict(function)})
    return tuple(parsed)


def parse_tool_choice(choice: Any, tools: tuple[dict[str, Any], ...] | None) -> ToolChoice:
    """ "auto" (the default), "none", "required", or OpenAI's {type: "function", function: {name}} naming one of ``tools``."""
    if choice is None or choice == AUTO:
        return ToolChoice()
    if choice == NONE:
        return ToolChoice(NONE)
    names = [tool["function"]["name"] for tool in tools or ()]
    if choice == REQUIRED:
        if not names:
            raise _invalid("'tool_choice' \"required\" needs 'tools' to choose from", "tool_choice")
        return ToolChoice(REQUIRED)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _invalid(
            '\'tool_choice\' must be "auto", "none", "required" or {type: "function", function: {name}}', "tool_choice"
        )
    if name not in names:
        raise _invalid(
            f"'tool_choice' names the function {name!r}, which is not in 'tools' (given: {', '.join(names) or 'none'})",
            "tool_choice",
        )
    return ToolChoice(FUNCTION, name)


def parse_message_tool_fields(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """The tool keys of messages[index], validated: tool_calls (assistant), tool_call_id and name (tool)."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls not in (None, []):
        if not isinstance(calls, (list, tuple)):
            raise _invalid(f"'messages[{index}].tool_calls' must be an array", f"messages[{index}].tool_calls")
        out["tool_calls"] = [_tool_call(f"messages[{index}].tool_calls[{n}]", call) for n, call in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _invalid(f"'messages[{index}].{key}' must be a string", f"messages[{index}].{key}")
            out[key] = value
    return out


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise _invalid(f"'{where}' must be {{id?, type?: \"function\", function: {{name, arguments}}}}", where)
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise _invalid(
                f"'{where}.function.arguments' is not valid JSON: {exc}", f"{where}.function.arguments"
            ) from None
    if not isinstance(arguments, dict):
        raise _invalid(
            f"'{where}.function.arguments' must be a JSON object (a map, or a string holding one)",
            f"{where}.function.arguments",
        )
    parsed: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            raise _invalid(f"'{where}.id' must be a string", f"{where}.id")
        parsed["id"] = call["id"]
    return parsed
