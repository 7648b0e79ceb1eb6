"""Control calls across ranks: those that change the store run on every rank, in the same iteration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...protocol.errors import ErrorCode, RpcError
from ..engine.control_calls import ControlCalls
from .messages import StoreOp

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from .lockstep import LockstepInputs


class LockstepControls(ControlCalls):
    """Rank 0 records a store change for the next exchange; the other ranks replay it from there."""

    def __init__(self, engine: "Engine", ranks: "LockstepInputs"):
        super().__init__(engine)
        self.ranks = ranks

    def pin_tokens(self, model: str, tokens: list[int], pinned: bool) -> dict[str, Any]:
        self.ranks.record_store_op(StoreOp("pin_tokens", (model, tokens, pinned)))
        return super().pin_tokens(model, tokens, pinned)

    def stats(self) -> dict[str, Any]:
        """As on one process (rank 0's store: every rank's holds the same entries), plus the ranks."""
        ranks = self.ranks
        return {
            **super().stats(),
            "ranks": {
                "num_ranks": ranks.channel.size,
                "backend": ranks.settings.backend,
                "parallel": ranks.settings.parallel,
                "iterations": ranks.iteration_number,
            },
        }

    def unload_model(self, name: str) -> dict[str, Any]:
        raise RpcError(
            ErrorCode.INVALID_PARAMS, "a daemon spanning several ranks keeps every model loaded; it cannot unload one"
        )

    def replay(self, op: StoreOp) -> None:
        """A follower: the store change rank 0 made, with the same outcome (an error included)."""
        try:
            getattr(super(), op.name)(*op.args)
        except RpcError:
            pass  # rank 0 answered it; the same error here changes nothing
