"""Typed exceptions for the prefixd clients.

Every exception a client raises is a ``PrefixdError``, so ``except
PrefixdError`` catches them all. Errors the daemon answered with carry the
wire ``code`` (an ``ErrorCode``), ``message`` and ``data`` and have one
subclass per code (``ModelNotFound``, ``PromptTooLong``, ...). Errors that
happen on this side of the socket (``DaemonUnavailable``, ``ConnectionLost``,
``RequestTimeout``) never crossed the wire: their ``code`` is None, and they
are also ``ConnectionError`` / ``TimeoutError`` so generic handlers work.
"""

from __future__ import annotations

from typing import Any

from prefixd.protocol.errors import ErrorCode, RpcError

START_HINT = "start it with `prefixd serve --model DIR`"


class PrefixdError(RpcError):
    """Base of every client error; daemon errors keep their wire code."""

    code_enum: ErrorCode | None = None  # the code a subclass stands for

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code}, {self.message!r})"


class ParseError(PrefixdError):
    code_enum = ErrorCode.PARSE_ERROR


class InvalidRequest(PrefixdError):
    code_enum = ErrorCode.INVALID_REQUEST


class MethodNotFound(PrefixdError):
    code_enum = ErrorCode.METHOD_NOT_FOUND


class InvalidParams(PrefixdError):
    code_enum = ErrorCode.INVALID_PARAMS


class InternalError(PrefixdError):
    code_enum = ErrorCode.INTERNAL


class ModelNotFound(PrefixdError):
    code_enum = ErrorCode.MODEL_NOT_FOUND


class PromptTooLong(PrefixdError):
    code_enum = ErrorCode.PROMPT_TOO_LONG


class Overloaded(PrefixdError):
    code_enum = ErrorCode.OVERLOADED


class Cancelled(PrefixdError):
    code_enum = ErrorCode.CANCELLED


class ShuttingDown(PrefixdError):
    code_enum = ErrorCode.SHUTTING_DOWN


class MessageTooLarge(PrefixdError):
    code_enum = ErrorCode.MESSAGE_TOO_LARGE


class NotCached(PrefixdError):
    code_enum = ErrorCode.NOT_CACHED


class PinBudgetExceeded(PrefixdError):
    code_enum = ErrorCode.PIN_BUDGET_EXCEEDED


class EngineDead(PrefixdError):
    """The daemon's engine failed beyond recovery and the daemon is exiting; retry once it is back."""

    code_enum = ErrorCode.ENGINE_DEAD


class ModelLoadFailed(PrefixdError):
    """A configured model could not be loaded (its files, or more than --max-model-memory); the daemon serves on."""

    code_enum = ErrorCode.MODEL_LOAD_FAILED


_BY_CODE: dict[int, type[PrefixdError]] = {
    int(cls.code_enum): cls for cls in PrefixdError.__subclasses__() if cls.code_enum is not None
}
# A new ErrorCode without a class here would silently become a plain PrefixdError.
assert set(_BY_CODE) == {int(code) for code in ErrorCode}, "one exception class per ErrorCode"


def error_from_wire(err: Any) -> PrefixdError:
    """The typed exception for a response's error field (unknown codes give PrefixdError)."""
    if isinstance(err, dict):
        try:
            code = int(err.get("code", ErrorCode.INTERNAL))
        except (TypeError, ValueError):  # a malformed map must not hide the message behind a ValueError
            code = int(ErrorCode.INTERNAL)
        message, data = str(err.get("message", "")), err.get("data")
    else:
        code, message, data = int(ErrorCode.INTERNAL), str(err), None
    return _BY_CODE.get(code, PrefixdError)(code, message or f"daemon error {code}", data)


class _LocalError(PrefixdError):
    """An error raised on the client side: no wire code."""

    def __init__(self, message: str, data: Any = None):
        Exception.__init__(self, message)
        self.code = None
        self.message = message
        self.data = data


class DaemonUnavailable(_LocalError, ConnectionError):
    """No daemon answers at the socket path (missing socket, refused, no permission)."""


class ConnectionLost(_LocalError, ConnectionError):
    """The daemon closed the connection (or sent garbage) while a call was waiting."""


class RequestTimeout(_LocalError, TimeoutError):
    """No reply within the client's timeout; the call is abandoned (a generate is cancelled)."""


def unavailable(socket_path: Any, exc: OSError) -> DaemonUnavailable:
    """DaemonUnavailable with a message that says what went wrong and how to fix it."""
    if isinstance(exc, FileNotFoundError):
        reason = f"no socket at {socket_path}"
    elif isinstance(exc, ConnectionRefusedError):
        reason = f"nothing listens on {socket_path} (a stale socket from a daemon that exited?)"
    elif isinstance(exc, PermissionError):
        return DaemonUnavailable(f"no permission to connect to {socket_path} (a daemon of another user?)")
    else:
        reason = f"cannot connect to {socket_path}: {exc.strerror or exc}"
    return DaemonUnavailable(f"daemon not running: {reason}; {START_HINT}")
