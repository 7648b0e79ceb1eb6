"""Anthropic's tools in requests, as prefixd's (OpenAI-shaped) tools, tool choice and tool messages.

Pure data. Anthropic's tool ``{name, description?, input_schema}`` is
OpenAI's function ``{name, description?, parameters}``; its ``tool_choice``
``{type: auto | any | tool | none}`` is "auto", "required", a named function
or "none"; an assistant turn's ``tool_use`` blocks are that message's
``tool_calls`` (``input`` is the arguments object); a user turn's
``tool_result`` blocks are ``tool`` messages, one per result, before the
turn's text (Anthropic puts the results first). Server tools (web search,
code execution, ...) run on Anthropic's side and are refused.
"""

from __future__ import annotations

from typing import Any, Callable

from ...protocol.tools import AUTO, NONE, REQUIRED
from .http_errors import invalid, reject_unknown

TOOL_FIELDS = ("type", "name", "description", "input_schema", "cache_control")
TOOL_CHOICE_FIELDS = ("type", "name", "disable_parallel_tool_use")
TOOL_USE_FIELDS = ("type", "id", "name", "input", "cache_control")
TOOL_RESULT_FIELDS = ("type", "tool_use_id", "content", "is_error", "cache_control")
TOOL_BLOCKS = ("tool_use", "tool_result")
CACHE_CONTROL_NOTE = "cache_control: prefixd caches every prompt prefix on its own; breakpoints are not needed"
ERROR_PREFIX = "Error: "  # a failed tool's result, as the model reads it (chat templates have no error flag)

# (blocks, where) -> their text: text blocks only, anything else refused (anthropic_shapes._text_of)
TextOf = Callable[[Any, str], str]


def generate_tool_fields(body: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as generate params (an empty map when the request has no tools)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, {"type": "none"}, {"type": "auto"}):
            raise invalid("'tool_choice' needs 'tools' to choose from", "tool_choice")
        return {}
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of {name, description?, input_schema} objects", "tools")
    out: dict[str, Any] = {"tools": [_tool(index, tool, notes) for index, tool in enumerate(tools)]}
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice)
    return out


def _tool(index: int, tool: Any, notes: list[str]) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise invalid(f"'{where}' must be an object {{name, description?, input_schema}}", where)
    if tool.get("type") not in (None, "custom"):
        raise invalid(
            f"'{where}.type' {tool['type']!r}: server tools run on Anthropic's side; prefixd has only "
            "client tools ({name, description?, input_schema})",
            f"{where}.type",
        )
    reject_unknown(tool, TOOL_FIELDS, where)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise invalid(f"'{where}.input_schema' must be a JSON schema object", f"{where}.input_schema")
    if tool.get("cache_control") is not None:
        _note_once(notes, CACHE_CONTROL_NOTE)
    function = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}  # parse_generate checks the name and description


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        raise invalid('\'tool_choice\' must be {type: "auto" | "any" | "tool" | "none"}', "tool_choice")
    reject_unknown(choice, TOOL_CHOICE_FIELDS, "tool_choice")
    kind = choice.get("type")
    if choice.get("disable_parallel_tool_use") and kind == "auto":
        # A forced call ("any", "tool") is always exactly one; under "auto" the model writes as many as it likes.
        raise invalid(
            '\'tool_choice.disable_parallel_tool_use\' is honoured only with type "any" or "tool" '
            "(prefixd forces exactly one call then)",
            "tool_choice.disable_parallel_tool_use",
        )
    if kind == "auto":
        return AUTO
    if kind == "any":
        return REQUIRED
    if kind == "none":
        return NONE
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("'tool_choice.name' must name one of 'tools'", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid('\'tool_choice.type\' must be "auto", "any", "tool" or "none"', "tool_choice.type")


def has_tool_blocks(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(block, dict) and block.get("type") in TOOL_BLOCKS for block in content
    )


def assistant_message(content: list[Any], where: str, text_of: TextOf, notes: list[str]) -> dict[str, Any]:
    """An assistant turn with ``tool_use`` blocks: its text and its ``tool_calls``."""
    texts, calls = [], []
    for index, block in enumerate(content):
        place = f"{where}[{index}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            raise invalid(f"'{place}': a tool_result goes in a user turn", f"{place}.type")
        if isinstance(block, dict) and block.get("type") == "tool_use":
            reject_unknown(block, TOOL_USE_FIELDS, place)
            _note_cache_control(block, notes)
            if not isinstance(block.get("id"), str) or not isinstance(block.get("input"), dict):
                raise invalid(f"'{place}' must be {{type: \"tool_use\", id, name, input: object}}", place)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": block["input"]},
                }
            )
        else:
            texts.append(text_of([block], place))
    return {"role": "assistant", "content": "".join(texts), "tool_calls": calls}


def user_messages(content: list[Any], where: str, text_of: TextOf, notes: list[str]) -> list[dict[str, Any]]:
    """A user turn with ``tool_result`` blocks: one ``tool`` message per result, then the turn's text, if any."""
    results, texts = [], []
    for index, block in enumerate(content):
        place = f"{where}[{index}]"
        if isinstance(block, dict) and block.get("type") == "tool_use":
            raise invalid(f"'{place}': a tool_use goes in an assistant turn", f"{place}.type")
        if isinstance(block, dict) and block.get("type") == "tool_result":
            reject_unknown(block, TOOL_RESULT_FIELDS, place)
            _note_cache_control(block, notes)
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(
                    f"'{place}.tool_use_id' must be the id of the tool_use it answers", f"{place}.tool_use_id"
                )
            text = text_of(block.get("content") or "", f"{place}.content")
            if block.get("is_error"):
                text = ERROR_PREFIX + text
                _note_once(
                    notes, f"tool_result.is_error: the result reaches the model as text starting {ERROR_PREFIX!r}"
                )
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            texts.append(text_of([block], place))
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _note_cache_control(block: dict[str, Any], notes: list[str]) -> None:
    if block.get("cache_control") is not None:
        _note_once(notes, CACHE_CONTROL_NOTE)


def _note_once(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)
