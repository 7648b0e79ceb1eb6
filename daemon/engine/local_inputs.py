"""One process's inputs (engine/inputs.py): the inbox its fronts fill, its own clock and measured prefill rate."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, ContextManager, Iterable

from ...protocol.errors import RpcError
from .control_calls import ControlCalls
from .inbox import Inbox
from .jobs import GenerateJob

if TYPE_CHECKING:
    from .engine import Engine


class LocalInputs:
    passes_on_default_stream = False  # each decode batch may have a stream of its own
    agreed_prefill_rate = None  # the store assumes the rate this process measures

    def __init__(self, inbox: Inbox):
        self.inbox = inbox

    def control_calls(self, engine: Engine) -> ControlCalls:
        return ControlCalls(engine)

    def loading(self, engine: Engine) -> ContextManager[None]:
        return nullcontext()

    def iteration(self) -> ContextManager[None]:
        return nullcontext()

    def receive(self, engine: Engine) -> str | None:
        self.inbox.run_controls()
        return None  # the engine stops through Engine.stop alone

    def cancelled_before_admission(self) -> Iterable[GenerateJob]:
        return ()  # the inbox answers a queued job's cancellation itself (Engine.cancel)

    def take_job(self) -> GenerateJob | None:
        return self.inbox.take_job()  # round-robin across clients

    @property
    def has_jobs(self) -> bool:
        return self.inbox.has_jobs

    def wait(self, timeout: float) -> bool:
        return self.inbox.wait(timeout)

    def store_clock(self) -> float:
        return time.monotonic()

    def agree(self, decision: bool) -> bool:
        return decision

    def end(self, engine: Engine, reason: str) -> None:
        pass  # nobody else to tell: the engine's owner learns it from the engine

    def fail_taken(self, error: Callable[[], RpcError]) -> None:
        pass  # every job it handed out is held, parked or running: the engine answers those

    def close(self) -> None:
        pass  # it holds no thread or connection of its own
