"""What rank 0 broadcasts once per engine iteration: the inputs that iteration consumes.

Everything the scheduler and the store decide on is either in here or a
function of what came before, so every rank takes the same decisions:
new jobs (with the token ids the front encoded on rank 0: followers never
encode), cancellations, store-changing control calls, and rank 0's clock
reading (the store's recency order, see lockstep.py). Pickled, as mlx-lm's
server shares its requests: the ranks run the same code, from one launcher.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ...protocol.methods import GenerateParams
from ..models.prompt_encoding import EncodedPrompt


@dataclass(frozen=True)
class JobSpec:
    """A GenerateJob as every rank rebuilds it: all of it but the front's callback and flag."""

    job_id: int
    client_id: str
    msgid: int | None
    params: GenerateParams
    warm_only: bool
    encoded: EncodedPrompt | None


@dataclass(frozen=True)
class StoreOp:
    """A control call that changes the store (pin, unpin), run on every rank in the same place."""

    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class IterationInputs:
    number: int  # counts iterations, checked by every rank
    clock: float  # rank 0's time.monotonic() at the start of the iteration: the store's recency clock
    prefill_tokens_per_s: float  # rank 0's measured rate: the store's eviction cost, the same on every rank
    jobs: tuple[JobSpec, ...] = ()
    cancels: tuple[int, ...] = ()  # job ids
    store_ops: tuple[StoreOp, ...] = ()
    stop: str | None = None  # set on the last message: why rank 0 stops

    def encode(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def decode(data: bytes) -> "IterationInputs":
        inputs = pickle.loads(data)
        if not isinstance(inputs, IterationInputs):
            raise TypeError(f"rank 0 sent a {type(inputs).__name__}, not IterationInputs")
        return inputs
