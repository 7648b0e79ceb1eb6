"""prefixd's own decode batch: rows keep their own caches, join and leave without a copy (--batch-step ragged).

mlx-lm's BatchGenerator merges every row's KV into one left-padded buffer
per layer. A join or a leave then copies every row's KV again, attention
runs over every row's padding, and the batch holds rows x its longest row.
Here each row keeps the cache it came with (kv/ragged_batch_cache.py): one
forward pass runs all rows' linear layers together, and each row attends
over its own keys alone. On this project's CPU a step of 4 rows at equal
depth cost 1.00-1.14x the padded step, 0.58x with one row 4,000 tokens deep
among three 200 deep, and rows joining 4,000 deep 0.2x; on an H100 the
per-row calls made it 1.3-3.1x (bench/probes/ragged_step_probe.py,
bench/results/2026-12-08-h100-ragged).

It answers to the part of BatchGenerator's interface that batch_decoder.py
uses (insert, next, remove, stream), with the same token semantics, so a
row's tokens do not depend on which batch runs it: the token a row joins
with is fed but not handed out (the scheduler handed it out); each step
feeds every row's pending token, samples the next one and hands out the
fed one; a row's cache holds every token handed out; a row finishes on its
max_tokens or a stop sequence. As mlx-lm does, the next step's pass is
queued before this step's tokens are read, so the device works while
Python hands them out.

Decode rows of attention layers only: a conv/SSM state (hybrid models)
stays in mlx-lm's batch, whose model code reads it as one batched array.
Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import StopSequences

from ..kv.ragged_batch_cache import ragged_layers

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class RaggedResponse:
    """One row's token of a step (BatchGenerator's response, the fields batch_decoder reads)."""

    uid: int
    token: int
    finish_reason: str | None  # "length", "stop", or None while it goes on
    prompt_cache: list[Any] | None  # the row's cache when it finished


@dataclass
class _Row:
    uid: int
    cache: list[Any]  # one cache per layer, the row's own
    pending: mx.array  # the token the next step feeds, shape (1,)
    max_tokens: int
    sampler: Sampler
    processors: list[LogitsProcessor]
    matcher: Any  # StopSequences.Matcher
    joined: bool = False  # False until a step fed the token it joined with (handed out before it joined)
    tokens: list[int] = field(default_factory=list)  # handed out by this batch


class RaggedBatch:
    """Decode rows of one model, each over its own cache."""

    def __init__(self, model: Any, sampler: Sampler, stream: Any):
        self._model = model
        self._default_sampler = sampler
        self._stream = stream
        self._rows: list[_Row] = []
        self._next_uid = 0

    @property
    def stream(self) -> Any:
        return self._stream

    def __len__(self) -> int:
        return len(self._rows)

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        caches: list[list[Any]],
        samplers: list[Sampler | None],
        logits_processors: list[list[LogitsProcessor]],
        stop_sequences: list[StopSequences],
    ) -> list[int]:
        """Rows join with one input token each and their caches as they are (not copied)."""
        uids = []
        for inputs, limit, cache, sampler, processors, stop in zip(
            prompts, max_tokens, caches, samplers, logits_processors, stop_sequences, strict=True
        ):
            if len(inputs) != 1:
                raise ValueError(f"a ragged batch row joins with one token, not {len(inputs)} (prefill runs apart)")
            if limit <= 0:
                raise ValueError(f"a row's max_tokens must be > 0, not {limit}")
            if self._rows and len(cache) != len(self._rows[0].cache):
                raise ValueError(f"a row with {len(cache)} cache layers joins rows of {len(self._rows[0].cache)}")
            row = _Row(
                uid=self._next_uid,
                cache=cache,
                pending=mx.array(inputs, dtype=mx.uint32),
                max_tokens=limit,
                sampler=sampler or self._default_sampler,
                processors=list(processors or ()),
                matcher=stop.matcher(),
            )
            self._next_uid += 1
            self._rows.append(row)
            uids.append(row.uid)
        return uids

    def next(self) -> tuple[list[Any], list[RaggedResponse]]:
        """One step of every row; (no prompt responses, one response per row that had a token)."""
        if not self._rows:
            return [], []
        with mx.stream(self._stream):
            return [], self._step()

    def _step(self) -> list[RaggedResponse]:
        rows = self._rows
        inputs = mx.concatenate([row.pending for row in rows])
        logits = self._model(inputs[:, None], cache=ragged_layers([row.cache for row in rows]))[:, -1, :]
        if any(row.processors for row in rows):
            logits = mx.concatenate(
                [self._processed(row, inputs[i : i + 1], logits[i : i + 1]) for i, row in enumerate(rows)]
            )
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [row.sampler for row in rows]
        if all(sampler is samplers[0] for sampler in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate([sampler(logprobs[i : i + 1]) for i, sampler in enumerate(samplers)])
        sampled = sampled.astype(mx.uint32)
        mx.async_eval(sampled)  # the next step's input: queued before this step's tokens are read
        fed = inputs.tolist()  # sampled by the step before (evaluated then), or the joining tokens
        responses, kept = [], []
        for i, row in enumerate(rows):
            row.pending = sampled[i : i + 1]
            if not row.joined:
                row.joined = True  # its joining token: handed out before it joined
                kept.append(row)
                continue
            token = fed[i]
            row.tokens.append(token)
            finish = "length" if len(row.tokens) >= row.max_tokens else None
            if row.matcher.advance(token):
                finish = "stop"
            if finish is None:
                kept.append(row)
            responses.append(RaggedResponse(row.uid, token, finish, row.cache if finish else None))
        self._rows = kept
        return responses

    @staticmethod
    def _processed(row: _Row, fed: mx.array, logits: mx.array) -> mx.array:
        """A row's logits through its processors; their context is the step's input token (all they read)."""
        for processor in row.processors:
            logits = processor(fed, logits)
        return logits

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, tuple[list[Any], list[int]]]:
        """Take rows out; with ``return_prompt_caches``, each one's cache (every token it handed out) and tokens."""
        wanted = set(uids)
        taken = {row.uid: (row.cache, row.tokens) for row in self._rows if row.uid in wanted}
        self._rows = [row for row in self._rows if row.uid not in wanted]
        return taken if return_prompt_caches else {}
