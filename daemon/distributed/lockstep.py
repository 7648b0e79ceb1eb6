"""The lock-step input source: every rank's engine consumes what rank 0 broadcasts once per iteration.

Every rank runs the one-process ``Engine`` (engine/engine.py) on this source
(engine/inputs.py). Each iteration starts with an exchange in which rank 0
sends what the iteration consumes (new jobs with their token ids,
cancellations, store changes made by control calls, its clock and its
measured prefill rate) and every rank sends a digest of its state, so a rank
that went its own way is caught one iteration later. The store's clock and
eviction costs read rank 0's values, and the scheduler's one clock-based
decision (may a prefill pass run beside decoding?) is rank 0's. Everything
else the scheduler and the store decide is a function of those inputs, so
every rank takes the same decisions and every rank's KV shard sits under the
same radix nodes.

Rank 0's fronts, inbox and control calls work as on one process; its jobs are
copied into the lock-step (a copy with its own cancel flag, set only when the
cancellation is broadcast), and the copy's events go to the front's job. The
other ranks (follower.py) have no fronts: their copies' events go nowhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import structlog

from ...protocol.errors import ErrorCode, RpcError
from ..engine.control_calls import ControlCalls
from ..engine.engine import DEFAULT_PREFILL_RATE
from ..engine.inbox import Inbox
from ..engine.jobs import DONE, FAILED, GenerateJob
from .channel import Channel, RankLost, RanksDiverged, is_collective_failure
from .doorbell import Doorbell
from .handshake import check_peers, code_version, config_digest
from .lockstep_controls import LockstepControls
from .messages import IterationInputs, JobSpec, StoreOp
from .settings import DistributedSettings
from .sharded_loading import make_sharded_loader
from .watchdog import IterationWatchdog

if TYPE_CHECKING:
    from ..engine.engine import Engine

log = structlog.get_logger("prefixd.distributed")


class LockstepInputs:
    # One stream for prefill, decode and the exchanges: each rank's collectives in program order.
    passes_on_default_stream = True

    def __init__(self, inbox: Inbox, settings: DistributedSettings):
        self.inbox = inbox  # rank 0's is the fronts'; the other ranks' stays empty
        self.settings = settings
        self.channel: Channel | None = None  # made on the engine thread, the one MLX thread
        self.watchdog: IterationWatchdog | None = None  # started with the load
        self.agreed_prefill_rate = DEFAULT_PREFILL_RATE  # rank 0's, from the first exchange on
        self._pending: deque[GenerateJob] = deque()  # received, not admitted yet; the same on every rank
        self._jobs: dict[int, GenerateJob] = {}  # job id -> its lock-step copy, until its final event
        self._front_jobs: dict[int, GenerateJob] = {}  # rank 0: job id -> the front's job, until its final event
        self._cancels_sent: set[int] = set()
        self._store_ops: list[StoreOp] = []  # rank 0: store changes made by this iteration's control calls
        self._number = 0
        self._clock = time.monotonic()
        # A model pass met a lost rank this iteration (is_collective_failure). The engine ends at the
        # iteration's end rather than at the next exchange: after such a failure the ring backend's next
        # collective was seen to hang rather than raise (the watchdog would end it, but only after
        # --rank-timeout). The requests it failed are not answered with the engine's INTERNAL error:
        # their front jobs stay in _front_jobs, which the engine's death answers with ENGINE_DEAD.
        self._collective_error: str | None = None
        self._controls: LockstepControls | None = None  # replays rank 0's store changes on the other ranks

    def control_calls(self, engine: Engine) -> ControlCalls:
        self._controls = LockstepControls(engine, self)
        return self._controls

    # -- start: the group, the handshake, each rank's shard --------------------------------

    @contextmanager
    def loading(self, engine: Engine) -> Iterator[None]:
        """Join the group and compare the peers around the load; then seed every rank's sampling alike."""
        import mlx.core as mx

        self.watchdog = IterationWatchdog(engine.abandon)
        self.watchdog.start()
        self.watchdog.arm(self.settings.load_timeout_seconds, "connecting the ranks and loading the models")
        try:
            group = mx.distributed.init(strict=True, backend=self.settings.backend)
            self.channel = Channel(group, Doorbell.from_environment(group.rank(), group.size()))
            # Model paths may differ between machines; what they hold may not (configs now, weights below).
            settings = {
                f"--{key.replace('_', '-')}": value
                for key, value in dataclasses.asdict(engine.settings).items()
                if key != "model_specs"
            }
            check_peers(
                self.channel,
                "before loading",
                {
                    "prefixd": code_version(),
                    "ranks": self.channel.size,
                    "--parallel": self.settings.parallel,
                    **settings,
                    "model configs": [config_digest(spec) for spec in engine.settings.model_specs],
                },
            )
            yield
            check_peers(
                self.channel,
                "after loading",
                {
                    "models": {name: m.fingerprint for name, m in engine.models.items()},
                    "kv_bytes_per_token": {name: m.kv_bytes_per_token for name, m in engine.models.items()},
                    # Forks that share reserve less: ranks must agree, or their admissions would part ways.
                    "fork": {name: m.fork for name, m in engine.models.items()},
                    "batch_step": {name: m.batch_step for name, m in engine.models.items()},
                },
            )
        finally:
            self.watchdog.disarm()
        # Unseeded sampling draws from MLX's global generator: the same seed everywhere, the same tokens.
        mx.random.seed(self.channel.agree(int.from_bytes(os.urandom(4), "little")))
        log.info(
            "rank_ready",
            rank=self.channel.rank,
            ranks=self.channel.size,
            pid=os.getpid(),
            backend=self.settings.backend,
            parallel=self.settings.parallel,
            blas_threads=os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        )

    def load_shard(self, path: str) -> tuple[Any, Any]:
        """This rank's shard of a model (sharded_loading.py), over the group joined at start."""
        return make_sharded_loader(self.channel.group, self.settings.parallel)(path)

    def agree(self, decision: bool) -> bool:
        """Rank 0's answer, on every rank."""
        return bool(self.channel.agree(int(decision)))

    def store_clock(self) -> float:
        return self._clock

    # -- every iteration ---------------------------------------------------------------------

    @contextmanager
    def iteration(self) -> Iterator[None]:
        """The watchdog around it; a collective that failed in it (a lost rank) ends the engine at its end."""
        self.watchdog.arm(self.settings.rank_timeout_seconds, f"engine iteration {self._number}")
        try:
            try:
                yield
            except Exception as exc:  # the engine's loop would fail the running requests and go on
                if not is_collective_failure(exc):
                    raise
                self._collective_error = self._collective_error or f"{type(exc).__name__}: {exc}"
            if self._collective_error is not None:
                raise RankLost(
                    f"rank {self.channel.rank} of {self.channel.size}: a collective failed during a "
                    f"model pass ({self._collective_error}); another rank exited or lost its connection"
                )
        finally:
            self.watchdog.disarm()

    def receive(self, engine: Engine) -> str | None:
        digest = self._state_digest(engine)  # before this iteration's control calls change anything
        payload = self._leader_payload(engine) if self.channel.is_leader else None
        data, digests = self.channel.exchange(payload, digest)
        if any(d != digests[0] for d in digests):
            raise RanksDiverged(
                f"the ranks' engine states differ after iteration {self._number - 1} "
                f"(digests {digests}): their KV shards no longer match"
            )
        inputs = IterationInputs.decode(data)
        if inputs.number != self._number:
            raise RanksDiverged(f"rank 0 sent iteration {inputs.number}, this rank expected {self._number}")
        self._number += 1
        if inputs.stop is not None:
            return inputs.stop
        self._apply(inputs)
        return None

    def cancelled_before_admission(self) -> Iterable[GenerateJob]:
        cancelled = [job for job in self._pending if job.cancelled.is_set()]
        for job in cancelled:
            self._pending.remove(job)
        return cancelled

    def take_job(self) -> GenerateJob | None:
        return self._pending.popleft() if self._pending else None

    @property
    def has_jobs(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout: float) -> bool:
        """Rank 0 waits on its inbox (the next exchange then is the heartbeat); the others wait in that exchange."""
        if not self.channel.is_leader or self._unsent_cancels():
            return False
        return self.inbox.wait(timeout)

    @property
    def iteration_number(self) -> int:
        return self._number

    def record_store_op(self, op: StoreOp) -> None:
        """Rank 0: a control call changed the store; the other ranks make the same change this iteration."""
        self._store_ops.append(op)

    def _leader_payload(self, engine: Engine) -> bytes:
        """Rank 0: this iteration's inputs, encoded. Jobs that cannot travel fail here, alone."""
        inputs = self._leader_inputs(engine)
        try:
            return inputs.encode()
        except Exception as exc:
            for spec in inputs.jobs:
                self._front_jobs.pop(spec.job_id).emit(
                    FAILED,
                    RpcError(
                        ErrorCode.INTERNAL,
                        f"the request could not be sent to the other ranks: {type(exc).__name__}: {exc}",
                    ),
                )
            return dataclasses.replace(inputs, jobs=()).encode()

    def _leader_inputs(self, engine: Engine) -> IterationInputs:
        """Rank 0: what this iteration consumes: its control calls run, the jobs that could start, the cancellations."""
        self.inbox.run_controls()
        specs = tuple(spec for spec in map(self._forward, self._take_jobs(engine)) if spec is not None)
        cancels = self._unsent_cancels()
        self._cancels_sent.update(cancels)
        store_ops, self._store_ops = tuple(self._store_ops), []
        return IterationInputs(
            number=self._number,
            clock=time.monotonic(),
            prefill_tokens_per_s=engine.measured_prefill_rate(),
            jobs=specs,
            cancels=cancels,
            store_ops=store_ops,
        )

    def _unsent_cancels(self) -> tuple[int, ...]:
        return tuple(
            job_id
            for job_id, job in self._front_jobs.items()
            if job.cancelled.is_set() and job_id not in self._cancels_sent
        )

    def _take_jobs(self, engine: Engine) -> list[GenerateJob]:
        """As many queued jobs as could start now; none while earlier ones still wait (their memory)."""
        if self._pending or engine.holds_job:
            return []
        jobs = []
        while len(jobs) < engine.settings.max_active - len(engine.scheduler.active):
            job = self.inbox.take_job()
            if job is None:
                break
            jobs.append(job)
        return jobs

    def _forward(self, job: GenerateJob) -> JobSpec | None:
        if job.params.cache.verify:  # its check re-runs the prompt outside the lock-step
            job.emit(
                FAILED,
                RpcError(ErrorCode.INVALID_PARAMS, "cache.verify is not available on a daemon spanning several ranks"),
            )
            return None
        self._front_jobs[job.job_id] = job
        return JobSpec(job.job_id, job.client_id, job.msgid, job.params, job.warm_only, job.encoded)

    def _apply(self, inputs: IterationInputs) -> None:
        """Every rank: take rank 0's clock, rate, store changes, jobs and cancellations."""
        self._clock = inputs.clock
        self.agreed_prefill_rate = inputs.prefill_tokens_per_s
        if not self.channel.is_leader:  # rank 0 ran these as control calls already
            for op in inputs.store_ops:
                self._controls.replay(op)
        for spec in inputs.jobs:
            front = self._front_jobs.get(spec.job_id)
            job = GenerateJob(
                spec.client_id,
                spec.msgid,
                spec.params,
                self._emitter(spec.job_id),
                warm_only=spec.warm_only,
                encoded=spec.encoded,
                job_id=spec.job_id,
                # the reply's queue time is the front's
                enqueued_at=front.enqueued_at if front is not None else time.monotonic(),
            )
            self._jobs[spec.job_id] = job
            self._pending.append(job)
        for job_id in inputs.cancels:
            if job_id in self._jobs:
                self._jobs[job_id].cancel()

    def _emitter(self, job_id: int) -> Callable[[str, Any], None]:
        front = self._front_jobs.get(job_id)

        def emit(kind: str, payload: Any) -> None:
            if (
                kind == FAILED
                and getattr(payload, "code", None) == ErrorCode.INTERNAL
                and is_collective_failure(payload.message)
            ):
                # A lost rank, not this request's fault: the front's job waits for the engine's death
                # (ENGINE_DEAD, at the end of this iteration), like every other running request.
                self._collective_error = self._collective_error or payload.message
                self._jobs.pop(job_id, None)
                return
            if kind in (DONE, FAILED):
                copy = self._jobs.pop(job_id, None)
                self._front_jobs.pop(job_id, None)
                self._cancels_sent.discard(job_id)
                if front is not None and copy is not None:
                    front.answer_tokens = copy.answer_tokens  # the fronts remember a tool loop's answer (tool_calls.py)
            if front is not None:
                front.emit(kind, payload)

        return emit

    def _state_digest(self, engine: Engine) -> int:
        """What every rank must agree on after an iteration: the sequences, their tokens, the store's size."""
        state = [
            (s.job.job_id, s.phase.value, s.position, len(s.generated), s.generated[-1:])
            for s in engine.scheduler.active
        ]
        total = engine.store.budget.total
        state.append((len(self._pending) + engine.holds_job, total.num_bytes, total.num_nodes, total.pinned_bytes))
        return int.from_bytes(hashlib.blake2b(repr(state).encode(), digest_size=8).digest(), "little")

    # -- the end ---------------------------------------------------------------------------------

    def end(self, engine: Engine, reason: str) -> None:
        """Rank 0 stopped: tell the others, so they exit too (cleanly, for a shutdown)."""
        if not self.channel.is_leader:
            return
        self.watchdog.arm(self.settings.rank_timeout_seconds, "telling the other ranks to stop")
        try:
            stop = IterationInputs(number=self._number, clock=time.monotonic(), prefill_tokens_per_s=0.0, stop=reason)
            self.channel.exchange(stop.encode(), self._state_digest(engine))
        except RankLost as exc:
            log.warning("rank_stop_not_delivered", reason=str(exc))
        finally:
            self.watchdog.stop()

    def fail_taken(self, error: Callable[[], RpcError]) -> None:
        """Copies not admitted yet (each answers its front job), then front jobs lost before the exchange."""
        while self._pending:
            self._pending.popleft().emit(FAILED, error())
        for job in list(self._front_jobs.values()):
            job.emit(FAILED, error())
        self._front_jobs.clear()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
