"""One shadow run: a finished request computed again without the prefix cache, and the comparison.

The cached run reused stored KV (a fork of the store's segments, maybe a
state snapshot) and prefilled only its tail; the shadow run starts from an
empty cache and prefills the whole prompt with the passes an uncached
request would have (the same plan_prefill stops and next_stops grouping), then
decodes greedily. If the store is right, the two agree token for token and
the prompt's last logits agree up to float rounding.

A run advances one forward pass per ``step()``, so the engine can stop
between passes the moment real work arrives. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from ..kv.fork import live_cache
from ..models.loaded_model import LoadedModel
from ..models.prompt_encoding import EncodedPrompt
from .prefill import next_stops, plan_prefill, system_prompt_ends

# The logit check compares log-probabilities of the uncached run's most likely
# tokens: the tail of a vocabulary is where low-precision rounding is largest
# and matters least.
TOP_LOGPROBS_COMPARED = 8

# How far (in nats) the prompt's last log-probabilities may drift between a
# cached and an uncached run before it counts as a mismatch. A cached run
# computes its tail in passes of other shapes than an uncached one, so some
# rounding difference is expected; a corrupted entry moves them by whole nats.
# Healthy drift measures far below these (docs/decisions.md), except under
# --kv-bits with OpenBLAS (logit_tolerance).
LOGIT_TOLERANCE_NATS = {"float32": 1e-3}
LOW_PRECISION_TOLERANCE_NATS = 0.1  # float16, bfloat16, quantized weights and --kv-bits


def logit_tolerance(dtype: str, kv_bits: int = 0) -> float:
    """--kv-bits: a float rounding that differs with the pass's shape (OpenBLAS: 1e-6) moves a value across a
    quantization step now and then, as low precision does (docs/prefix-cache.md).

    Measured on SmolLM2 float32 with OpenBLAS over the `prefixd verify` requests (bench/kv_bits.py shadow,
    bench/results/2026-12-06-kv-bits): a warm hit's top 8 drift from the uncached re-run's by up to 0.087 nats
    at 8 bits, inside this tolerance, and by up to 1.76 at 4 bits, where most greedy answers also change
    within 4-13 tokens: no tolerance makes the 4-bit check pass, its token comparison fails first.
    """
    return LOW_PRECISION_TOLERANCE_NATS if kv_bits else LOGIT_TOLERANCE_NATS.get(dtype, LOW_PRECISION_TOLERANCE_NATS)


@dataclass(eq=False)
class ShadowSample:
    """What a cached run produced, kept for its comparison."""

    request_id: str
    loaded: LoadedModel
    prompt: EncodedPrompt
    cached_tokens: list[int]  # the cached run's first answer tokens (its end token included)
    cached_logits: mx.array | None  # the prompt's last logits in the cached run (None: not kept)
    checkpoint: str | None  # the reused checkpoint's kind (the reply's cache.checkpoint)
    reused_tokens: int
    source: str | None  # memory | disk
    on_done: Callable[["ShadowOutcome"], None] | None = None  # a verify request's reply waits for this
    cancelled: Callable[[], bool] = field(default=lambda: False)

    @property
    def kv_bytes(self) -> int:
        """What the shadow run's cache can grow to."""
        num_tokens = len(self.prompt.tokens) + len(self.cached_tokens)
        return num_tokens * self.loaded.kv_bytes_per_token + self.loaded.state_bytes_per_sequence


@dataclass(frozen=True)
class ShadowOutcome:
    request_id: str
    model: str
    status: str  # match | mismatch | dropped | failed
    compared_tokens: int = 0
    first_difference: int | None = None  # answer token index where the runs first differ
    cached_token: int | None = None
    uncached_token: int | None = None
    max_logprob_difference: float | None = None
    tolerance: float | None = None
    checkpoint: str | None = None
    reused_tokens: int = 0
    source: str | None = None
    reason: str | None = None  # why dropped or failed

    def to_wire(self) -> dict[str, Any]:
        """The reply's ``verify`` map (and the mismatch log line's fields)."""
        return {key: value for key, value in self.__dict__.items() if key != "request_id"}


