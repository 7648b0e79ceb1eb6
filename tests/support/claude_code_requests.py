"""Claude Code's real request bodies (tests/fixtures/claude_code), and the same shapes cut to fit a tiny model.

The bodies are 87 KB (25 tools); a tiny test model's context holds 8192 tokens.
``fitted`` keeps every field, block, message and role as Claude Code sent
them and shortens only the long texts (instructions, tool descriptions, the
agents list) and the tool list, so a replay exercises the real shape.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "claude_code"
BILLING_PREFIX = "x-anthropic-billing-header:"
KEPT_TOOLS = ("Bash", "Read", "Edit")


def load_request(name: str) -> dict[str, Any]:
    """A captured body: first_turn, tool_loop_turn1, tool_loop_turn2 or title_request."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def load_headers() -> dict[str, str]:
    return json.loads((FIXTURES / "headers.json").read_text())["headers"]


def fitted(body: dict[str, Any], max_chars: int = 1200, model: str | None = None) -> dict[str, Any]:
    """``body`` with long texts cut to ``max_chars``, only the KEPT_TOOLS (descriptions cut too), and ``model``."""
    body = copy.deepcopy(body)
    for block in body.get("system") or []:
        block["text"] = block["text"][:max_chars]
    for message in body["messages"]:
        if isinstance(message["content"], str):
            message["content"] = message["content"][:max_chars]
            continue
        for block in message["content"]:
            if block.get("type") == "text":
                block["text"] = block["text"][:max_chars]
    body["tools"] = [{**tool, "description": tool["description"][: max_chars // 4]}
                     for tool in body.get("tools") or [] if tool["name"] in KEPT_TOOLS]
    if model is not None:
        body["model"] = model
    return body


def billing_line(body: dict[str, Any]) -> str:
    first = body["system"][0]["text"]
    assert first.startswith(BILLING_PREFIX), first
    return first


def with_billing_line(body: dict[str, Any], line: str) -> dict[str, Any]:
    """``body`` with its first system block (the billing line) replaced by ``line``."""
    body = copy.deepcopy(body)
    billing_line(body)
    body["system"][0]["text"] = line
    return body
