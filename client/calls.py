"""What both clients share: params maps, msgids, and reading replies.

The blocking and the async client differ only in how bytes move; everything
about what goes in a request and what comes out of a reply lives here, once.
Parameters left as None are not sent, so the daemon's defaults apply (they
are documented in docs/protocol.md and enforced by prefixd.protocol.methods).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypedDict, Unpack

from prefixd.protocol import methods
from prefixd.protocol.errors import ErrorCode
from prefixd.protocol.codec import encode
from prefixd.protocol.messages import MAX_MSGID, Message, Notification, Request, Response
from prefixd.protocol.paths import default_socket_path

from .errors import PrefixdError, error_from_wire

READ_CHUNK_BYTES = 64 * 1024


def resolve_socket_path(socket_path: str | os.PathLike | None) -> Path:
    """The given path, or the default (which honours $PREFIXD_SOCKET)."""
    return Path(socket_path).expanduser() if socket_path is not None else default_socket_path()


class MsgidCounter:
    """Msgids that increase per connection, wrapping at the 32-bit limit."""

    def __init__(self) -> None:
        self._next = 1

    def take(self) -> int:
        msgid = self._next
        self._next = self._next + 1 if self._next < MAX_MSGID else 0
        return msgid


def encode_request(msgid: int, method: str, params: dict[str, Any]) -> bytes:
    """A request as bytes; every prefixd method takes one map."""
    return encode(Request(msgid, method, [params]))


class PromptOptions(TypedDict, total=False):
    """Keyword arguments naming a prompt (besides the positional text ``prompt``)."""

    # chat: [{role, content}, ...], rendered by the model's template; an assistant message may carry a
    # result's tool_calls, a {role: "tool", tool_call_id, content} message a tool's result
    messages: list[dict[str, Any]]
    tokens: list[int]  # token ids, sent as they are
    model: str  # a model name from models(); the daemon's default when omitted
    add_generation_prompt: bool  # messages only; default true
    tools: list[dict[str, Any]]  # messages only: OpenAI-shaped tools for the chat template


class GenerateOptions(PromptOptions, total=False):
    """Keyword arguments of generate and stream; omitted ones take the daemon's defaults."""

    max_tokens: int  # default 256
    temperature: float  # default 0 (greedy)
    top_p: float  # default 1
    seed: int
    stop: str | list[str]
    session: str
    cache: bool | dict[str, bool]  # {use, store, verify}; False means neither use nor store (a cold run)
    constraint: dict[str, Any]  # {json_schema: {...}} | {json_object: True} | {regex: "..."} | {lark: "..."}
    # "auto" (default), "none", "required" or {type: "function", function: {name}}: with tools, the result
    # (and a streamed chunk where a call is complete) carries tool_calls, finish_reason "tool_calls"
    tool_choice: str | dict[str, Any]


def prompt_params(prompt: str | None = None, **options: Unpack[PromptOptions]) -> dict[str, Any]:
    """Params of tokenize / cache.warm / cache.pin / cache.unpin."""
    return _build(prompt, PromptOptions, options)


def generate_params(
    prompt: str | None = None, *, stream: bool = False, **options: Unpack[GenerateOptions]
) -> dict[str, Any]:
    """Params of generate; ``stream`` is set by the client, not by the caller."""
    params = _build(prompt, GenerateOptions, options)
    if stream:
        params["stream"] = True
    return params


def _build(prompt: str | None, allowed: type, options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(allowed.__annotations__)
    if unknown:  # a typo would otherwise reach the daemon as an INVALID_PARAMS round trip
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    params = {"prompt": prompt, **options}
    for key in ("messages", "tokens"):
        if params.get(key) is not None:
            params[key] = list(params[key])
    if isinstance(params.get("stop"), tuple):
        params["stop"] = list(params["stop"])
    if isinstance(params.get("cache"), bool):  # shorthand: False = neither read nor write the store
        params["cache"] = {"use": params["cache"], "store": params["cache"]}
    return {key: value for key, value in params.items() if value is not None}


def cancel_params(msgid: int) -> dict[str, Any]:
    return {"id": msgid}


def result_of(response: Response) -> Any:
    """The result of a response, or its error raised as a typed exception."""
    if response.error is not None:
        raise error_from_wire(response.error)
    return response.result


def chunk_target(message: Notification) -> tuple[int, dict[str, Any]] | None:
    """(msgid of the generate request, chunk map) for a generate.chunk notification, else None.

    Anything else (another method, a malformed chunk) is not for us: clients
    ignore notifications they do not understand rather than fail on them.
    """
    if message.method != methods.GENERATE_CHUNK or len(message.params) != 1:
        return None
    chunk = message.params[0]
    if not isinstance(chunk, dict) or not isinstance(chunk.get("id"), int):
        return None
    return chunk["id"], chunk


def connection_level_error(message: Message | Exception) -> PrefixdError | None:
    """The error to fail every waiter with, if this message ends the connection.

    The daemon answers bytes it cannot read (PARSE_ERROR, MESSAGE_TOO_LARGE)
    with msgid nil and then closes; every pending call fails with that error,
    which says more than the ConnectionLost that would follow. Other nil-msgid
    errors (INVALID_REQUEST) leave the connection open and concern nobody we
    can name, so they are dropped like any reply without a waiter.
    """
    if not (isinstance(message, Response) and message.msgid is None and isinstance(message.error, dict)):
        return None
    error = error_from_wire(message.error)
    return error if error.code in _FATAL_CODES else None


_FATAL_CODES = frozenset({ErrorCode.PARSE_ERROR, ErrorCode.MESSAGE_TOO_LARGE})
