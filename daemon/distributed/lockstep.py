"""The engine every rank runs, in lock-step, driven by what rank 0 broadcasts once per iteration.

``LockstepEngine`` is the single-process ``Engine`` with four things changed:
each rank loads its shard of every model (sharded_loading.py); the loop body
starts with an exchange in which rank 0 sends what this iteration consumes
(new jobs with their token ids, cancellations, store changes made by control
calls, its clock and its measured prefill rate) and every rank sends a digest
of its state, so a rank that went its own way is caught one iteration later;
the store's clock and eviction costs read rank 0's values; and the
scheduler's one clock-based decision (may a prefill pass run beside decoding?)
is rank 0's. Everything else the scheduler and the store decide is a function
of those inputs, so every rank takes the same decisions and every rank's KV
shard sits under the same radix nodes.

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
from typing import Any, Callable

import structlog

from ...protocol.errors import ErrorCode, RpcError
from ..engine.control_calls import ControlCalls
from ..engine.engine import ControlCall, Engine
from ..engine.jobs import DONE, FAILED, GenerateJob
from ..engine.sequence_state import Phase
from ..engine.settings import EngineSettings
from ..models.loaded_model import LoadedModel, load_model
from .channel import Channel, RankLost, RanksDiverged, is_collective_failure
from .handshake import check_peers, code_version, config_digest
from .messages import IterationInputs, JobSpec, StoreOp
from .settings import DistributedSettings
from .sharded_loading import make_sharded_loader
from .watchdog import IterationWatchdog

log = structlog.get_logger("prefixd.distributed")

IDLE_WAIT_SECONDS = 0.25  # rank 0 with nothing to do still sends an (empty) iteration this often: a heartbeat


class LockstepEngine(Engine):
    def __init__(self, settings: EngineSettings, distributed: DistributedSettings):
        super().__init__(settings)
        self.distributed = distributed
        self.controls = LockstepControls(self)
        self.channel: Channel | None = None  # made on the engine thread, the one MLX thread
        self.watchdog = IterationWatchdog(self.abandon)
        self.stop_reason: str | None = None  # why rank 0 stopped the ranks ("stopped": a clean shutdown)
        self._pending: deque[GenerateJob] = deque()  # taken from the inbox, not admitted yet; the same on every rank
        self._jobs: dict[int, GenerateJob] = {}  # job id -> its lock-step copy, until its final event
        self._front_jobs: dict[int, GenerateJob] = {}  # rank 0: job id -> the front's job, until its final event
        self._cancels_sent: set[int] = set()
        self._store_ops: list[StoreOp] = []  # rank 0: store changes made by this iteration's control calls
        self._number = 0
        self._clock = time.monotonic()
        self._agreed_prefill_rate = 0.0
        # A model pass met a lost rank this iteration (is_collective_failure). The engine ends at the
        # iteration's end rather than at the next exchange: after such a failure the ring backend's next
        # collective was seen to hang rather than raise (the watchdog would end it, but only after
        # --rank-timeout). The requests it failed are not answered with the engine's INTERNAL error:
        # their front jobs stay in _front_jobs, which the engine's death answers with ENGINE_DEAD.
        self._collective_error: str | None = None

    # -- start: the group, the handshake, each rank's shard --------------------------------

    def _load_all(self) -> None:
        import mlx.core as mx

        self.watchdog.start()
        self.watchdog.arm(self.distributed.load_timeout_seconds, "connecting the ranks and loading the models")
        try:
            self.channel = Channel(mx.distributed.init(strict=True, backend=self.distributed.backend))
            # Model paths may differ between machines; what they hold may not (configs now, weights below).
            settings = {f"--{key.replace('_', '-')}": value for key, value in dataclasses.asdict(self.settings).items()
                        if key != "model_specs"}
            check_peers(self.channel, "before loading", {
                "prefixd": code_version(), "ranks": self.channel.size, "--parallel": self.distributed.parallel, **settings,
                "model configs": [config_digest(spec) for spec in self.settings.model_specs]})
            super()._load_all()
            # Every model loads now and stays: a load or an unload is a collective (the sharded weights)
            # and would split the ranks unless every rank did it at the same step.
            for name in self.catalog:
                self.residency.ensure_loaded(name, None)
            self.residency.unload_expired = lambda: None  # a request's keep_alive would unload on rank 0 alone
            check_peers(self.channel, "after loading", {
                "models": {name: m.fingerprint for name, m in self.models.items()},
                "kv_bytes_per_token": {name: m.kv_bytes_per_token for name, m in self.models.items()}})
        finally:
            self.watchdog.disarm()
        # Unseeded sampling draws from MLX's global generator: the same seed everywhere, the same tokens.
        mx.random.seed(self.channel.agree(int.from_bytes(os.urandom(4), "little")))
        self.scheduler.agree = self._agree
        # One stream for prefill, decode and the exchanges: each rank's collectives in program order.
        self.scheduler.runner.decode_stream = mx.default_stream(mx.default_device())
        log.info("rank_ready", rank=self.channel.rank, ranks=self.channel.size, pid=os.getpid(),
                 backend=self.distributed.backend, parallel=self.distributed.parallel,
                 blas_threads=os.environ.get("OPENBLAS_NUM_THREADS", "default"))

    def _agree(self, decision: bool) -> bool:
        """The scheduler's clock-based choice (may a prefill pass run beside decoding?), rank 0's for all.

        Asked on every decode step, but it only matters while a sequence is prefilling; otherwise
        every rank answers False (the prefill turn then finds nothing, the same on every rank: the
        phases are part of the state every rank agrees on) without a collective, which would cost
        a synchronous all_sum and a wait for the step computed ahead on every decoded token.
        """
        if not any(seq.phase is Phase.PREFILL for seq in self.scheduler.active):
            return False
        return bool(self.channel.agree(int(decision)))

    def load_one_model(self, spec: str, chat_template: str | None = None) -> LoadedModel:
        return load_model(spec, dtype=self.settings.dtype, attention=self.settings.attention,
                          load_weights=make_sharded_loader(self.channel.group, self.distributed.parallel),
                          chat_template=chat_template)

    def store_clock(self) -> float:
        return self._clock

    def prefill_rate(self) -> float:
        return self._agreed_prefill_rate or 200.0

    # -- the loop body -------------------------------------------------------------------------

    def _serve(self) -> str:
        reason = super()._serve()
        if self.channel.is_leader:
            self._send_stop(reason)
        return reason

    def _iterate(self) -> None:
        self.watchdog.arm(self.distributed.rank_timeout_seconds, f"engine iteration {self._number}")
        try:
            digest = self._state_digest()  # before this iteration's control calls change anything
            payload = self._leader_payload() if self.channel.is_leader else None
            data, digests = self.channel.exchange(payload, digest)
            if any(d != digests[0] for d in digests):
                raise RanksDiverged(f"the ranks' engine states differ after iteration {self._number - 1} "
                                    f"(digests {digests}): their KV shards no longer match")
            inputs = IterationInputs.decode(data)
            if inputs.number != self._number:
                raise RanksDiverged(f"rank 0 sent iteration {inputs.number}, this rank expected {self._number}")
            self._number += 1
            if inputs.stop is not None:
                self.stop_reason = inputs.stop
                self._stopping.set()
                return
            self._apply(inputs)
            self._admit_pending()
            if self.scheduler.has_work:
                try:
                    self.scheduler.step()
                except Exception as exc:  # escaped the scheduler's own handlers: the engine's loop would go on
                    if is_collective_failure(exc):
                        self._collective_error = self._collective_error or f"{type(exc).__name__}: {exc}"
                    else:
                        raise
            if self._collective_error is not None:
                raise RankLost(f"rank {self.channel.rank} of {self.channel.size}: a collective failed during a "
                               f"model pass ({self._collective_error}); another rank exited or lost its connection")
        finally:
            self.watchdog.disarm()

    def _leader_payload(self) -> bytes:
        """Rank 0: this iteration's inputs, encoded. Jobs that cannot travel fail here, alone."""
        inputs = self._leader_inputs()
        try:
            return inputs.encode()
        except Exception as exc:
            for spec in inputs.jobs:
                self._front_jobs.pop(spec.job_id).emit(FAILED, RpcError(
                    ErrorCode.INTERNAL, f"the request could not be sent to the other ranks: {type(exc).__name__}: {exc}"))
            return dataclasses.replace(inputs, jobs=()).encode()

    def _leader_inputs(self) -> IterationInputs:
        """Rank 0: what this iteration consumes. Waits on the inbox (briefly) only when there is nothing to do."""
        self.poll_controls()
        jobs = self._take_jobs()
        cancels = tuple(job_id for job_id, job in self._front_jobs.items()
                        if job.cancelled.is_set() and job_id not in self._cancels_sent)
        if not (jobs or cancels or self._store_ops or self._pending or self.scheduler.has_work
                or self._stopping.is_set()):
            item = self.inbox.take(timeout=IDLE_WAIT_SECONDS)
            if isinstance(item, GenerateJob):
                jobs.append(item)
            elif item is not None:
                item()
        specs = tuple(spec for spec in map(self._forward, jobs) if spec is not None)
        self._cancels_sent.update(cancels)
        store_ops, self._store_ops = tuple(self._store_ops), []
        return IterationInputs(number=self._number, clock=time.monotonic(),
                               prefill_tokens_per_s=Engine.prefill_rate(self),
                               jobs=specs, cancels=cancels, store_ops=store_ops)

    @property
    def iteration_number(self) -> int:
        return self._number

    def record_store_op(self, op: StoreOp) -> None:
        """Rank 0: a control call changed the store; the other ranks make the same change this iteration."""
        self._store_ops.append(op)

    def _take_jobs(self) -> list[GenerateJob]:
        """As many queued jobs as could start now; none while earlier ones still wait (their memory)."""
        if self._pending:
            return []
        jobs = []
        while len(jobs) < self.settings.max_active - len(self.scheduler.active):
            job = self.inbox.take_job()
            if job is None:
                break
            jobs.append(job)
        return jobs

    def _forward(self, job: GenerateJob) -> JobSpec | None:
        if job.params.cache.verify:  # its check re-runs the prompt outside the lock-step
            job.emit(FAILED, RpcError(ErrorCode.INVALID_PARAMS,
                                      "cache.verify is not available on a daemon spanning several ranks"))
            return None
        self._front_jobs[job.job_id] = job
        return JobSpec(job.job_id, job.client_id, job.msgid, job.params, job.warm_only, job.encoded)

    def _apply(self, inputs: IterationInputs) -> None:
        """Every rank: take rank 0's clock, rate, store changes, jobs and cancellations."""
        self._clock = inputs.clock
        self._agreed_prefill_rate = inputs.prefill_tokens_per_s
        if not self.channel.is_leader:  # rank 0 ran these as control calls already
            for op in inputs.store_ops:
                self.controls.replay(op)
        for spec in inputs.jobs:
            job = GenerateJob(spec.client_id, spec.msgid, spec.params, self._emitter(spec.job_id),
                              warm_only=spec.warm_only, encoded=spec.encoded, job_id=spec.job_id)
            front = self._front_jobs.get(spec.job_id)
            if front is not None:
                job.enqueued_at = front.enqueued_at  # the reply's queue time is the front's
            self._jobs[spec.job_id] = job
            self._pending.append(job)
        for job_id in inputs.cancels:
            if job_id in self._jobs:
                self._jobs[job_id].cancel()

    def _emitter(self, job_id: int) -> Callable[[str, Any], None]:
        front = self._front_jobs.get(job_id)

        def emit(kind: str, payload: Any) -> None:
            if (kind == FAILED and getattr(payload, "code", None) == ErrorCode.INTERNAL
                    and is_collective_failure(payload.message)):
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

    def _admit_pending(self) -> None:
        for job in [job for job in self._pending if job.cancelled.is_set()]:
            self._pending.remove(job)
            self.scheduler.admit(job)  # answers CANCELLED and counts it
        while self._pending and self.scheduler.can_admit():
            if not self.scheduler.admit(self._pending[0]):
                return  # its KV does not fit yet: it stays first in line
            self._pending.popleft()

    def _state_digest(self) -> int:
        """What every rank must agree on after an iteration: the sequences, their tokens, the store's size."""
        state = [(s.job.job_id, s.phase.value, s.position, len(s.generated), s.generated[-1:]) for s in self.scheduler.active]
        total = self.store.budget.total
        state.append((len(self._pending), total.num_bytes, total.num_nodes, total.pinned_bytes))
        return int.from_bytes(hashlib.blake2b(repr(state).encode(), digest_size=8).digest(), "little")

    # -- the end ---------------------------------------------------------------------------------

    def _send_stop(self, reason: str) -> None:
        """Rank 0 stopped: tell the others, so they exit too (cleanly, for a shutdown)."""
        self.watchdog.arm(self.distributed.rank_timeout_seconds, "telling the other ranks to stop")
        try:
            stop = IterationInputs(number=self._number, clock=time.monotonic(), prefill_tokens_per_s=0.0, stop=reason)
            self.channel.exchange(stop.encode(), self._state_digest())
        except RankLost as exc:
            log.warning("rank_stop_not_delivered", reason=str(exc))
        finally:
            self.watchdog.stop()

    def _die(self, reason: str) -> None:
        err = self.dead_error()
        while self._pending:
            self._pending.popleft().emit(FAILED, RpcError(err.code, err.message))
        super()._die(reason)  # fails the running ones
        for job in list(self._front_jobs.values()):  # taken from the inbox, lost before the exchange
            job.emit(FAILED, self.dead_error())
        self._front_jobs.clear()

    def abandon(self, reason: str) -> None:
        """The watchdog's verdict (its own thread): the engine thread is stuck in a collective for good.

        Every request the front is waiting on fails now (emit is thread-safe),
        and the owner is told, which ends the process; the stuck thread is left behind.
        """
        self.dead_reason = reason
        err = self.dead_error()
        for job in self.inbox.close(err):
            job.emit(FAILED, self.dead_error())
        for call in self.inbox.drain_controls(err):
            if isinstance(call, ControlCall):
                call.fail(err)
        for job in list(self._front_jobs.values()):
            job.emit(FAILED, self.dead_error())
        if self.on_dead is not None:
            self.on_dead(reason)

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(1.0 if self.dead_reason is not None else timeout)  # an abandoned thread never returns
        self.watchdog.stop()


class LockstepControls(ControlCalls):
    """Control calls that change the store run on every rank: rank 0 records them for the next exchange."""

    def pin_tokens(self, model: str, tokens: list[int], pinned: bool) -> dict[str, Any]:
        self.engine.record_store_op(StoreOp("pin_tokens", (model, tokens, pinned)))
        return super().pin_tokens(model, tokens, pinned)

    def stats(self) -> dict[str, Any]:
        """As on one process (rank 0's store: every rank's holds the same entries), plus the ranks."""
        engine = self.engine
        return {**super().stats(), "ranks": {"num_ranks": engine.channel.size, "backend": engine.distributed.backend,
                                             "parallel": engine.distributed.parallel,
                                             "iterations": engine.iteration_number}}

    def unload_model(self, name: str) -> dict[str, Any]:
        raise RpcError(ErrorCode.INVALID_PARAMS, "a daemon spanning several ranks keeps every model loaded; "
                                                 "it cannot unload one")

    def replay(self, op: StoreOp) -> None:
        """A follower: the store change rank 0 made, with the same outcome (an error included)."""
        try:
            getattr(super(), op.name)(*op.args)
        except RpcError:
            pass  # rank 0 answered it; the same error here changes nothing
