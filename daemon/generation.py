"""One generate request, start to finish, on the engine thread.

The steps: encode the prompt; ask the prefix store for the longest usable
prefix and fork a private cache from it; prefill the rest in chunks that end
on checkpoints (chunk multiples, chat-message ends, the prompt's end); decode;
then give the store what was computed (attention KV of the new tokens, state
snapshots at the checkpoints, and the answer's end, so the next chat turn
reuses the answer it just got).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from ..protocol.methods import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP
from .cache_report import CacheReport
from .jobs import CHUNK, GenerateJob
from .kv_payloads import capture_segment, capture_snapshot, fork_cache
from .loaded_model import EncodedPrompt, LoadedModel
from .stop_strings import StopStringMatcher

CHECKPOINT_PRIORITY = {"prompt-end": 3, "message": 2, "chunk": 1}


@dataclass
class PrefillPlan:
    """Where prefill pauses: every stop is a checkpoint the store may keep."""

    stops: list[tuple[int, str]]  # (depth, kind), ascending

    @classmethod
    def make(cls, start: int, end: int, chunk_size: int, prompt: EncodedPrompt) -> "PrefillPlan":
        kinds: dict[int, str] = {}

        def add(depth: int, kind: str) -> None:
            if start < depth <= end and CHECKPOINT_PRIORITY[kind] > CHECKPOINT_PRIORITY.get(kinds.get(depth, ""), 0):
                kinds[depth] = kind

        # Chunk boundaries are absolute multiples, so a cold run and a warm
        # run cut the same prompt at the same places.
        for depth in range((start // chunk_size + 1) * chunk_size, end + 1, chunk_size):
            add(depth, "chunk")
        for span in prompt.message_spans:
            add(span.end_token, "message")
        add(end, "prompt-end")
        return cls(sorted(kinds.items()))


class GenerationRun:
    """Runs one job against one model; ``run()`` returns the final result map."""

    def __init__(self, job: GenerateJob, model: LoadedModel, store: Any, chunk_size: int, poll: Callable[[], None]):
        self.job = job
        self.params = job.params
        self.loaded = model
        self.store = store
        self.chunk_size = chunk_size
        self.poll = poll
        self.started_at = time.monotonic()
        self.num_fed = 0
        self.checkpoints: dict[int, tuple[str, Any]] = {}

    def run(self) -> dict[str, Any]:
        params, loaded = self.params, self.loaded
        prompt = loaded.encode(params.prompt)
        tokens = prompt.tokens
        loaded.check_length(len(tokens) + (0 if self.job.warm_only else 1))
        report = CacheReport(prompt_tokens=len(tokens))
        lease = self._lookup(prompt, report)
        try:
            match = lease
            reused = match.length if match is not None else 0
            cache = fork_cache(
                loaded.model,
                loaded.layout,
                list(match.segments) if match else [],
                match.snapshot if match else None,
                reused,
            )
            self.num_fed = reused
            prefill_started = time.monotonic()
            finished_prefill = self._prefill(cache, tokens, reused, prompt)
            all_tokens = list(tokens)
            if self.job.warm_only or not finished_prefill:
                outcome = _Outcome(text="", finish_reason=FINISH_CANCELLED if not finished_prefill else FINISH_STOP)
                prefill_seconds = time.monotonic() - prefill_started
                loaded.note_prefill_rate(self.num_fed - reused, prefill_seconds)
                outcome.first_token_at = time.monotonic()
            else:
                outcome = self._decode(cache, tokens, all_tokens)
                prefill_seconds = outcome.first_token_at - prefill_started
                loaded.note_prefill_rate(len(tokens) - reused, prefill_seconds)
            report.stored_tokens = self._store(cache, all_tokens, reused, len(tokens))
        finally:
            if lease is not None and self.store is not None:
                self.store.release(lease.lease)
        return self._result(outcome, report, len(tokens), prefill_seconds)

    # -- cache lookup -------------------------------------------------------------

    def _lookup(self, prompt: EncodedPrompt, report: CacheReport):
        loaded, options = self.loaded, self.params.cache
        if self.store is None or not loaded.layout.is_supported:
            report.turn_off("unsupported-cache")
            return None
        if not options.use:
            report.turn_off("disabled")
            return None
        match = self.store.match(
            loaded.fingerprint,
            prompt.tokens,
            max_length=len(prompt.tokens) - 1,
            requires_snapshot=loaded.layout.is_hybrid,
        )
        report.record_match(match, prompt, loaded.prefill_tokens_per_s)
        return match

    # -- prefill ------------------------------------------------------------------

    def _prefill(self, cache: list[Any], tokens: list[int], start: int, prompt: EncodedPrompt) -> bool:
        """Feed tokens[start:-1], pausing at checkpoints; False if cancelled on the way."""
        plan = PrefillPlan.make(start, len(tokens) - 1, self.chunk_size, prompt)
        position = start
        hybrid = self.loaded.layout.is_hybrid
        for depth, kind in plan.stops:
            self.loaded.model(mx.array(tokens[position:depth])[None], cache=cache)
            mx.eval([c.state for c in cache])
            self.num_fed = position = depth
            self.checkpoints[depth] = (kind, capture_snapshot(cache, self.loaded.layout) if hybrid else None)
            self.poll()
            if self.job.cancelled.is_set():
                return False
        return True

    # -- decode -------------------------------------------------------------------

    def _decode(self, cache: list[Any], tokens: list[int], all_tokens: list[int]) -> "_Outcome":
        params, loaded = self.params, self.loaded
        if params.seed is not None:
            mx.random.seed(params.seed)
        sampler = make_sampler(params.temperature, params.top_p if params.top_p < 1.0 else 0.0)
        model = loaded.model

        def step(token: mx.array) -> mx.array:
            logits = model(token.reshape(1, -1), cache=cache)[:, -1, :]
            self.num_fed += token.size
            if params.temperature == 0:
                return mx.argmax(logits, axis=-1)
            return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

        detokenizer = loaded.tokenizer.detokenizer
        stops = StopStringMatcher(params.stop)
        outcome = _Outcome()
        pieces: list[str] = []
        num_chunks = 0
        y = step(mx.array(tokens[-1:]))
        mx.async_eval(y)
        while True:
            num_sampled = len(all_tokens) - len(tokens)
            # Queue the next step before reading this token, so the device
            # works while Python detokenizes and sends (as mlx-lm does).
            next_y = None
            if num_sampled + 1 < params.max_tokens:
                next_y = step(y)
                mx.async_eval(next_y)
            token = int(y.item())
            if outcome.first_token_at is None:
                outcome.first_token_at = time.monotonic()
            all_tokens.append(token)
            if token in loaded.eos_token_ids:
                outcome.finish_reason = FINISH_STOP
                break
            outcome.completion_tokens += 1
            detokenizer.add_token(token)
            text = stops.feed(detokenizer.last_segment)
            if text and params.stream:
                self.job.emit(CHUNK, {"id": self.job.msgid, "text": text, "tokens": [token], "index": num_chunks})
                num_chunks += 1
            pieces.append(text)
            if stops.stopped:
                outcome.finish_reason = FINISH_STOP
                break
            if outcome.completion_tokens >= params.max_tokens or next_y is None:
                outcome.finish_reason = FINISH_LENGTH
                break
            self.poll()
            if self.job.cancelled.is_set():
                outcome.finish_reason = FINISH_CANCELLED
                break
            y = next_y
        detokenizer.finalize()
        tail = ("" if stops.stopped else stops.feed(detokenizer.last_segment)) + stops.flush()
        if tail:
            pieces.append(tail)
            if params.stream:
                self.job.emit(CHUNK, {"id": self.job.msgid, "text": tail, "tokens": [], "index": num_chunks})
        outcome.text = "".join(pieces)
        outcome.decode_done_at = time.monotonic()
        return outcome

    # -- store ----------------------------------------------------------------------

    def _store(self, cache: list[Any], all_tokens: list[int], reused: int, num_prompt_tokens: int) -> int:
        """Hand the new KV and checkpoints to the store; returns the tokens it added."""
        if self.store is None or not self.params.cache.store or not self.loaded.layout.is_supported:
            return 0
        depth = self.num_fed
        if depth <= reused:
            return 0
        mx.eval([c.state for c in cache])
        if depth > num_prompt_tokens - 1 and depth not in self.checkpoints:
            self.checkpoints[depth] = ("answer-end", capture_snapshot(cache, self.loaded.layout))
        segment = capture_segment(cache, self.loaded.layout, reused, depth)
        result = self.store.insert(self.loaded.fingerprint, all_tokens[:depth], reused, segment, self.checkpoints)
        return result.stored_tokens

    def _result(self, outcome: "_Outcome", report: CacheReport, num_prompt_tokens: int, prefill_seconds: float) -> dict:
        now = time.monotonic()
        enqueued = self.job.enqueued_at
        first = outcome.first_token_at or now
        decode_seconds = max((outcome.decode_done_at or now) - first, 0.0)
        result = {
            "model": self.loaded.name,
            "session": self.params.session,
            "text": outcome.text,
            "finish_reason": outcome.finish_reason,
            "usage": {"prompt_tokens": num_prompt_tokens, "completion_tokens": outcome.completion_tokens},
            "cache": report.to_wire(),
            "timings": {
                "queue_ms": round((self.started_at - enqueued) * 1000, 3),
                "ttft_ms": round((first - enqueued) * 1000, 3),
                "prefill_ms": round(prefill_seconds * 1000, 3),
                "decode_ms": round(decode_seconds * 1000, 3),
                "total_ms": round((now - enqueued) * 1000, 3),
                "decode_tokens_per_s": round((outcome.completion_tokens - 1) / decode_seconds, 2)
                if outcome.completion_tokens > 1 and decode_seconds > 0
                else 0.0,
            },
        }
        return result


@dataclass
class _Outcome:
    text: str = ""
    finish_reason: str = FINISH_LENGTH
    completion_tokens: int = 0
    first_token_at: float | None = None
    decode_done_at: float | None = None
