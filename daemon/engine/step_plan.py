"""What the scheduler asks the model runner to do, and what comes back: plain data, no MLX.

The scheduler (scheduler.py) decides; the runner (model_runner.py) runs the
forward passes, samples and stores; the scheduler then applies the result
(its bookkeeping: phases, turns, the KV budget, the replies). A step of the
engine is a few such plans in a row (decode, short tails, one prefill pass),
each followed by the plan its result calls for (rows that leave, answers to
store, first tokens joining the batch), so every decision is taken on the
state the previous one left. Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ...protocol.errors import RpcError

if TYPE_CHECKING:
    from .batch_decoder import StepEvent
    from .sequence_state import SequenceState


@dataclass(frozen=True)
class StartPrefill:
    """Look the prompt up in the store and fork a private cache from what it reuses (none unless ``seq.uses_cache``).

    ``distrusted``: the checkpoint kind a first lookup reused and the shadow
    check caught giving wrong output; this lookup runs without the cache.
    """

    seq: SequenceState
    distrusted: str | None = None


@dataclass(frozen=True)
class PrefillPass:
    """One forward pass over the prompt's tokens ``[seq.position, run_to)``, checkpoints at ``stops``.

    No stops: nothing to feed (the store held all but the last token).
    ``samples_first``: the prompt is done after this pass; sample the first
    answer token from its last logits. ``stores``: hand what the pass computed
    to the prefix store now; False: the next pass that stores takes it along,
    in one segment without these stops (Scheduler._stores_pass).
    ``reads_prompt_in_place``: once the prompt is stored, the live cache reads
    it from the store and gives its own copy back (Scheduler._reads_prompt_in_place).
    ``stores_last_logits``: a warm-only request's last pass; then run the
    prompt's last token and store its logits (Scheduler._warm_stores_last_logits).
    """

    seq: SequenceState
    stops: tuple[tuple[int, str], ...]
    run_to: int
    samples_first: bool
    stores: bool = True
    reads_prompt_in_place: bool = False
    stores_last_logits: bool = False


@dataclass(frozen=True)
class Join:
    """The sequence joins its model's decode batch after its first token, for ``max_new_tokens`` more."""

    seq: SequenceState
    token: int
    max_new_tokens: int


@dataclass(frozen=True)
class Finish:
    """A sequence ends: out of its batch (``leaves_batch``), its prompt + answer stored from ``cache`` (None: nothing)."""

    seq: SequenceState
    reason: str
    cache: list[Any] | None = None
    leaves_batch: bool = False


@dataclass
class StepPlan:
    """One round of device work, run in this order: drops, finishes, starts, joins, decode, prefill."""

    drops: list[SequenceState] = field(default_factory=list)  # failed sequences: their rows leave the batch
    finishes: list[Finish] = field(default_factory=list)
    starts: list[StartPrefill] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)  # models whose decode batch takes one step
    prefill: list[PrefillPass] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.drops or self.finishes or self.starts or self.joins or self.decode or self.prefill)

    def forget(self, seq: SequenceState) -> None:
        """Drop the work planned for a sequence that failed meanwhile (its row still leaves the batch)."""
        self.finishes = [f for f in self.finishes if f.seq is not seq]
        self.starts = [s for s in self.starts if s.seq is not seq]
        self.joins = [j for j in self.joins if j.seq is not seq]
        self.prefill = [p for p in self.prefill if p.seq is not seq]


@dataclass(frozen=True)
class Prefilled:
    """A pass ran. ``token``: the first answer token, when the plan asked for it; ``logits``: the ones it came from."""

    seq: SequenceState
    token: int | None = None
    logits: Any = None


@dataclass
class StepResult:
    started: list[StartPrefill] = field(default_factory=list)
    prefilled: list[Prefilled] = field(default_factory=list)
    tokens: list[StepEvent] = field(default_factory=list)  # every decode step's, in order
    finished: list[Finish] = field(default_factory=list)  # out of the batch, answer stored
    failures: list[tuple[SequenceState, RpcError]] = field(default_factory=list)  # work that raised (logged)
    dropped_models: list[tuple[str, RpcError]] = field(default_factory=list)  # decode batches that broke


class Runner(Protocol):
    """What the scheduler needs of the device side (model_runner.ModelRunner; a fake in the unit tests)."""

    def run(self, plan: StepPlan) -> StepResult: ...

    def forget_model(self, name: str) -> None: ...

    def reset(self) -> None: ...
