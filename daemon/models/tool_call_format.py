"""How a model writes a tool call, and the calls read back out of a finished answer.

The format is the one the model's chat template renders for an assistant
turn's ``tool_calls`` (the model learnt to write what its template shows).
mlx-lm infers it at load (``TokenizerWrapper.tool_parser``, ``tool_call_start``
and ``tool_call_end``, from the template or ``tool_parser_type`` in
tokenizer_config.json): Hermes/Qwen ``<tool_call>{json}</tool_call>``
(``json_tools``), Mistral ``[TOOL_CALLS]...`` (``mistral``), Gemma 4, Kimi,
GLM and others; prefixd reuses its parsers. A model whose template has no
tools gets prefixd's generic tool section (generic_tools.py), in the Hermes
format, read by ``parse_hermes_json``. Llama 3.1-3.3 write a bare JSON
object ``{"name": ..., "parameters": ...}`` (optionally after
``<|python_tag|>``), which mlx-lm does not parse; ``llama3_json`` here does.
Pure Python, no MLX.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

LLAMA3_JSON = "llama3_json"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: a function name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's {id, type, function: {name, arguments}}, arguments as JSON text.

        json.dumps with its default separators writes what the templates'
        ``tojson`` writes, so the call sent back next turn renders as the
        model wrote it and the cache holds it.
        """
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's tool-call syntax: calls sit between ``start`` and ``end`` ("" end: the answer's end).

    ``start`` "" (Llama 3 JSON): the whole answer is the call, or it is text.
    """

    family: str
    start: str
    end: str
    parse_one: Callable[
        [str], list[ToolCall]
    ]  # one call's text (between the markers) -> its calls; ValueError if it is none

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole answer as (its text outside the calls, the calls); a call that does not parse stays text."""
        if not self.start:
            calls = _try(self.parse_one, text)
            return ("", calls) if calls else (text, [])
        content, calls, cursor = [], [], 0
        while (begin := text.find(self.start, cursor)) >= 0:
            inner_from = begin + len(self.start)
            finish = text.find(self.end, inner_from) if self.end else -1
            inner_to = finish if finish >= 0 else len(text)
            parsed = _try(self.parse_one, text[inner_from:inner_to])
            content.append(
                text[cursor:begin] if parsed else text[cursor : inner_to + (len(self.end) if finish >= 0 else 0)]
            )
            calls += parsed
            cursor = inner_to + (len(self.end) if finish >= 0 else 0)
        content.append(text[cursor:])
        return "".join(content).strip() if calls else text, calls


def _try(parse: Callable[[str], list[ToolCall]], text: str) -> list[ToolCall]:
    try:
        return parse(text)
    except (ValueError, TypeError, KeyError, AttributeError, SyntaxError):
        return []


def tool_call_format(tokenizer: Any) -> ToolCallFormat | None:
    """The tool-call format of a model's tokenizer (an mlx-lm TokenizerWrapper); None when it has none."""
    parser = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    if parser is not None and start:
        family = getattr(parser, "__module__", "").rsplit(".", 1)[-1] or "mlx_lm"
        return ToolCallFormat(family, start, getattr(tokenizer, "tool_call_end", None) or "", _mlx_lm_parser(parser))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "tool_call" in template and '"parameters": ' in template:
        return ToolCallFormat(LLAMA3_JSON, "", "", parse_llama3_json)
    return None


def _mlx_lm_parser(parse_tool_call: Callable[..., Any]) -> Callable[[str], list[ToolCall]]:
    def parse(text: str) -> list[ToolCall]:
        parsed = parse_tool_call(text, None)
        return [
            _call(item.get("name"), item.get("arguments"), item.get("id"))
            for item in (parsed if isinstance(parsed, list) else [parsed])
        ]

    return parse


def parse_hermes_json(text: str) -> list[ToolCall]:
    """``{"name": ..., "arguments": {...}}``, the text between Hermes' <tool_call> markers (prefixd's generic tool section)."""
    parsed = json.loads(text)
    return [_call(parsed.get("name"), parsed.get("arguments"), None)]


def parse_llama3_json(text: str) -> list[ToolCall]:
    """``{"name": ..., "parameters": {...}}`` (or ``arguments``), or an array of them, the whole answer."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :].lstrip()
    parsed = json.loads(text)
    items = parsed if isinstance(parsed, list) else [parsed]
    return [_call(item.get("name"), item.get("parameters", item.get("arguments")), None) for item in items]


def _call(name: Any, arguments: Any, call_id: Any) -> ToolCall:
    if isinstance(arguments, str):  # some formats carry the arguments as JSON text
        arguments = json.loads(arguments)
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise ValueError(f"not a tool call: name {name!r}, arguments {arguments!r}")
    return ToolCall(name, arguments, call_id if isinstance(call_id, str) and call_id else new_call_id())
