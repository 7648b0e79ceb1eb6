"""A Lark constraint that forces the answer to be one tool call, in the model's own tool-call format.

For tool_choice "required" (any of the tools) or a named function: the answer
is exactly one call the model's chat template would render, its arguments
matching the tool's ``parameters`` JSON schema (llguidance's ``%json``
rules). Formats: Hermes/Qwen (mlx-lm's ``json_tools``)
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` and Llama 3's
bare ``{"name": ..., "parameters": {...}}``. Pure: no tokenizer, no MLX; a
marker that is a special token of the model's tokenizer (Qwen's
``<tool_call>``) must be named in ``special_tokens``, since a grammar writes a
special token differently from its text.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Iterable

from ...protocol.methods import Constraint
from ..models.tool_call_format import LLAMA3_JSON, ToolCallFormat
from .compiler import JSON_OPTIONS

HERMES_FAMILIES = frozenset({"json_tools"})
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_DEFS_KEYS = ("$defs", "definitions")


def forced_tool_call(
    tools: Iterable[dict[str, Any]],
    call_format: ToolCallFormat,
    function: str | None = None,
    special_tokens: Collection[str] = (),
) -> Constraint:
    """The Constraint of one call to one of ``tools`` (OpenAI tool maps), or to ``function`` only.

    Raises ValueError for a format with no grammar here, or a ``function``
    that is not among the tools.
    """
    functions = [tool["function"] for tool in tools]
    chosen = [f for f in functions if function is None or f["name"] == function]
    if not chosen:
        names = ", ".join(f["name"] for f in functions) or "none"
        raise ValueError(f"function {function!r} is not among the tools ({names})")
    family = call_format.family
    if family == LLAMA3_JSON:
        arguments_key, start, end = "parameters", "", ""
    elif family in HERMES_FAMILIES or (call_format.start, call_format.end) == (HERMES_START, HERMES_END):
        arguments_key, start, end = "arguments", call_format.start + "\n", "\n" + call_format.end
    else:
        raise ValueError(
            f"no forced-call grammar for the {family!r} tool-call format "
            "(only Hermes/Qwen <tool_call> JSON and Llama 3 JSON)"
        )
    rules = [
        f"call_{n}: %json {json.dumps(call_schema(f, arguments_key), ensure_ascii=False)}" for n, f in enumerate(chosen)
    ]
    body = " | ".join(f"call_{n}" for n in range(len(chosen)))
    top = " ".join(part for part in (_literal(start, special_tokens), "call", _literal(end, special_tokens)) if part)
    return Constraint.lark("\n".join([f"start: {top}", f"call: {body}", *rules]) + "\n")


def call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """``{"name": <its name>, arguments_key: <its parameters>}``, nothing else; the parameters' $defs hoisted to the root."""
    parameters = dict(function.get("parameters") or {"type": "object"})
    hoisted = {key: parameters.pop(key) for key in _DEFS_KEYS if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        **hoisted,
        "x-guidance": JSON_OPTIONS,
    }


def _literal(text: str, special_tokens: Collection[str]) -> str:
    """``text`` as Lark: a quoted string, with a marker that is a special token written as <token>."""
    if not text:
        return ""
    for marker in sorted(special_tokens, key=len, reverse=True):
        if marker and marker in text:
            before, _, after = text.partition(marker)
            return " ".join(p for p in (_literal(before, special_tokens), marker, _literal(after, special_tokens)) if p)
    return json.dumps(text, ensure_ascii=False)
