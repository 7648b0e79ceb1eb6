"""Model names as the fronts and the engine check them. Pure Python: the front imports it."""

from __future__ import annotations

from typing import Iterable

from ...protocol.errors import ErrorCode, RpcError


def model_not_found(name: str | None, loaded: Iterable[str]) -> RpcError:
    """The one MODEL_NOT_FOUND error every front and the engine raise."""
    return RpcError(ErrorCode.MODEL_NOT_FOUND, f"no model named {name!r} is loaded; loaded: {', '.join(loaded)}")
