"""What the engine takes in from outside, and where it comes from: its input source.

The engine's loop is the same whatever feeds it. Each iteration it asks its
source for that iteration's inputs (control calls run, new jobs queued,
cancellations, a reason to stop), admits the source's jobs, runs a step,
and with nothing to do waits on the source. The store's clock, the prefill
rate its eviction costs assume, and the one scheduling decision taken from a
clock come from the source too.

Two sources: ``LocalInputs`` (local_inputs.py), one process's inbox and
clock; and the lock-step source of a daemon spanning several ranks
(distributed/lockstep.py), where rank 0 broadcasts every iteration's inputs
and every rank's engine consumes the same ones, so all take the same
decisions. Engine thread only, unless a member says otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager, Iterable, Protocol

if TYPE_CHECKING:
    from ...protocol.errors import RpcError
    from .control_calls import ControlCalls
    from .engine import Engine
    from .inbox import Inbox
    from .jobs import GenerateJob


class InputSource(Protocol):
    inbox: Inbox  # where the fronts put jobs and control calls (any thread)
    # Every model pass runs on the engine thread's default stream: the source's own
    # collectives do, and each rank's must stay in one program order.
    passes_on_default_stream: bool
    # Tokens per second every process's store assumes; None: this process measures its own.
    agreed_prefill_rate: float | None

    def control_calls(self, engine: Engine) -> ControlCalls:
        """The control calls the fronts reach through ``engine.controls``."""

    def loading(self, engine: Engine) -> ContextManager[None]:
        """Around loading the models, at start."""

    def iteration(self) -> ContextManager[None]:
        """Around one iteration of the engine's loop."""

    def receive(self, engine: Engine) -> str | None:
        """This iteration's inputs: control calls run, jobs queued for ``take_job``, cancellations set.

        Returns why the engine must stop now, else None.
        """

    def cancelled_before_admission(self) -> Iterable[GenerateJob]:
        """Queued jobs cancelled before their turn, taken out of the queue: the engine answers them."""

    def take_job(self) -> GenerateJob | None:
        """The next queued job, without waiting."""

    @property
    def has_jobs(self) -> bool:
        """Jobs are queued (a plain read: a stale answer costs one iteration)."""

    def wait(self, timeout: float) -> bool:
        """Nothing to do: wait for inputs, at most ``timeout``; True if some arrived."""

    def store_clock(self) -> float:
        """The prefix store's clock (its recency order)."""

    def agree(self, decision: bool) -> bool:
        """A decision this process took from its clock, as the engine must take it."""

    def end(self, engine: Engine, reason: str) -> None:
        """The loop ended for ``reason``."""

    def fail_taken(self, error: Callable[[], RpcError]) -> None:
        """The engine is dead: fail the jobs this source took that no reply has answered. Any thread."""

    def close(self) -> None:
        """The engine stopped (any thread)."""
