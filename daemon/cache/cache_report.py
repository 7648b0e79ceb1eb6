"""The ``cache`` map of a reply: what the prefix store did for one request, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .store_types import Match


class MessageAt(Protocol):
    """A prompt that knows which chat message holds a token (models.prompt_encoding.EncodedPrompt)."""

    message_spans: tuple

    def message_at(self, token_index: int) -> Any: ...


@dataclass
class CacheReport:
    """Filled in by the engine while a request runs; ``to_wire()`` is the reply's ``cache`` map."""

    prompt_tokens: int
    reused_tokens: int = 0
    stored_tokens: int = 0
    hit: str = "miss"  # exact | partial | miss | off
    checkpoint: str | None = None
    age_s: float | None = None
    saved_ms_est: float = 0.0
    miss_reason: str | None = None
    diverged_at: int | None = None
    diverged_message: dict[str, Any] | None = None
    source: str | None = None  # memory | disk: where the reused prefix was computed; None when nothing was reused
    kv: str | None = None  # the model's attention KV, stored and computed: float32, q8 (group 64), ... (--kv-bits)
    in_place_tokens: int = 0  # of reused_tokens, those its fork read in the store's arrays instead of copying (--fork)

    def turn_off(self, reason: str) -> None:
        self.hit, self.miss_reason = "off", reason

    def record_match(self, match: Match, prompt: MessageAt, prefill_tokens_per_s: float) -> None:
        self.reused_tokens = match.length
        self.hit = match.hit
        if match.length:
            self.checkpoint = match.checkpoint_kind
            self.age_s = round(match.age_s, 3) if match.age_s is not None else None
            if prefill_tokens_per_s > 0:
                self.saved_ms_est = round(match.length / prefill_tokens_per_s * 1000, 1)
        if match.hit != "exact":
            self.miss_reason = match.reason
            self.diverged_at = match.matched_tokens
            span = prompt.message_at(match.matched_tokens) if prompt.message_spans else None
            if span is not None:
                self.diverged_message = {"index": span.index, "role": span.role}

    def to_wire(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prompt_tokens - self.reused_tokens,
            "stored_tokens": self.stored_tokens,
            "hit": self.hit,
            "checkpoint": self.checkpoint,
            "age_s": self.age_s,
            "saved_ms_est": self.saved_ms_est,
            "source": self.source,
            "kv": self.kv,
            "in_place_tokens": self.in_place_tokens,
            "miss_reason": self.miss_reason,
            "diverged_at": self.diverged_at,
            "diverged_message": self.diverged_message,
        }