class ShadowRun:
    def __init__(self, sample: ShadowSample, chunk_size: int, depth_scale: int | None = None):
        self.sample = sample
        self._loaded = sample.loaded
        self._tokens = sample.prompt.tokens
        self._chunk_size = chunk_size
        self._depth_scale = depth_scale
        self._cache = live_cache(self._loaded.model, self._loaded.layout)  # round-trips KV as the cached run did
        self._position = 0
        # The uncached plan: the stops a cache-less request's prefill would make.
        self._plan = plan_prefill(0, len(self._tokens) - 1, chunk_size, sample.prompt)
        self._next_input: int | None = None  # the answer token to feed next, once decoding
        self._uncached_tokens: list[int] = []
        self._logprob_difference: float | None = None

    @property
    def is_hybrid(self) -> bool:
        return self._loaded.layout.is_hybrid

    def step(self) -> ShadowOutcome | None:
        """One forward pass; the outcome once the comparison is decided."""
        if self._plan:
            logits = self._prefill_pass()
            if logits is None:
                return None
            self._logprob_difference = self._compare_logits(logits)
            return self._take(logits)
        if self._next_input is None:  # the prompt's last token still to run (hybrid models, 1-token prompts)
            logits = self._forward(self._tokens[self._position :])
            self._position = len(self._tokens)
            self._logprob_difference = self._compare_logits(logits)
            return self._take(logits)
        return self._take(self._forward([self._next_input]))

    def _prefill_pass(self) -> mx.array | None:
        """Mirrors prefill.prefill_step: the last pass of an attention model takes the last token along."""
        stops = next_stops(
            self._plan,
            self._position,
            self._chunk_size,
            self.is_hybrid,
            system_prompt_ends(self.sample.prompt),
            self._depth_scale,
        )
        depth = stops[-1][0]
        takes_last = not self._plan and not self.is_hybrid and depth == len(self._tokens) - 1
        run_to = depth + 1 if takes_last else depth
        logits = self._forward(self._tokens[self._position : run_to], evaluate_cache=not takes_last)
        self._position = run_to
        return logits if takes_last else None

    def _forward(self, tokens: list[int], evaluate_cache: bool = False) -> mx.array:
        logits = self._loaded.model(mx.array(tokens)[None], cache=self._cache)[:, -1, :]
        mx.eval([logits] + ([c.state for c in self._cache] if evaluate_cache else []))
        return logits

    def _take(self, logits: mx.array) -> ShadowOutcome | None:
        """The uncached run's next greedy token, compared with the cached run's."""
        token = int(mx.argmax(logits, axis=-1).item())
        index = len(self._uncached_tokens)
        self._uncached_tokens.append(token)
        expected = self.sample.cached_tokens[index]
        if token != expected:
            return self._outcome("mismatch", index, expected, token)
        if index + 1 == len(self.sample.cached_tokens):
            return self._outcome(self._logit_verdict())
        self._next_input = token
        return None

    def _compare_logits(self, uncached: mx.array) -> float | None:
        cached = self.sample.cached_logits
        return None if cached is None else top_logprob_difference(uncached, cached)

    def _logit_verdict(self) -> str:
        if self._logprob_difference is None:
            return "match"
        return (
            "match"
            if self._logprob_difference <= logit_tolerance(self._loaded.dtype, self._loaded.layout.kv_bits)
            else "mismatch"
        )

    def _outcome(
        self, status: str, index: int | None = None, cached: int | None = None, uncached: int | None = None
    ) -> ShadowOutcome:
        sample = self.sample
        difference = self._logprob_difference
        return ShadowOutcome(
            request_id=sample.request_id,
            model=self._loaded.name,
            status=status,
            compared_tokens=len(self._uncached_tokens),
            first_difference=index,
            cached_token=cached,
            uncached_token=uncached,
            max_logprob_difference=None if difference is None else round(difference, 6),
            tolerance=logit_tolerance(self._loaded.dtype, self._loaded.layout.kv_bits),
            checkpoint=sample.checkpoint,
            reused_tokens=sample.reused_tokens,
            source=sample.source,
        )


def top_logprob_difference(uncached: mx.array, cached: mx.array) -> float:
    """The largest difference of log-probabilities over the uncached run's most likely tokens."""
    uncached_lp = _logprobs(uncached)
    cached_lp = _logprobs(cached)
    top = mx.argsort(-uncached_lp, axis=-1)[..., :TOP_LOGPROBS_COMPARED]
    difference = mx.abs(mx.take_along_axis(uncached_lp, top, axis=-1) - mx.take_along_axis(cached_lp, top, axis=-1))
    return float(mx.max(difference).item())


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
