"""OpenAI's Responses API requests, as prefixd's generate params; the response objects it answers with.

Pure data, no I/O (``responses_api`` runs it). Field policy, as on the other
fronts: a field prefixd honours is honoured; a field that only labels the
request or asks for a feature the model cannot use (a reasoning summary from a
model that does not reason, encrypted reasoning, a cache key, client
metadata, a server-side tool such as ``web_search``) is accepted, left out and
named in ``prefixd_notes`` and the log, so agent clients such as Codex keep
working; a field that would change the answer and is not honoured is a 400
naming it (``background``, ``conversation``, ``prompt``, logprobs, ...).

``max_output_tokens`` defaults to the daemon's ``--max-output-tokens`` (4096,
cut to the room the context leaves), not to prefixd's 256: an agent's tool
call that writes a file must not be cut off by a default it never asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...protocol import methods as m
from ...protocol.tools import FINISH_TOOL_CALLS
from . import request_fields
from .field_kinds import check_field_kinds
from .http_errors import invalid, reject_unknown
from .openai_shapes import response_format_constraint
from .responses_items import chat_messages, normalized_items

HONOURED_FIELDS = (
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "metadata",
    "truncation",
    "session",
    "cache",
)
# Labels and hints: accepted, never change the answer (the notes say what was left out).
LABEL_FIELDS = (
    "user",
    "safety_identifier",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "client_metadata",
    "reasoning",
    "include",
    "context_management",
    "moderation",
)
# Would change the answer or the way it is delivered, and prefixd does not do them.
REFUSED_FIELDS = {
    "background": "background responses are not supported; send the request and wait (or stream)",
    "background_options": "background responses are not supported",
    "conversation": "the Conversations API is not supported; continue with 'previous_response_id'",
    "prompt": "stored prompt templates are not supported; send 'instructions' and 'input'",
    "image": "image generation is not supported",
    "max_tool_calls": "'max_tool_calls' is not supported",
    "top_logprobs": "logprobs are not supported",
    "access_programs": "'access_programs' is not supported",
}
INCLUDE_LEFT_OUT = (
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "message.input_image.image_url",
)
FUNCTION_TOOL_FIELDS = ("type", "name", "description", "parameters", "strict", "defer_loading")


@dataclass
class ResponsesRequest:
    """One parsed request: what the engine runs, and what the response object echoes back."""

    params: m.GenerateParams
    items: list[dict[str, Any]]  # this request's input items, canonical
    instructions: str | None
    echo: dict[str, Any]  # the request fields a response object repeats
    store: bool
    stream: bool
    previous_response_id: str | None
    namespaces: frozenset[str]
    notes: list[str] = field(default_factory=list)


def responses_request(body: Any, history: list[dict[str, Any]], default_max_output_tokens: int) -> ResponsesRequest:
    """A /v1/responses body as a request; ``history`` the stored conversation before it (previous_response_id).

    ``default_max_output_tokens``: the answer length when the body names none (the daemon's --max-output-tokens).
    """
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    reject_unknown(body, HONOURED_FIELDS + LABEL_FIELDS + tuple(REFUSED_FIELDS))
    check_field_kinds(body)
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) not in (None, False, 0, [], {}):
            raise invalid(why, name)
    notes = _label_notes(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions")
    if body.get("input") is None and body.get("previous_response_id") is None:
        raise invalid("'input' is required", "input")
    items = normalized_items(body["input"], notes) if body.get("input") is not None else []
    tools, namespaces = _function_tools(body.get("tools"), notes)
    generate: dict[str, Any] = {
        "messages": chat_messages(instructions, history + items),
        "max_tokens": default_max_output_tokens,
        **request_fields.generate_fields(
            body, request_fields.FieldNames(max_tokens="max_output_tokens", seed=None, stop=None)
        ),
        "stream": True,  # the front always reads the answer as it comes, streamed or not
    }
    if not generate["messages"]:
        raise invalid("the conversation is empty: give 'input'", "input")
    for name in ("model", "session", "cache"):
        if body.get(name) is not None:
            generate[name] = body[name]
    if tools:
        generate["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            generate["tool_choice"] = choice
        if body.get("parallel_tool_calls") is False and choice in (None, "auto"):
            raise invalid(
                "'parallel_tool_calls' false is honoured only with a 'tool_choice' that forces one call "
                '("required" or a named function)',
                "parallel_tool_calls",
            )
    elif body.get("tool_choice") not in (None, "auto", "none"):
        raise invalid("'tool_choice' needs function 'tools' to choose from", "tool_choice")
    constraint = _text_constraint(body.get("text"))
    if constraint is not None:
        generate["constraint"] = constraint
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise invalid('\'truncation\' must be "disabled" or "auto"', "truncation")
    if body.get("truncation") == "auto":
        notes.append("truncation auto: prefixd never drops input; a prompt longer than the context is an error")
    stream, store = body.get("stream", False), body.get("store", True)
    for name, value in (("stream", stream), ("store", store)):
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be a boolean", name)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("'previous_response_id' must be a string", "previous_response_id")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise invalid("'metadata' must be an object", "metadata")
    echo = {
        key: body.get(key)
        for key in (
            "instructions",
            "metadata",
            "temperature",
            "top_p",
            "max_output_tokens",
            "tool_choice",
            "truncation",
            "user",
            "reasoning",
            "prompt_cache_key",
            "safety_identifier",
            "service_tier",
        )
    }
    echo["tools"] = body.get("tools") or []
    echo["text"] = body.get("text") or {"format": {"type": "text"}}
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
    return ResponsesRequest(
        m.parse_generate(generate), items, instructions, echo, store, stream, previous, namespaces, notes
    )


def _label_notes(body: dict[str, Any]) -> list[str]:
    notes = []
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("'reasoning' must be an object", "reasoning")
        if any(reasoning.get(key) not in (None, "none") for key in ("effort", "summary", "generate_summary")):
            notes.append("reasoning: left out (the model does not reason; no reasoning items are returned)")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(name, str) for name in include):
            raise invalid("'include' must be an array of strings", "include")
        for name in include:
            if name == "message.output_text.logprobs":
                raise invalid("logprobs are not supported ('include': message.output_text.logprobs)", "include")
            if name not in INCLUDE_LEFT_OUT:
                raise invalid(f"'include' value {name!r} is not known", "include")
        if include:
            notes.append(f"include {', '.join(include)}: nothing of that kind is produced")
    if body.get("prompt_cache_key") is not None or body.get("prompt_cache_retention") is not None:
        notes.append("prompt_cache_key / retention: prefixd caches every prompt prefix by itself, for every client")
    if body.get("context_management") is not None:
        notes.append("context_management: left out (prefixd does not compact the conversation)")
    return notes


def _function_tools(tools: Any, notes: list[str]) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """Function tools (those in a namespace as ``namespace.name``) in OpenAI's chat shape; server-side tools left out."""
    if tools is None:
        return [], frozenset()
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array of tools", "tools")
    out: list[dict[str, Any]] = []
    namespaces = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(tool, where, prefix=""))
        elif kind == "namespace":
            name = tool.get("name")
            if not isinstance(name, str) or not name or not isinstance(tool.get("tools"), list):
                raise invalid(f"'{where}' must be {{type: \"namespace\", name, tools: [...]}}", where)
            namespaces.add(name)
            for inner_index, inner in enumerate(tool["tools"]):
                inner_where = f"{where}.tools[{inner_index}]"
                if isinstance(inner, dict) and inner.get("type") == "function":
                    out.append(_function(inner, inner_where, prefix=name + "."))
                else:
                    _note_left_out(notes, inner.get("type") if isinstance(inner, dict) else None, inner_where)
        elif isinstance(kind, str):
            _note_left_out(notes, kind, where)
        else:
            raise invalid(f"'{where}' must be a tool object with a 'type'", where)
    return out, frozenset(namespaces)


