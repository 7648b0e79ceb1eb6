"""What the front hands the engine, and what comes back.

The front and the engine meet only through these objects: a job goes in
through the engine's inbox; events come back through the job's ``emit``
callback, which the engine calls on its own thread and which hops onto the
event loop (``loop.call_soon_threadsafe``). Cancellation is a flag the engine
reads between prefill chunks and decode steps.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.methods import GenerateParams
from ..models.prompt_encoding import EncodedPrompt

if TYPE_CHECKING:
    from ..grammar import GrammarState

_job_counter = itertools.count(1)

# Event kinds passed to emit(kind, payload)
CHUNK = "chunk"  # payload: chunk map (generate.chunk notification params)
DONE = "done"  # payload: final result map
FAILED = "failed"  # payload: RpcError


@dataclass(eq=False)
class GenerateJob:
    """A generate (or, with ``warm_only``, a cache.warm) request on its way through the engine."""

    client_id: str  # the connection: its queue limit and its requests' ids
    msgid: int | None
    params: GenerateParams
    emit: Callable[[str, Any], None]
    warm_only: bool = False
    # Who the engine shares its admissions fairly between (inbox.py); None: the connection. HTTP clients
    # open a connection per request, so their connections share one lane per host and client program.
    lane: str | None = None
    encoded: EncodedPrompt | None = None  # the prompt as the front encoded it (else the engine encodes it)
    # The answer's matcher under params.constraint, compiled off the engine thread
    # (Engine.submit; the inline runner compiles at admission). None: unconstrained.
    grammar: "GrammarState | None" = None
    # The tokens the model sampled (end token included), set on the engine thread before DONE is emitted:
    # the front encodes the next turn of a tool loop with them (PromptEncoder.remember_answer).
    answer_tokens: list[int] | None = None
    # Set when the front ended the answer itself (a stop sequence it matches, an infill rule) and cancelled the rest:
    # why. The engine ends such a job "cancelled"; Handlers.run_job reports it as a stop.
    stopped_by_front: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)
    job_id: int = field(default_factory=lambda: next(_job_counter))

    @property
    def fair_lane(self) -> str:
        return self.lane or self.client_id

    @property
    def request_id(self) -> str:
        return f"{self.client_id}:{self.msgid}"

    def cancel(self) -> None:
        self.cancelled.set()


def internal_error(exc: BaseException, what: str = "internal error") -> RpcError:
    """The INTERNAL error a request gets when the engine failed on it; the log has the traceback."""
    return RpcError(ErrorCode.INTERNAL, f"{what}: {type(exc).__name__}: {exc}")
