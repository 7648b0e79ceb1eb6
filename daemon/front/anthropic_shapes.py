"""Anthropic's Messages API shapes (https://docs.anthropic.com/en/api/messages), to and from prefixd's.

Pure data, no I/O (``anthropic_api`` runs it). Every request field is
honoured, accepted where it cannot change the answer (named in
``prefixd_notes``; ``anthropic_fields`` decides, field by field), or refused
with a 400 naming it. Tools, tool choice and
tool blocks are translated in ``anthropic_tools``; a reply's tool calls are
``tool_use`` blocks (stop reason "tool_use"), streamed as a block each. ``usage`` splits the prompt as Anthropic does:
``input_tokens`` were computed for this request, ``cache_read_input_tokens``
came from the prefix store (prefixd caches every prefix by itself, so it
never reports ``cache_creation_input_tokens``); the full cache map rides
along as ``prefixd_cache``, with ``normalized`` naming what was taken out of
the prompt before templating (``agent_prompts``: Claude Code's billing line).

A ``system``-role message inside ``messages`` (Anthropic's mid-conversation
system messages; Claude Code sends its list of agents and skills so) is a
system message where it stands, as the model's template writes one.

``stop_sequences`` are the generate's stop strings: the engine ends the
answer before the first one and its result names it (``stop``), which the
reply gives as ``stop_sequence``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ...protocol import methods as m
from ...protocol.tools import FINISH_TOOL_CALLS
from . import request_fields
from .anthropic_fields import hint_notes, output_constraint, system_message_notes
from .anthropic_tools import CACHE_CONTROL_NOTE, assistant_message, generate_tool_fields, has_tool_blocks, user_messages
from .field_kinds import check_field_kinds
from .http_errors import invalid, reject_unknown
from .sampling_fields import check_sampling_extras

MESSAGE_FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "tools",
    "tool_choice",
    "thinking",
    "cache_control",
    "context_management",
    "output_config",
    "service_tier",
)
COUNT_FIELDS = (
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "cache_control",
    "context_management",
    "output_config",
)
TEXT_BLOCK_FIELDS = ("type", "text", "cache_control", "citations")
ROLES = ("user", "assistant", "system")
_STOP_REASONS = {m.FINISH_STOP: "end_turn", m.FINISH_LENGTH: "max_tokens", FINISH_TOOL_CALLS: "tool_use"}

# The top-level system prompt -> (it as the model should read it, the names of what was taken out): agent_prompts
NormalizeSystem = Callable[[Any], tuple[Any, list[str]]]


def _as_is(system: Any) -> tuple[Any, list[str]]:
    return system, []


@dataclass
class MessagesRequest:
    params: m.GenerateParams
    model: str
    notes: list[str] = field(default_factory=list)
    normalized: list[str] = field(default_factory=list)  # what was taken out of the prompt (prefixd_cache.normalized)
    system_in_messages: bool = False  # a system-role message inside 'messages'


def messages_request(
    body: dict[str, Any], default_model: str, beta_header: str | None = None, normalize_system: NormalizeSystem = _as_is
) -> MessagesRequest:
    reject_unknown(body, MESSAGE_FIELDS)
    check_field_kinds(body)
    notes = hint_notes(body, beta_header)
    normalized: list[str] = []
    messages = prompt_messages(body, notes, normalize_system, normalized)
    tool_fields = generate_tool_fields(body, notes)
    if body.get("max_tokens") is None:
        raise invalid("'max_tokens' is required", "max_tokens")
    if body.get("metadata") is not None:
        if not isinstance(body["metadata"], dict):
            raise invalid("'metadata' must be an object", "metadata")
        reject_unknown(body["metadata"], ("user_id",), "metadata")
        notes.append("metadata.user_id: recorded nowhere, no effect on the answer")
    sampling = request_fields.generate_fields(body, request_fields.FieldNames(seed=None, stop="stop_sequences"))
    # The engine always streams to the front here: a streamed reply and a whole one read the answer alike.
    generate: dict[str, Any] = {"messages": messages, "stream": True, **sampling, **tool_fields}
    if body.get("model") is not None:
        generate["model"] = body["model"]
    if (constraint := output_constraint(body)) is not None:
        generate["constraint"] = constraint
    notes += check_sampling_extras(
        {"top_k": body.get("top_k")}, request_fields.temperature(body.get("temperature"), "temperature")
    )
    params = m.parse_generate(generate)
    return MessagesRequest(
        params,
        params.model or default_model,
        notes,
        normalized,
        any(message["role"] == "system" for message in messages[1:]),
    )


def prompt_messages(
    body: dict[str, Any],
    notes: list[str],
    normalize_system: NormalizeSystem = _as_is,
    normalized: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The chat as prefixd's messages: the system prompt first, then the turns (tool blocks as tool calls and results).

    ``normalize_system`` may take parts out of the top-level system prompt
    (their names go to ``normalized``); system-role messages inside
    ``messages`` stay where they are.
    """
    if body.get("cache_control") is not None:  # the request-wide breakpoint of automatic caching
        notes.append(CACHE_CONTROL_NOTE)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty array of {role, content} objects", "messages")
    messages = []
    if body.get("system") is not None:
        system, taken_out = normalize_system(body["system"])
        if normalized is not None:
            normalized += taken_out
        if system or not taken_out:  # a system prompt that was only a billing line leaves none
            messages.append({"role": "system", "content": _text_of(system, "system", notes)})
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with 'role' and 'content'", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f'\'{where}.role\' must be "user", "assistant" or "system"', f"{where}.role")
        reject_unknown(
            message, ("role", "content", "output_config") if role == "system" else ("role", "content"), where
        )
        content, text_of = message.get("content"), lambda blocks, place: _text_of(blocks, place, notes)
        if role == "system":
            notes += system_message_notes(message, where)
            messages.append({"role": "system", "content": text_of(content, f"{where}.content")})
        elif has_tool_blocks(content) and role == "assistant":
            messages.append(assistant_message(content, f"{where}.content", text_of, notes))
        elif has_tool_blocks(content):
            messages += user_messages(content, f"{where}.content", text_of, notes)
        else:
            messages.append({"role": role, "content": text_of(content, f"{where}.content")})
    if messages[-1]["role"] == "assistant":
        raise invalid(
            "a last assistant message (prefilling the answer) is not supported yet; end with a user message",
            f"messages[{len(raw) - 1}]",
        )
    return messages


