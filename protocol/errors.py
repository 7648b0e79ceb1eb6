"""Error codes carried in a response's error map: ``{code, message, data?}``.

The standard codes follow JSON-RPC 2.0 (many client authors know them); the
prefixd-specific ones live in the -32000..-32099 "server error" range.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ErrorCode(IntEnum):
    """Every error code the daemon sends. Values never change once published."""

    PARSE_ERROR = -32700  # bytes that are not msgpack; the connection is closed after
    INVALID_REQUEST = -32600  # msgpack, but not a msgpack-RPC message
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL = -32603
    MODEL_NOT_FOUND = -32001
    PROMPT_TOO_LONG = -32002
    OVERLOADED = -32003
    CANCELLED = -32004
    SHUTTING_DOWN = -32005
    MESSAGE_TOO_LARGE = -32006  # a message above MAX_MESSAGE_BYTES; the connection is closed after
    NOT_CACHED = -32007  # cache.pin of a prompt that is not in the store
    PIN_BUDGET_EXCEEDED = -32008
    ENGINE_DEAD = -32009  # the engine thread failed beyond recovery; the daemon is exiting (retry after its restart)
    MODEL_LOAD_FAILED = -32010  # a configured model could not be loaded (or can never fit --max-model-memory)


class RpcError(Exception):
    """An error that travels as a response's error map."""

    def __init__(self, code: ErrorCode | int, message: str, data: Any = None):
        super().__init__(message)
        self.code = int(code)
        self.message = message
        self.data = data

    def to_wire(self) -> dict[str, Any]:
        """The error map as it goes on the wire."""
        wire: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            wire["data"] = self.data
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> "RpcError":
        """Rebuild an error from a response's error field (tolerates non-map errors)."""
        if isinstance(obj, dict):
            code = obj.get("code", ErrorCode.INTERNAL)
            if not isinstance(code, int) or isinstance(code, bool):
                code = ErrorCode.INTERNAL
            return cls(code, str(obj.get("message", "")), obj.get("data"))
        return cls(ErrorCode.INTERNAL, str(obj))

    def __repr__(self) -> str:
        return f"RpcError({self.code}, {self.message!r})"
