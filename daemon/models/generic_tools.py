"""Tools for models whose chat template has no place for them: a tool section of prefixd's own (as LM Studio does).

A template that never reads ``tools`` would drop them, and one that never
reads ``tool_calls`` would drop an assistant turn's calls, so every coding
agent (they all send tools) would be refused by such a model. Instead the chat
is rewritten, before templating, into plain messages any template renders, in
the Hermes format (NousResearch Hermes, Qwen 2.5) that prefixd's parsers and
forced-call grammar already know:

- the tools' JSON schemas go inside ``<tools></tools>`` in the system prompt,
  with the instruction to answer a call as ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``; appended to the first message when it is
  a system message, else in a system message of its own put first;
- an assistant turn's ``tool_calls`` become that markup in its content,
  written exactly as the forced-call grammar has the model write it
  (grammar/tool_call_grammar.py), so the turn sent back renders as the model
  wrote it and the cache holds it;
- a ``tool`` message becomes a user message holding the result in
  ``<tool_response></tool_response>`` (every template renders a user turn).

Deterministic and prefix-stable: the section depends on the tools alone and
each message is rewritten on its own, so the same tools and earlier turns
render to the same text every turn. Pure Python, no MLX.
"""

from __future__ import annotations

import json
from typing import Any

from .tool_call_format import ToolCallFormat, parse_hermes_json, tool_call_format

TEMPLATE, GENERIC, NO_TEMPLATE = "template", "generic", "none"  # how a model takes tools (``models`` says which)
GENERIC_FAMILY = "generic"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
GENERIC_CALL_FORMAT = ToolCallFormat(GENERIC_FAMILY, CALL_START, CALL_END, parse_hermes_json)

TOOL_SECTION = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def tools_path(tokenizer: Any) -> str:
    """How a model takes tools: its own template (``template``), prefixd's section (``generic``), or not at all (``none``)."""
    if not getattr(tokenizer, "has_chat_template", False):
        return NO_TEMPLATE
    template = getattr(tokenizer, "chat_template", None)
    return TEMPLATE if isinstance(template, str) and "tools" in template else GENERIC


def call_format(tokenizer: Any) -> ToolCallFormat | None:
    """The format a model's tool calls are read in: Hermes on the generic path, else its template's own (or None)."""
    return GENERIC_CALL_FORMAT if tools_path(tokenizer) == GENERIC else tool_call_format(tokenizer)


def tool_section(tools: tuple[dict[str, Any], ...]) -> str:
    """The system prompt's tool section: each tool's JSON on a line of its own, in the order given."""
    return TOOL_SECTION.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def render_call(call: dict[str, Any]) -> str:
    """One call (``{function: {name, arguments}}``, arguments a map) as the forced-call grammar writes it.

    json.dumps with its default separators: the grammar's (compiler.JSON_OPTIONS).
    """
    function = call["function"]
    body = {"name": function["name"], "arguments": function.get("arguments") or {}}
    return f"{CALL_START}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_END}"


def generic_messages(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...] | None) -> list[dict[str, Any]]:
    """The chat as plain {role, content} messages with the tool section, calls and results written in."""
    rewritten = [_plain(message) for message in messages]
    if not tools:
        return rewritten
    section = tool_section(tools)
    if rewritten and rewritten[0]["role"] == "system":
        system = rewritten[0]["content"]
        rewritten[0] = {"role": "system", "content": f"{system}\n\n{section}" if system else section}
        return rewritten
    return [{"role": "system", "content": section}, *rewritten]


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls")
    if calls:
        pieces = [content] if content else []
        return {"role": role, "content": "\n".join(pieces + [render_call(call) for call in calls])}
    return {key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")}