def _text_of(content: Any, where: str, notes: list[str]) -> str:
    """A string, or text blocks joined; any other block is refused, naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or an array of content blocks", where)
    texts = []
    for index, block in enumerate(content):
        place = f"{where}[{index}]"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid(f"'{place}.type': only text blocks are supported, not {kind!r}", f"{place}.type")
        reject_unknown(block, TEXT_BLOCK_FIELDS, place)
        if block.get("citations"):
            raise invalid(f"'{place}.citations' is not supported", f"{place}.citations")
        if block.get("cache_control") is not None and CACHE_CONTROL_NOTE not in notes:
            notes.append(CACHE_CONTROL_NOTE)
        texts.append(block["text"])
    return "".join(texts)


# -- replies --------------------------------------------------------------------------


class MessagesReply:
    def __init__(self, model: str, notes: list[str], normalized: list[str] | None = None):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.notes = notes
        self.normalized = normalized or []
        self._num_blocks = 0  # content blocks started so far in a streamed reply
        self._text_open = False  # the last one started is a text block not yet stopped

    @staticmethod
    def stop_reason(result: dict[str, Any]) -> str:
        return (
            "stop_sequence"
            if result.get("stop") is not None
            else _STOP_REASONS.get(result["finish_reason"], "end_turn")
        )

    @staticmethod
    def usage(result: dict[str, Any]) -> dict[str, Any]:
        cache = result["cache"]
        return {
            "input_tokens": cache["prefilled_tokens"],
            "output_tokens": result["usage"]["completion_tokens"],
            "cache_read_input_tokens": cache["reused_tokens"],
            "cache_creation_input_tokens": 0,
        }

    def _extras(self, result: dict[str, Any]) -> dict[str, Any]:
        cache = {**result["cache"], "normalized": self.normalized} if self.normalized else result["cache"]
        extras = {"prefixd_cache": cache, "prefixd_timings": result["timings"]}
        return {**extras, "prefixd_notes": self.notes} if self.notes else extras

    def message(self, result: dict[str, Any], text: str) -> dict[str, Any]:
        calls = result.get("tool_calls") or []
        content = ([{"type": "text", "text": text}] if text or not calls else []) + [_tool_use(call) for call in calls]
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason(result),
            "stop_sequence": result.get("stop"),
            "usage": self.usage(result),
            **self._extras(result),
        }

    # streamed: message_start, content_block_start, content_block_delta..., content_block_stop, message_delta, message_stop

    def start_events(self, prompt_tokens: int) -> list[dict[str, Any]]:
        # The split into computed and cached tokens is known only at the end (message_delta's usage):
        # message_start counts the whole prompt as input.
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        self._num_blocks, self._text_open = 1, True
        return [
            {"type": "message_start", "message": message},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ]

    def text_events(self, text: str) -> list[dict[str, Any]]:
        """A piece of text: in the open text block, or in a new one after a tool_use block."""
        events = []
        if not self._text_open:
            events.append(
                {
                    "type": "content_block_start",
                    "index": self._num_blocks,
                    "content_block": {"type": "text", "text": ""},
                }
            )
            self._num_blocks, self._text_open = self._num_blocks + 1, True
        return events + [
            {
                "type": "content_block_delta",
                "index": self._num_blocks - 1,
                "delta": {"type": "text_delta", "text": text},
            }
        ]

    def tool_use_events(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole tool call (prefixd's call map) as its own block: start, its input as one input_json_delta, stop."""
        events = self._close_text()
        index = self._num_blocks
        self._num_blocks += 1
        block = {**_tool_use(call), "input": {}}  # Anthropic starts a tool_use with empty input, then streams it
        return events + [
            {"type": "content_block_start", "index": index, "content_block": block},
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]},
            },
            {"type": "content_block_stop", "index": index},
        ]

    def end_events(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason(result), "stop_sequence": result.get("stop")},
            "usage": self.usage(result),
            **self._extras(result),
        }
        return self._close_text() + [delta, {"type": "message_stop"}]

    def _close_text(self) -> list[dict[str, Any]]:
        if not self._text_open:
            return []
        self._text_open = False
        return [{"type": "content_block_stop", "index": self._num_blocks - 1}]


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A call map of prefixd's (arguments as JSON text) as an Anthropic tool_use block (input as an object)."""
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }
