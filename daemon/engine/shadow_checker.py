"""The shadow check: the daemon proves its cache while it serves.

A share of finished greedy requests that reused the cache (``--shadow-rate``)
is kept as samples; while the engine has nothing else to do, each is run
again without the cache (shadow_run.py) and the tokens and the prompt's last
log-probabilities are compared. Requests that asked for it (``cache.verify``)
are checked whether the engine is idle or not, one forward pass per engine
iteration beside the real work, and their reply waits for the comparison.

A shadow run never delays a real request by more than one forward pass: the
engine runs a pass only when nothing is queued, and a run paused by real
work resumes later with its own cache. That cache is counted in the KV
budget (``reserve``); when a real request needs the room, the run is dropped.

A mismatch logs one JSON line with what it reused; with ``--shadow-action
stop-reuse`` the model stops reusing that checkpoint kind until restart.
Engine thread only, except ``stats()``'s numbers, which are plain ints.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import structlog

from .sequence_state import SequenceState
from .shadow_run import ShadowOutcome, ShadowRun, ShadowSample

if TYPE_CHECKING:
    from ..models.loaded_model import LoadedModel

log = structlog.get_logger("prefixd.shadow")

SHADOW_ACTIONS = ("log", "stop-reuse")
MAX_PENDING_SAMPLES = 16  # sampled requests waiting for idle time; older ones give way
MAX_COMPARED_TOKENS = 16  # answer tokens compared per sampled request (verify requests: all of them)
OUTCOMES = ("match", "mismatch", "dropped", "failed")


class ShadowChecker:
    def __init__(
        self,
        rate: float,
        action: str,
        chunk_size: int,
        reserve: Callable[[int], bool],
        rng: random.Random | None = None,
        depth_scale: int | None = None,
    ):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow rate {rate} is not between 0 and 1")
        if action not in SHADOW_ACTIONS:
            raise ValueError(f"shadow action {action!r} is not one of {', '.join(SHADOW_ACTIONS)}")
        self.rate = rate
        self.action = action
        self._chunk_size = chunk_size
        self._depth_scale = depth_scale
        self._reserve = reserve  # asks the scheduler for room for the current run's cache (0: none); False: no room
        self._rng = rng or random.Random()
        self._pending: deque[ShadowSample] = deque()
        self._urgent: deque[ShadowSample] = deque()  # verify requests: their replies wait
        self._current: ShadowRun | None = None
        self.counts: dict[str, Counter[str]] = {}  # model -> outcome -> runs
        self._distrusted: dict[str, set[str]] = {}  # model -> checkpoint kinds it no longer reuses
        # The longest single shadow pass since start: the most a real request
        # arriving mid-pass can have waited for the check (bench/probes/shadow_probe.py).
        self.longest_pass_ms = 0.0

    # -- what gets checked -----------------------------------------------------------------

    def wants(self, seq: SequenceState) -> bool:
        """Decided when the first token is sampled: keep this request's prompt logits for a check?"""
        if seq.params.cache.verify:
            return True
        if seq.params.constraint is not None:
            return False  # an unconstrained re-run may legitimately answer otherwise
        return (
            self.rate > 0
            and seq.reused > 0
            and _is_greedy(seq)
            and not seq.job.warm_only
            and self._rng.random() < self.rate
        )

    def keep(self, seq: SequenceState, logits: mx.array | None) -> None:
        """At the first token: mark a request for a check and keep its prompt logits (None: not at hand)."""
        if self.wants(seq):
            seq.shadow_logits = logits
            seq.shadow_wanted = True

    def take_finished(self, seq: SequenceState, emit_reply: Callable[[ShadowOutcome | None], None]) -> bool:
        """A finished request: queue its check. True when its reply now waits for the check (verify)."""
        verify = seq.params.cache.verify
        checkable = seq.shadow_wanted and seq.generated and not seq.is_cancelled and seq.reused > 0
        if not checkable:
            if verify:
                emit_reply(None)  # nothing reused, nothing to compare: the reply says so
            return verify
        sample = ShadowSample(
            request_id=seq.job.request_id,
            loaded=seq.loaded,
            prompt=seq.prompt,
            cached_tokens=list(seq.generated if verify else seq.generated[:MAX_COMPARED_TOKENS]),
            cached_logits=seq.shadow_logits,
            checkpoint=seq.report.checkpoint,
            reused_tokens=seq.reused,
            source=seq.report.source,
            on_done=emit_reply if verify else None,
            cancelled=seq.job.cancelled.is_set,
        )
        if verify:
            self._urgent.append(sample)
            return True
        if len(self._pending) >= MAX_PENDING_SAMPLES:
            oldest = self._pending.popleft()
            self._conclude(oldest, _dropped(oldest, "too many samples waiting for idle time"))
        self._pending.append(sample)
        return False

    # -- running ---------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._current or self._urgent or self._pending)

    @property
    def has_urgent_work(self) -> bool:
        return bool(self._urgent) or (self._current is not None and self._current.sample.on_done is not None)

    def step(self) -> None:
        """One forward pass of the current run (starting the next if none and it fits). Never raises."""
        if self._current is None and not self._start_next():
            return
        run = self._current
        started = time.perf_counter()
        try:
            outcome = run.step()
        except Exception as exc:  # a broken shadow run costs its check, never the engine
            log.exception("shadow_run_failed", request_id=run.sample.request_id, model=run.sample.loaded.name)
            outcome = ShadowOutcome(
                run.sample.request_id, run.sample.loaded.name, "failed", reason=f"{type(exc).__name__}: {exc}"
            )
        self.longest_pass_ms = max(self.longest_pass_ms, (time.perf_counter() - started) * 1000)
        if outcome is not None:
            self._current = None
            self._reserve(0)
            self._conclude(run.sample, outcome)

    def _start_next(self) -> bool:
        queue = self._urgent or self._pending
        while queue and queue[0].cancelled():
            sample = queue.popleft()
            self._conclude(sample, _dropped(sample, "the request was cancelled"))
        if not queue or not self._reserve(queue[0].kv_bytes):
            return False  # nothing to do, or its cache does not fit beside the running requests yet
        self._current = ShadowRun(queue.popleft(), self._chunk_size, self._depth_scale)
        return True

    def drop_current(self, reason: str) -> None:
        """Give the current run's memory back to real requests; a verify request's run goes back in line."""
        run, self._current = self._current, None
        if run is None:
            return
        self._reserve(0)
        if run.sample.on_done is not None:
            self._urgent.appendleft(run.sample)  # its reply waits: it starts again when there is room
        else:
            self._conclude(run.sample, _dropped(run.sample, reason))

    def fail_all(self, reason: str) -> None:
        """The engine gave up on its running requests: the current run ends, waiting verify replies go out."""
        self.drop_current(reason)
        while self._urgent:
            sample = self._urgent.popleft()
            self._conclude(sample, _dropped(sample, reason))

    def drop_model(self, loaded: "LoadedModel", reason: str) -> None:
        """Forget the checks of a model being unloaded: they would hold its weights in memory.

        Only background samples can name an idle model: a verify request's
        reply waits for its check, so its job still pins the model.
        """
        if self._current is not None and self._current.sample.loaded is loaded:
            self.drop_current(reason)
        for sample in [s for s in self._pending if s.loaded is loaded]:
            self._pending.remove(sample)
            self._conclude(sample, _dropped(sample, reason))

    def _conclude(self, sample: ShadowSample, outcome: ShadowOutcome) -> None:
        self.counts.setdefault(outcome.model, Counter())[outcome.status] += 1
        if outcome.status == "mismatch":
            log.error("shadow_mismatch", request_id=outcome.request_id, **outcome.to_wire(), action=self.action)
            if self.action == "stop-reuse" and outcome.checkpoint is not None:
                self._distrusted.setdefault(outcome.model, set()).add(outcome.checkpoint)
                log.warning("shadow_stop_reuse", model=outcome.model, checkpoint=outcome.checkpoint, until="restart")
        if sample.on_done is not None:
            sample.on_done(outcome)

    # -- what it found ---------------------------------------------------------------------

    def distrusts(self, model: str, checkpoint: str | None) -> bool:
        return checkpoint is not None and checkpoint in self._distrusted.get(model, ())

    def stats(self) -> dict:
        return {
            "rate": self.rate,
            "action": self.action,
            "pending": len(self._pending) + len(self._urgent) + (self._current is not None),
            "longest_pass_ms": round(self.longest_pass_ms, 1),
            "per_model": {
                model: {status: counts[status] for status in OUTCOMES} for model, counts in self.counts.items()
            },
            "distrusted": {model: sorted(kinds) for model, kinds in self._distrusted.items()},
        }


def _is_greedy(seq: SequenceState) -> bool:
    from .batch_decoder import MIN_SAMPLING_TEMPERATURE

    return seq.params.temperature < MIN_SAMPLING_TEMPERATURE


def _dropped(sample: ShadowSample, reason: str) -> ShadowOutcome:
    return ShadowOutcome(
        sample.request_id,
        sample.loaded.name,
        "dropped",
        checkpoint=sample.checkpoint,
        reused_tokens=sample.reused_tokens,
        source=sample.source,
        reason=reason,
    )
