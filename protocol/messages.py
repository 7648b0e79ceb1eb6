"""The three msgpack-RPC message shapes, as plain data.

    request       [0, msgid, method, params]
    response      [1, msgid, error, result]
    notification  [2, method, params]

``params`` is an array; prefixd methods take a single map as its only element.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Union

from .errors import ErrorCode, RpcError

MAX_MSGID = 2**32 - 1  # msgpack-RPC msgids are 32-bit unsigned


class MessageType(IntEnum):
    REQUEST = 0
    RESPONSE = 1
    NOTIFICATION = 2


@dataclass(frozen=True, slots=True)
class Request:
    msgid: int
    method: str
    params: list[Any]

    def to_wire(self) -> list[Any]:
        return [MessageType.REQUEST, self.msgid, self.method, self.params]


@dataclass(frozen=True, slots=True)
class Response:
    msgid: int | None  # None only for errors about a message whose msgid is unknown
    error: dict[str, Any] | None
    result: Any

    def to_wire(self) -> list[Any]:
        return [MessageType.RESPONSE, self.msgid, self.error, self.result]


@dataclass(frozen=True, slots=True)
class Notification:
    method: str
    params: list[Any]

    def to_wire(self) -> list[Any]:
        return [MessageType.NOTIFICATION, self.method, self.params]


Message = Union[Request, Response, Notification]


def parse_message(obj: Any) -> Message:
    """Turn one decoded msgpack object into a message, or raise INVALID_REQUEST."""
    if not isinstance(obj, (list, tuple)) or not obj:
        raise RpcError(ErrorCode.INVALID_REQUEST, "a msgpack-RPC message is an array [type, ...]")
    kind = obj[0]
    if type(kind) is not int:  # True == 1 and 0.0 == 0 in Python; not on the wire
        raise RpcError(ErrorCode.INVALID_REQUEST, f"message type must be the integer 0, 1 or 2, got {kind!r}")
    if kind == MessageType.REQUEST:
        if len(obj) != 4:
            raise RpcError(ErrorCode.INVALID_REQUEST, "a request is [0, msgid, method, params]")
        _, msgid, method, params = obj
        if not _is_msgid(msgid):
            raise RpcError(ErrorCode.INVALID_REQUEST, "msgid must be an integer in 0..2**32-1")
        if not isinstance(method, str):
            raise RpcError(ErrorCode.INVALID_REQUEST, "method must be a string", {"msgid": msgid})
        if not isinstance(params, (list, tuple)):
            raise RpcError(ErrorCode.INVALID_REQUEST, "params must be an array", {"msgid": msgid})
        return Request(msgid, method, list(params))
    if kind == MessageType.RESPONSE:
        if len(obj) != 4 or not (obj[1] is None or _is_msgid(obj[1])):
            raise RpcError(ErrorCode.INVALID_REQUEST, "a response is [1, msgid, error, result]")
        return Response(obj[1], obj[2], obj[3])
    if kind == MessageType.NOTIFICATION:
        if len(obj) != 3 or not isinstance(obj[1], str) or not isinstance(obj[2], (list, tuple)):
            raise RpcError(ErrorCode.INVALID_REQUEST, "a notification is [2, method, params]")
        return Notification(obj[1], list(obj[2]))
    raise RpcError(ErrorCode.INVALID_REQUEST, f"unknown message type {kind!r}; expected 0, 1 or 2")


def request_msgid(obj: Any) -> int | None:
    """The msgid of something shaped like a request, [0, msgid, _, _], when it can be read.

    For errors about a message refused before it became a Request: the error
    can then name the msgid its sender waits on.
    """
    if isinstance(obj, (list, tuple)) and len(obj) == 4 and type(obj[0]) is int and obj[0] == MessageType.REQUEST:
        return obj[1] if _is_msgid(obj[1]) else None
    return None


def _is_msgid(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_MSGID
