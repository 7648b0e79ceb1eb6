"""One request's state inside the engine, from admission to its final reply.

A SequenceState moves through phases: WAITING (its prompt shares a prefix with
another request that is prefilling it right now; it waits to reuse that
instead of computing it twice), PREFILL (chunks of its prompt are fed
between decode steps), DECODE (it is a row of the model's decode batch),
then DONE. Engine thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ...protocol.methods import FINISH_CANCELLED, GenerateParams
from ..cache import CacheReport, Lease
from ..models.loaded_model import LoadedModel
from ..models.prompt_encoding import EncodedPrompt
from .jobs import CHUNK, DONE, GenerateJob
from .stop_strings import StopStringMatcher


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(eq=False)
class SequenceState:
    """One request inside the engine. Its parameters (``job.params``) stay as they came; what changes is here.

    Each group of fields has one writer: the scheduler (scheduler.py), the
    model runner's prefill and decode code (prefill.py, batch_decoder.py,
    solo_decoder.py, through model_runner.py), and this class's own methods
    (the answer as it goes out).
    """

    job: GenerateJob
    loaded: LoadedModel
    prompt: EncodedPrompt
    report: CacheReport
    # The scheduler's: what this request may do and where it stands.
    max_new_tokens: int = 0  # max_tokens, cut to what the context has room for after the prompt
    uses_cache: bool = True  # cache.use, unless the shadow check distrusted what it would reuse
    phase: Phase = Phase.PREFILL
    waiting_on: "SequenceState | None" = None
    waiting_for: int = 0  # the depth of waiting_on's prompt that must be stored before this one resumes
    kv_bytes_estimate: int = 0
    num_prefill_skips: int = 0  # prefill turns given to others in a row
    shadow_wanted: bool = False  # the shadow check will compare this request (shadow_checker.py)
    shadow_logits: Any = None  # its prompt's last logits, kept for that comparison
    # The runner's: the live cache, the prefill's progress and what the store holds of it.
    lease: Lease | None = None  # the store's lock on the reused prefix
    cache: list[Any] | None = None  # the live cache while prefilling
    reused: int = 0
    # An exact repeat's stored next-token logits (PrefixStore.match's whole_with_logits): the first
    # token is sampled from them, and nothing runs before it.
    stored_logits: Any = None
    reused_in_store: int = 0  # of reused, the tokens its fork reads from the store's arrays (shared_prefix_cache.py)
    # The positions its live cache reads from the store's arrays, so reserves none of: its fork's, or its
    # whole stored prompt once read in place (prefill.read_prompt_in_place).
    reads_in_store: int = 0
    position: int = 0  # tokens fed into the cache so far
    stored_upto: int = 0  # tokens of this sequence the store already holds
    plan: list[tuple[int, str]] = field(default_factory=list)  # remaining (depth, kind) prefill stops
    checkpoints: dict[int, tuple[str, Any]] = field(default_factory=dict)  # not yet handed to the store
    uid: int | None = None  # row id in the decode batch
    sampler: Any = None  # made once per sequence (batch_decoder.sampler_for)
    prefill_started_at: float | None = None
    lookup_seconds: float = 0.0  # store match and fork
    # The answer's (on_token, flush_text, finish).
    generated: list[int] = field(default_factory=list)  # sampled tokens, eos included
    pieces: list[str] = field(default_factory=list)
    num_chunks: int = 0
    completion_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.detokenizer = self.loaded.tokenizer.detokenizer
        self.stops = StopStringMatcher(self.job.params.stop)

    @property
    def tokens(self) -> list[int]:
        return self.prompt.tokens

    @property
    def params(self) -> GenerateParams:
        return self.job.params

    @property
    def grammar(self):
        """The answer's grammar matcher (GrammarState) when the request has a constraint, else None."""
        return self.job.grammar

    @property
    def is_cancelled(self) -> bool:
        return self.job.cancelled.is_set()

    def all_tokens(self) -> list[int]:
        """Prompt plus sampled tokens: what the cache holds, in order."""
        return self.tokens + self.generated

    # -- decoding ------------------------------------------------------------------

    def on_token(self, token: int) -> bool:
        """Take one sampled token; True when a stop string or eos ends the sequence."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.generated.append(token)
        if token in self.loaded.eos_token_ids:
            return True
        self.completion_tokens += 1
        self.detokenizer.add_token(token)
        self._send(self.stops.feed(self.detokenizer.last_segment), [token])
        return self.stops.stopped

    def flush_text(self) -> None:
        """At the end: the detokenizer's and the stop matcher's held-back text."""
        self.detokenizer.finalize()
        tail = "" if self.stops.stopped else self.stops.feed(self.detokenizer.last_segment)
        self._send(tail + self.stops.flush(), [])

    def _send(self, text: str, tokens: list[int]) -> None:
        if not text:
            return
        self.pieces.append(text)
        if self.params.stream:
            self.job.emit(CHUNK, {"id": self.job.msgid, "text": text, "tokens": tokens, "index": self.num_chunks})
            self.num_chunks += 1

    # -- the reply -------------------------------------------------------------------

    def finish(self, finish_reason: str, send: bool = True) -> dict[str, Any]:
        """The final reply; ``send=False`` holds it back for the caller to send (a verify request)."""
        self.phase = Phase.DONE
        self.finish_reason = (
            FINISH_CANCELLED if self.is_cancelled and finish_reason != FINISH_CANCELLED else finish_reason
        )
        self.finished_at = time.monotonic()
        result = self.result()
        self.job.answer_tokens = list(self.generated)
        if send:
            self.job.emit(DONE, result)
        return result

    def result(self) -> dict[str, Any]:
        now = self.finished_at or time.monotonic()
        enqueued = self.job.enqueued_at
        first = self.first_token_at or now
        prefill_started = self.prefill_started_at or self.started_at
        decode_seconds = max(now - first, 0.0)
        num_prompt_tokens = len(self.tokens)
        return {
            "model": self.loaded.name,
            "session": self.params.session,
            "text": "".join(self.pieces),
            "finish_reason": self.finish_reason,
            **({"stop": self.stops.matched} if self.stops.matched is not None else {}),  # the stop string that ended it
            "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": self.completion_tokens},
            "cache": self.report.to_wire(),
            "timings": {
                "queue_ms": _ms(self.started_at - enqueued),  # includes encode_ms
                "encode_ms": _ms(self.prompt.encode_seconds),
                "lookup_ms": _ms(self.lookup_seconds),  # part of prefill_ms
                "ttft_ms": _ms(first - enqueued),
                "prefill_ms": _ms(first - prefill_started),
                "decode_ms": _ms(decode_seconds),
                "total_ms": _ms(now - enqueued),
                "decode_tokens_per_s": round((self.completion_tokens - 1) / decode_seconds, 2)
                if self.completion_tokens > 1 and decode_seconds > 0
                else 0.0,
            },
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
