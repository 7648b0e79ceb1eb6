"""The Responses API's items, to and from prefixd's chat messages.

Pure data. A conversation in the Responses API is a list of items: messages
(``user``, ``assistant``, ``system``, ``developer``), the model's
``function_call`` items and the client's ``function_call_output`` items.
prefixd's engine takes chat messages, so the items become messages here:
a ``developer`` message is a system message; ``instructions`` and the system
messages that open the conversation are joined into one system message (many
chat templates read only one, and only at the start); a run of
``function_call`` items is one assistant message's ``tool_calls`` (joined to
the assistant text just before them); each ``function_call_output`` is a
``tool`` message. Items are kept in their canonical form (``normalized_items``)
so a stored response hands the next turn exactly what this one rendered, and
the next turn's prompt starts with this one's, answer included.

A tool in a ``namespace`` (Codex groups tools so) reaches the model as
``namespace.name``; a call of such a name comes back as a ``function_call``
with its ``namespace`` and bare ``name``, as OpenAI returns it.

``reasoning`` items are left out (prefixd's models do not return reasoning, so
only a client's copy of another server's could arrive); items that only a
server-side tool makes (web search calls, ...) and item references are
refused, naming the item.
"""

from __future__ import annotations

import uuid
from typing import Any

from .http_errors import invalid

SYSTEM_ROLES = ("system", "developer")
MESSAGE_ROLES = ("user", "assistant") + SYSTEM_ROLES
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
REASONING_NOTE = "reasoning items: left out (the model does not return reasoning)"


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- input: what the client sends, in one canonical form ------------------------------------


def normalized_items(raw: Any, notes: list[str]) -> list[dict[str, Any]]:
    """``input`` (a string or an array of items) as canonical items; a 400 naming the first bad one."""
    if isinstance(raw, str):
        return [_message("user", [{"type": "input_text", "text": raw}])]
    if not isinstance(raw, list):
        raise invalid("'input' must be a string or an array of items", "input")
    items = []
    for index, item in enumerate(raw):
        normalized = _normalized_item(item, f"input[{index}]", notes)
        if normalized is not None:
            items.append(normalized)
    return items


def _message(role: str, content: list[dict[str, Any]], item_id: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "message", "role": role, "content": content}
    if item_id is not None:
        message["id"] = item_id
    return message


def _normalized_item(item: Any, where: str, notes: list[str]) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        raise invalid(f"'{where}' must be an item object", where)
    kind = item.get("type", "message")  # a bare {role, content} is a message (EasyInputMessage)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}", f"{where}.role")
        return _message(role, _text_parts(item.get("content"), f"{where}.content", role), _str_or_none(item.get("id")))
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise invalid(f"'{where}.{key}' must be a string", f"{where}.{key}")
        call = {
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
        }
        if isinstance(item.get("namespace"), str) and item["namespace"]:
            call["namespace"] = item["namespace"]
        if isinstance(item.get("id"), str):
            call["id"] = item["id"]
        return call
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise invalid(f"'{where}.call_id' must be the call_id of the function_call it answers", f"{where}.call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else _joined_text(_text_parts(output, f"{where}.output", "tool"))
        return {"type": "function_call_output", "call_id": item["call_id"], "output": text}
    if kind == "reasoning":
        if REASONING_NOTE not in notes:
            notes.append(REASONING_NOTE)
        return None
    if kind == "item_reference":
        raise invalid(
            f"'{where}': item references are not supported; send the item itself, or continue a stored "
            "response with 'previous_response_id'",
            f"{where}.type",
        )
    raise invalid(
        f"'{where}.type' {kind!r} is not supported: prefixd runs no server-side tools and takes messages, "
        "function_call and function_call_output items",
        f"{where}.type",
    )


def _text_parts(content: Any, where: str, role: str) -> list[dict[str, Any]]:
    """Content as text parts (input_text for the client's words, output_text for the assistant's)."""
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": part_type, "text": content}]
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or an array of text parts", where)
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text" if kind != "refusal" else "refusal"), str):
            raise invalid(f"'{where}[{index}]': only text parts are supported, not {kind!r}", f"{where}[{index}].type")
        parts.append({"type": part_type, "text": part["text" if kind != "refusal" else "refusal"]})
    return parts


def _joined_text(parts: list[dict[str, Any]]) -> str:
    return "".join(part["text"] for part in parts)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# -- items -> chat messages -------------------------------------------------------------------


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as prefixd's chat messages (OpenAI chat shapes: tool_calls, tool messages)."""
    system_texts = [instructions] if instructions else []
    start = 0
    while start < len(items) and items[start]["type"] == "message" and items[start]["role"] in SYSTEM_ROLES:
        system_texts.append(_joined_text(items[start]["content"]))
        start += 1
    messages: list[dict[str, Any]] = [{"role": "system", "content": "\n\n".join(system_texts)}] if system_texts else []
    for item in items[start:]:
        if item["type"] == "message":
            role = "system" if item["role"] in SYSTEM_ROLES else item["role"]
            messages.append({"role": role, "content": _joined_text(item["content"])})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": qualified_name(item), "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def qualified_name(call: dict[str, Any]) -> str:
    return f"{call['namespace']}.{call['name']}" if call.get("namespace") else call["name"]


# -- a result -> output items --------------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def function_call_item(
    item_id: str,
    call: dict[str, Any],
    namespaces: frozenset[str],
    status: str = "completed",
    arguments: str | None = None,
) -> dict[str, Any]:
    """prefixd's call map ({id, function: {name, arguments}}) as a function_call item."""
    name = call["function"]["name"]
    namespace, _, bare = name.partition(".")
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": bare if bare and namespace in namespaces else name,
        "arguments": call["function"]["arguments"] if arguments is None else arguments,
    }
    if bare and namespace in namespaces:
        item["namespace"] = namespace
    return item


def output_items(result: dict[str, Any], namespaces: frozenset[str]) -> list[dict[str, Any]]:
    """A finished answer's items: its text as a message (when it has text or no calls), then one item per call."""
    calls = result.get("tool_calls") or []
    items = [message_item(new_item_id("msg"), result["text"])] if result["text"] or not calls else []
    return items + [function_call_item(new_item_id("fc"), call, namespaces) for call in calls]