def _note_left_out(notes: list[str], kind: Any, where: str) -> None:
    note = f"tools: {kind!r} left out (a server-side or custom tool prefixd cannot run; the model does not see it)"
    if note not in notes:
        notes.append(note)


def _function(tool: dict[str, Any], where: str, prefix: str) -> dict[str, Any]:
    reject_unknown(tool, FUNCTION_TOOL_FIELDS, where)
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{where}.name' must be a non-empty string", f"{where}.name")
    function: dict[str, Any] = {
        "name": prefix + name,
        "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
    }
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    """Responses' tool_choice as the chat shape parse_generate checks."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        namespace = choice.get("namespace")
        name = f"{namespace}.{choice['name']}" if isinstance(namespace, str) and namespace else choice["name"]
        return {"type": "function", "function": {"name": name}}
    raise invalid('\'tool_choice\' must be "auto", "none", "required" or {type: "function", name}', "tool_choice")


def _text_constraint(text: Any) -> dict[str, Any] | None:
    """``text.format`` as a constraint: json_schema (its ``schema`` at the top level here) or json_object."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("'text' must be an object {format: {...}}", "text")
    reject_unknown(text, ("format", "verbosity"), "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return response_format_constraint({"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}})
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"json_object": True}
    raise invalid('\'text.format.type\' must be "text", "json_schema" or "json_object"', "text.format")


# -- the response object --------------------------------------------------------------------


def response_object(
    response_id: str,
    request: ResponsesRequest,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    result: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response as OpenAI shapes it; ``result`` (the generate's) adds usage and prefixd's cache figures."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    obj: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "model": model,
        "output": output,
        "error": error,
        "incomplete_details": incomplete,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "background": False,
        **request.echo,
    }
    if status in ("completed", "incomplete"):
        obj["completed_at"] = int(time.time())
    if result is not None:
        cached = result["cache"]["reused_tokens"]
        obj["usage"] = {
            "input_tokens": result["usage"]["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": result["usage"]["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result["usage"]["prompt_tokens"] + result["usage"]["completion_tokens"],
        }
        obj["prefixd_cache"] = result["cache"]
        obj["prefixd_timings"] = result["timings"]
    if request.notes:
        obj["prefixd_notes"] = request.notes
    return obj


def final_status(result: dict[str, Any]) -> str:
    return "incomplete" if result["finish_reason"] == m.FINISH_LENGTH else "completed"


def is_tool_finish(result: dict[str, Any]) -> bool:
    return result["finish_reason"] == FINISH_TOOL_CALLS
