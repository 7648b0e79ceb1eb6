"""Human-readable one-liners and tables for the command line.

Kept apart from cli.py so that other front ends (editor plugins, scripts)
print the same cache line, and so it can be tested without a daemon. Every
function tolerates missing keys: a newer or older daemon must not crash it.
"""

from __future__ import annotations

import time
from typing import Any

_HIT_LABELS = {"exact": "exact hit", "partial": "partial hit", "miss": "miss", "off": "off"}
_MISS_REASONS = {
    "empty": "nothing stored yet",
    "no-checkpoint": "no reusable checkpoint",
    "max-length": "the last prompt token always runs",
    "disabled": "cache disabled for this request",
    "unsupported-cache": "this model's cache layers cannot be stored",
}


def format_cache_line(result: dict[str, Any]) -> str:
    """One line for stderr: hit kind, token figures, why it missed, ttft and speed.

    e.g. ``cache: partial hit, reused 1,204 of 1,310 prompt tokens (prefilled
    106, stored 131) · diverged at token 1204, message 3 (user) · ttft 0.21 s ·
    38.5 tok/s``
    """
    cache = result.get("cache") or {}
    timings = result.get("timings") or {}
    hit = cache.get("hit")
    parts = [
        f"cache: {_HIT_LABELS.get(hit, hit or 'unknown')}, "
        f"reused {_count(cache.get('reused_tokens'))} of {_count(cache.get('prompt_tokens'))} prompt tokens "
        f"(prefilled {_count(cache.get('prefilled_tokens'))}, stored {_count(cache.get('stored_tokens'))})"
    ]
    if cache.get("source") == "disk":  # worth saying: a restart did not cost the warm cache
        parts.append("from the disk cache")
    if hit != "exact" and (reason := describe_miss(cache)):
        parts.append(reason)
    if timings.get("ttft_ms") is not None:
        parts.append(f"ttft {timings['ttft_ms'] / 1000:.2f} s")
    if timings.get("decode_tokens_per_s"):
        parts.append(f"{timings['decode_tokens_per_s']:.1f} tok/s")
    return " · ".join(parts)


def describe_miss(cache: dict[str, Any]) -> str | None:
    """Why (part of) the prompt was not reused, in words; None when there is nothing to say."""
    reason = cache.get("miss_reason")
    if reason not in (None, "diverged", "extends"):  # empty store, disabled ...: no position to tell
        return _MISS_REASONS.get(reason, reason)
    if cache.get("diverged_at") is None:
        return None
    # "extends": the prompt runs on past a stored sequence (a next chat turn), it did not disagree.
    verb = "went past the stored prompt" if reason == "extends" else "diverged"
    text = f"{verb} at token {cache['diverged_at']}"
    message = cache.get("diverged_message")
    if isinstance(message, dict):
        text += f", message {message.get('index')} ({message.get('role')})"
    return text


def format_models(result: dict[str, Any]) -> str:
    """One line per configured model, with whether it is loaded now; the default one is starred."""
    lines = []
    for model in result.get("models") or []:
        mark = "*" if model.get("default") else " "
        kind = "hybrid" if model.get("hybrid") else "kv"
        tools = (
            f"tools {model['tools']}  " if model.get("tools") else ""
        )  # template, generic or none (older daemons: absent)
        lines.append(
            f"{mark} {model.get('name')}  ctx {_count(model.get('context_length'))}  {model.get('dtype')}  "
            f"{kind}  {tools}{_residency(model)}  {model.get('path')}"
        )
    return "\n".join(lines) if lines else "(no models configured)"


def _residency(model: dict[str, Any]) -> str:
    """'loaded 513 MiB, until 14:05:09' / 'loaded 513 MiB, kept' / 'not loaded' (older daemons say neither)."""
    if "loaded" not in model:
        return "loaded"  # a daemon from before models on demand loads every model at start
    if not model["loaded"]:
        return "not loaded"
    size = f"loaded {model.get('resident_bytes', 0) / (1 << 20):.0f} MiB"
    expires_at = model.get("expires_at")
    if expires_at is None:
        return f"{size}, in use" if model.get("active_jobs") else f"{size}, kept"
    return f"{size}, until {time.strftime('%H:%M:%S', time.localtime(expires_at))}"


def format_stats(stats: dict[str, Any]) -> str:
    """Nested stats flattened to ``a.b.c: value`` lines; sizes in MiB, counts with separators."""
    return "\n".join(f"{key}: {_value(key, value)}" for key, value in _flatten(stats))


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            items.extend(_flatten(value, name + "."))
        else:
            items.append((name, value))
    return items


def _value(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "-"
    if isinstance(value, (int, float)) and key.endswith("bytes"):
        return f"{value / (1 << 20):,.1f} MiB"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"
