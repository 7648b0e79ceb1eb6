"""Anthropic request fields that steer Claude's service rather than the answer: each honoured, accepted or refused.

Coding agents send them on every request (Claude Code 2.1: ``thinking``
adaptive, ``context_management``, ``output_config.effort``,
``metadata.user_id``, an ``anthropic-beta`` header; tests/fixtures/claude_code),
so refusing them all would lock the agents out. The rule, field by field from
Anthropic's documentation:

* a field that only labels the request, hints, or asks for a feature the
  model cannot use is accepted, left out, and named in the reply's
  ``prefixd_notes`` (and once per client in the log);
* a field whose effect prefixd gives is honoured (``output_config.format``:
  structured outputs, through constrained decoding);
* a field that would change the answer and is not honoured is a 400 naming it.

Pure data, no I/O.
"""

from __future__ import annotations

from typing import Any

from .http_errors import invalid, reject_unknown

THINKING_TYPES = ("enabled", "adaptive", "disabled")
THINKING_FIELDS = ("type", "budget_tokens", "display")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Clearing thinking blocks clears nothing here: prefixd never writes them, and refuses them in a request.
NO_EFFECT_EDITS = ("clear_thinking_20251015",)
SERVICE_TIERS = ("auto", "standard_only")


def hint_notes(body: dict[str, Any], beta_header: str | None) -> list[str]:
    """Notes on the hints of ``body`` (and the ``anthropic-beta`` header) accepted without effect; a 400 for the rest."""
    notes = []
    for name, check in (
        ("thinking", _thinking),
        ("context_management", _context_management),
        ("service_tier", _service_tier),
    ):
        if body.get(name) is not None:
            notes += check(body[name])
    if body.get("output_config") is not None:
        notes += _output_config_effort(_object(body["output_config"], "output_config"), "output_config")
    if beta_header:
        notes.append(
            f"anthropic-beta ({beta_header}): a beta switches on features through their own fields, "
            "which prefixd checks one by one; the header itself changes nothing here"
        )
    return notes


def output_constraint(body: dict[str, Any]) -> dict[str, Any] | None:
    """``output_config.format`` (Anthropic's structured outputs) as a generate's constraint; None when absent.

    Honoured, not noted: constrained decoding makes every answer match the schema, as Anthropic promises.
    """
    config = body.get("output_config")
    if config is None:
        return None
    reject_unknown(_object(config, "output_config"), ("effort", "format"), "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    where = "output_config.format"
    reject_unknown(_object(fmt, where), ("type", "schema"), where)
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid(f"'{where}' must be {{type: \"json_schema\", schema: {{...}}}}", where)
    return {"json_schema": fmt["schema"]}


def _thinking(thinking: Any) -> list[str]:
    # A thinking phase (a budget, or adaptive) is a feature of Claude's: prefixd's models answer as they always
    # do, and their reply has no thinking blocks, which Anthropic's clients read as "nothing was thought".
    reject_unknown(_object(thinking, "thinking"), THINKING_FIELDS, "thinking")
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise invalid('\'thinking.type\' must be "enabled", "adaptive" or "disabled"', "thinking.type")
    if kind == "enabled" and (
        not isinstance(thinking.get("budget_tokens"), int) or isinstance(thinking.get("budget_tokens"), bool)
    ):
        raise invalid("'thinking.budget_tokens' must be an integer with type \"enabled\"", "thinking.budget_tokens")
    if kind == "disabled":
        return []
    return [
        f"thinking ({kind}): prefixd's models have no separate thinking phase to switch on; the model answers "
        "as it always does and the reply has no thinking blocks"
    ]


def _context_management(config: Any) -> list[str]:
    # Server-side edits of the conversation before the model reads it. Clearing thinking blocks has nothing to
    # clear; clearing tool results (or compacting) would change what the model reads, so it is refused.
    reject_unknown(_object(config, "context_management"), ("edits",), "context_management")
    edits = config.get("edits") or []
    if not isinstance(edits, list):
        raise invalid("'context_management.edits' must be an array", "context_management.edits")
    for index, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in NO_EFFECT_EDITS:
            place = f"context_management.edits[{index}].type"
            raise invalid(
                f"'{place}' {kind!r} is not supported: prefixd does not edit the conversation (that would "
                "change what the model reads); send it as the model should read it",
                place,
            )
    return (
        [
            f"context_management ({', '.join(edit['type'] for edit in edits)}): nothing to clear, prefixd "
            "writes no thinking blocks"
        ]
        if edits
        else []
    )


def _output_config_effort(config: dict[str, Any], where: str) -> list[str]:
    # Effort tunes how many tokens Claude spends; a model without that control answers as it would at any effort.
    if "task_budget" in config:
        # Anthropic shows the model a countdown of the budget: a change to what it reads, which prefixd does not make.
        raise invalid(
            f"'{where}.task_budget' is not supported: the model would see a countdown prefixd does not write",
            f"{where}.task_budget",
        )
    effort = config.get("effort")
    if effort is None:
        return []
    if effort not in EFFORTS:
        raise invalid(f"'{where}.effort' must be one of {', '.join(EFFORTS)}", f"{where}.effort")
    return [f"{where}.effort ({effort}): prefixd's models have no effort control; the answer is the same at any effort"]


def _service_tier(tier: Any) -> list[str]:
    if tier not in SERVICE_TIERS:
        raise invalid(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}", "service_tier")
    return [f"service_tier ({tier}): prefixd has one tier"]


def system_message_notes(message: dict[str, Any], where: str) -> list[str]:
    """A mid-conversation system message's own ``output_config`` (effort only, per Anthropic) as notes."""
    if message.get("output_config") is None:
        return []
    config = _object(message["output_config"], f"{where}.output_config")
    reject_unknown(config, ("effort",), f"{where}.output_config")
    return _output_config_effort(config, f"{where}.output_config")


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"'{where}' must be an object", where)
    return value
