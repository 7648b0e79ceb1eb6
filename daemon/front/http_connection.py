"""What prefixd adds to aiohttp's handling of one HTTP connection: read deadlines, and the client's faults as warnings.

Deadlines: aiohttp waits for a request's head and body as long as the client
takes, so a client that sent half a request and stopped would hold its
connection (and a file descriptor) for good. As nginx does with
client_header_timeout and client_body_timeout, each request here has two:
its head (request line and headers) must be whole within ``header_timeout``
seconds of its first byte, and its body within ``body_timeout`` seconds of
the head. Past either, the connection is closed and one ``http_read_timeout``
warning names the peer and what was missing. A connection with no request
under way (just accepted, or between kept-alive requests) is aiohttp's to
close once its keep-alive timeout passes, silently: an idle pooled connection
is no fault. Answering is not reading: replies, streamed ones included, have
no deadline.

Logs: a request aiohttp's parser refuses (a bad request line, a header too
long, a bad chunk size) is answered 400 by aiohttp, which logs it through the
connection's logger with a traceback at level error; so is a body it could
not decode (bad gzip), which the middleware answers 400. Here that logger
writes one ``http_malformed_request`` warning instead, without a traceback:
the fault is the client's. What else aiohttp logs there stays an error with
its traceback (an ``error`` line means the daemon is at fault).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from .peer_auth import peer_credentials

log = structlog.get_logger("prefixd.http")

HEADER_TIMEOUT_SECONDS = 30.0  # a request's head, from its first byte: a few hundred bytes, even by hand
BODY_TIMEOUT_SECONDS = 60.0  # a body of up to 16 MiB (the largest taken) from a local client on any link
KEEPALIVE_TIMEOUT_SECONDS = 75.0  # an idle connection between requests (nginx's keepalive_timeout default)


class Phase(enum.Enum):
    IDLE = "idle"  # no request under way: aiohttp's keep-alive timeout applies
    HEAD = "head"  # a request's head is arriving: the header deadline runs
    BODY = "body"  # the head is in, the body is arriving: the body deadline runs
    ANSWER = "answer"  # the request is in and being answered: no deadline


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the read deadlines; the middleware reports each request's progress.

    ``head_arrived(request)`` when a request reaches the middleware,
    ``body_arrived()`` once its body is read, ``reply_done()`` when its
    handler is done.
    """

    def __init__(self, inner: Any, header_timeout: float, body_timeout: float):
        self.inner = inner  # aiohttp's RequestHandler
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.phase = Phase.IDLE
        self.peer: dict[str, Any] = {}
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        # The head under way: bytes since the last request's body, and whether its request line has ended.
        self._num_head_bytes = 0
        self._request_line_ended = False
        self._request: web.BaseRequest | None = None  # the request whose body is awaited

    # -- what the middleware reports -----------------------------------------------------

    def head_arrived(self, request: web.BaseRequest) -> None:
        """A request's head is in: its body, if it has one, must now arrive in time."""
        self._num_head_bytes, self._request_line_ended = 0, False
        if not request.body_exists:
            self._enter(Phase.ANSWER)
            return
        self._request = request
        self._enter(Phase.BODY, self.body_timeout)

    def body_arrived(self) -> None:
        self._request = None
        self._enter(Phase.ANSWER)

    def reply_done(self) -> None:
        """The handler is done; bytes that came in meanwhile are the next request's head, which now has its deadline."""
        if self.phase is Phase.BODY:
            return  # answered without reading the body (a 401): aiohttp drains it, under the body deadline still
        if self._num_head_bytes:
            self._enter(Phase.HEAD, self.header_timeout)
        else:
            self._enter(Phase.IDLE)

    # -- the deadline ----------------------------------------------------------------------

    def _enter(self, phase: Phase, timeout: float | None = None) -> None:
        self.phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if timeout is not None and self.transport is not None and not self.transport.is_closing():
            self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self.phase is Phase.BODY:
            content = self._request.content if self._request is not None else None
            if content is None or content.is_eof():  # the unread body of a refused request: drained in time
                self._request = None
                self._enter(Phase.IDLE)
                return
            expected = self._request.content_length if self._request is not None else None
            log.warning(
                "http_read_timeout",
                **self.peer,
                missing="body",
                received_bytes=content.total_bytes,
                expected_bytes=expected,
                timeout_s=self.body_timeout,
            )
        else:
            missing = "headers" if self._request_line_ended else "request line"
            log.warning(
                "http_read_timeout",
                **self.peer,
                missing=missing,
                received_bytes=self._num_head_bytes,
                timeout_s=self.header_timeout,
            )
        self.transport.close()

    # -- asyncio.Protocol: everything goes on to aiohttp --------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer = describe_peer(transport)
        # aiohttp logs through this attribute (a constructor argument of its RequestHandler): see ClientFaultLog.
        self.inner.logger = ClientFaultLog(self.inner.logger, self.peer)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.phase is not Phase.BODY:  # bytes of a head: this request's, or the next one's while this is answered
            self._num_head_bytes += len(data)
            self._request_line_ended = self._request_line_ended or b"\n" in data
            if self.phase is Phase.IDLE:
                self._enter(Phase.HEAD, self.header_timeout)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(Phase.IDLE)
        self._request = None
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def guard_of(request: web.BaseRequest) -> GuardedConnection | None:
    """The guard of the connection ``request`` came on (None for a request made without one, as in aiohttp's tests)."""
    protocol = request.transport.get_protocol() if request.transport is not None else None
    return protocol if isinstance(protocol, GuardedConnection) else None


def describe_peer(transport: asyncio.BaseTransport) -> dict[str, Any]:
    """Who is at the other end, for log lines: the address over TCP, pid and uid over a Unix socket."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        credentials = peer_credentials(sock)
        return {"peer": "unix", "pid": credentials.pid, "uid": credentials.uid}
    peername = transport.get_extra_info("peername")
    return {"peer": f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)}


class ClientFaultLog:
    """aiohttp's logger for one connection: a request its parser refused is a warning without a traceback.

    aiohttp calls ``exception`` (and ``debug`` for a first line that is not
    HTTP at all, such as TLS sent to the plain port) with the parser's error
    as ``exc_info``, or with a RequestPayloadError caused by one when it
    drains a body it could not decode; every other call goes to aiohttp's own
    logger unchanged.
    """

    def __init__(self, inner: logging.Logger, peer: dict[str, Any]):
        self.inner = inner
        self.peer = peer

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if (fault := client_fault(exc_info)) is not None:
            self._malformed(fault)
        else:
            self.inner.exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: object, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        if (fault := client_fault(exc_info)) is not None:
            self._malformed(fault)
        else:
            self.inner.debug(msg, *args, exc_info=exc_info, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _malformed(self, exc: HttpProcessingError) -> None:
        log.warning(
            "http_malformed_request",
            **self.peer,
            status=exc.code,
            kind=type(exc).__name__,
            error=" ".join(str(exc.message).split()),
        )


def client_fault(exc: Any) -> HttpProcessingError | None:
    """The HTTP parser's error behind ``exc`` (itself, or what made a body unreadable); None for anything else."""
    if isinstance(exc, RequestPayloadError):
        exc = exc.__cause__
    return exc if isinstance(exc, HttpProcessingError) else None
