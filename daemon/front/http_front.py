"""The opt-in HTTP front (aiohttp, in the daemon's event loop): the app, its fronts, and what they all share.

Each API is its own module that adds its routes to one app: OpenAI's
(``openai_api``), OpenAI's Responses API (``responses_api``), Ollama's
(``ollama_api``), Anthropic's (``anthropic_api``), llama.cpp's /infill
(``infill_api``), /metrics (``metrics``) and what a router reads
(``router_api``). This module builds the app, mounts them, and handles what
crosses them: authentication, peer checks, body deadlines, errors in each
API's shape, the log's request context. It never touches MLX: every request
becomes a GenerateJob run through ``Handlers.run_job``, like a socket request,
so both fronts share one engine and one prefix store. A client that goes
away cancels its job (aiohttp cancels the handler; the job sees the flag).

Exposure: over TCP the kernel names no peer, so any local user could connect;
the bearer token is what keeps them out, and it is required on every TCP
request once set (``http_options`` sets one unless told ``--http-no-token``;
a non-loopback host is refused without one). Over a Unix socket the peer's
uid is checked like on the msgpack socket, and that is the guard there: the
token is not asked for. One request needs neither: ``HEAD /``, the probe
Claude Code sends without a key at every start, is answered 200 and nothing.
Nor does ``GET /health`` ask for the token (``router_api``: a router probes it without one).

Every refused request (a 4xx, or a 5xx the front chose) leaves one
``http_refused`` log line with its status and message; an unknown route's 404
says the route does not exist and lists those that do.

Slow clients: a request's head must arrive within ``header_timeout`` seconds
of its first byte and its body within ``body_timeout`` seconds of the head,
or the connection is closed; an idle connection is closed after
``keepalive_timeout`` (http_connection, where a request aiohttp's parser
refuses is also logged as the client's fault). Replies are not limited.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import socket
from pathlib import Path
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from ...protocol.codec import MAX_MESSAGE_BYTES
from ...protocol.errors import RpcError
from ..engine.jobs import GenerateJob
from . import anthropic_api, http_errors, infill_api, metrics, ollama_api, openai_api, responses_api, router_api
from .agent_prompts import PromptNormalizer
from .handlers import Handlers
from .http_connection import (
    BODY_TIMEOUT_SECONDS,
    HEADER_TIMEOUT_SECONDS,
    KEEPALIVE_TIMEOUT_SECONDS,
    GuardedConnection,
    client_fault,
    guard_of,
)
from .http_jobs import CLIENT_KEY, FRONT_KEY, HANDLERS_KEY, LANE_KEY
from .http_options import DEFAULT_MAX_OUTPUT_TOKENS, is_loopback
from .listener import SocketFile, bind_unix_socket
from .peer_auth import PeerCredentials, PeerPolicy, peer_credentials
from .response_store import ResponseStore

log = structlog.get_logger("prefixd.http")


class HttpFront:
    """The running HTTP front: its addresses, its jobs, and ``cleanup()`` to stop it."""

    def __init__(
        self,
        app: web.Application,
        unix_path: Path | None,
        token: str | None,
        peer_policy: PeerPolicy,
        shutdown_timeout: float,
        keepalive_timeout: float,
    ):
        self.runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=shutdown_timeout,
            keepalive_timeout=keepalive_timeout,
        )
        self.servers: list[asyncio.AbstractServer] = []  # listening; connections go to self.runner.server
        self.unix_path = unix_path
        self.socket_file: SocketFile | None = None  # what we bound at unix_path, the one file cleanup removes
        self.token = token
        self.peer_policy = peer_policy
        self.jobs: dict[int, GenerateJob] = {}  # in flight, by request number

    @property
    def addresses(self) -> list[Any]:
        return [sock.getsockname() for server in self.servers for sock in (server.sockets or ())]

    @property
    def num_in_flight(self) -> int:
        return len(self.jobs)

    def cancel_all(self) -> None:
        for job in list(self.jobs.values()):
            job.cancel()

    async def cleanup(self) -> None:
        """Stop listening, let running requests end within the shutdown timeout, remove the socket file."""
        for server in self.servers:
            server.close()  # no wait_closed(): it would wait for the connections the runner is about to end
        self.servers.clear()
        await self.runner.cleanup()
        store = self.runner.app.get(responses_api.STORE_KEY)
        if store is not None:
            await store.flush()  # stored responses being written to disk
        self.remove_socket_file()

    def remove_socket_file(self) -> None:
        """Unlink the Unix socket file we bound, unless another process has bound that path since."""
        if self.socket_file is not None:
            self.socket_file.remove()
            self.socket_file = None


async def start_http_front(
    handlers: Handlers,
    host: str | None = None,
    port: int | None = None,
    unix_path: str | os.PathLike | None = None,
    token: str | None = None,
    peer_policy: PeerPolicy | None = None,
    shutdown_timeout: float = 10.0,
    header_timeout: float = HEADER_TIMEOUT_SECONDS,
    body_timeout: float = BODY_TIMEOUT_SECONDS,
    keepalive_timeout: float = KEEPALIVE_TIMEOUT_SECONDS,
    responses_dir: Path | None = None,
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    keep_billing_header: bool = False,
) -> HttpFront:
    """Serve the HTTP APIs on ``host:port`` and/or the Unix socket ``unix_path``.

    ``token``: the bearer token TCP requests must carry (None: none asked for).
    ``header_timeout`` / ``body_timeout``: seconds a request's head (from its first byte) and its body (from the
    head) may take to arrive; ``keepalive_timeout``: seconds an idle connection is kept (http_connection).
    ``responses_dir``: where stored Responses-API responses outlive a restart (None: in memory only).
    ``max_output_tokens``: the answer length of a /v1/responses request that names none.
    ``keep_billing_header``: leave Claude Code's billing line in its prompts (agent_prompts).
    """
    if host is None and unix_path is None:
        raise ValueError("give a host and port, a unix_path, or both")
    if host is not None and not is_loopback(host) and not token:
        raise ValueError(f"refusing to serve HTTP on non-loopback {host} without a bearer token")
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=MAX_MESSAGE_BYTES)
    openai_api.add_routes(app.router)
    ollama_api.add_routes(app.router)
    anthropic_api.add_routes(app.router)
    responses_api.add_routes(app.router)
    infill_api.add_routes(app.router)
    metrics.add_routes(app.router, handlers)
    router_api.add_routes(app.router)  # /health, /v1/loads and the info a router in front reads
    path = Path(unix_path).expanduser() if unix_path is not None else None
    front = HttpFront(app, path, token, peer_policy or PeerPolicy(), shutdown_timeout, keepalive_timeout)
    app[HANDLERS_KEY] = handlers
    app[FRONT_KEY] = front
    app[anthropic_api.NORMALIZER_KEY] = PromptNormalizer(keep_billing_header, handlers.prompts_normalized)
    app[responses_api.STORE_KEY] = store = ResponseStore(directory=responses_dir)
    app[responses_api.MAX_OUTPUT_TOKENS_KEY] = max_output_tokens
    if responses_dir is not None:
        log.info("responses_loaded", num_responses=await asyncio.to_thread(store.load), directory=str(responses_dir))
    await front.runner.setup()
    loop = asyncio.get_running_loop()

    def new_connection() -> GuardedConnection:
        return GuardedConnection(front.runner.server(), header_timeout, body_timeout)

    try:
        if host is not None:
            front.servers.append(await loop.create_server(new_connection, host, port or 0, backlog=128))
        if path is not None:
            sock, front.socket_file = bind_unix_socket(path)
            front.servers.append(await loop.create_server(new_connection, sock=sock, backlog=128))
    except BaseException:
        await front.cleanup()
        raise
    log.info(
        "http_started",
        addresses=[str(a) for a in front.addresses],
        token=bool(token),
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        keepalive_timeout_s=keepalive_timeout,
    )
    return front


# -- middleware: errors in OpenAI's shape, bearer token, peer check, body, log context ------


@web.middleware
async def _errors_and_auth(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    guard = guard_of(request)
    if guard is not None:
        guard.head_arrived(request)  # the body's deadline starts
    try:
        return await _answer(request, handler, guard)
    finally:
        if guard is not None:
            guard.reply_done()  # the next request on this connection gets its own time


async def _answer(
    request: web.Request,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    guard: GuardedConnection | None,
) -> web.StreamResponse:
    front: HttpFront = request.app[FRONT_KEY]
    sock = request.transport.get_extra_info("socket") if request.transport else None
    peer = peer_credentials(sock)
    request[CLIENT_KEY], request[LANE_KEY] = _client_and_lane(request, peer)
    structlog.contextvars.bind_contextvars(client=request[CLIENT_KEY], pid=peer.pid, uid=peer.uid, path=request.path)
    if request.method == "HEAD" and request.path == "/":
        # "Is anyone there?": Claude Code probes so at every start, with no key. The answer tells nothing an open
        # port does not, so it needs no token, and it leaves no warning in the log.
        return web.Response()
    if (refusal := front.peer_policy.refusal(peer)) is not None:
        log.warning("client_refused", reason=refusal)
        return _json_error(request, 403, refusal, "permission_error")
    if (
        front.token is not None
        and _over_tcp(sock)
        and not _token_matches(request, front.token)
        and not router_api.is_open_probe(request)
    ):
        log.warning("http_unauthorized")
        return _json_error(
            request,
            401,
            "a valid bearer token is required (Authorization: Bearer ..., or x-api-key: ...); "
            "OpenAI and Anthropic clients send it as their API key. "
            "The daemon's http_token log line says which file holds it",
            code="invalid_api_key",
        )
    try:
        if request.body_exists:
            await _read_body(request)
        if guard is not None:
            guard.body_arrived()
        return await handler(request)
    except RpcError as err:
        error = http_errors.error_for_path(request.path, err)
        _log_refusal(request, error.status, error.message)
        return web.json_response(http_errors.body_for_path(request.path, error), status=error.status)
    except web.HTTPException as exc:  # aiohttp's own: 404 route, 405 method, 413 body size
        if exc.status < 400:
            raise
        message = _no_route(request, exc) or (exc.reason if exc.status != 413 else exc.text or exc.reason)
        _log_refusal(request, exc.status, message)
        return _json_error(request, exc.status, message, code=None)
    except Exception as exc:
        log.exception("http_handler_failed")
        return _json_error(request, 500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


async def _read_body(request: web.Request) -> None:
    """Read the body under its deadline (the endpoints parse the cached bytes); a 400 for one aiohttp cannot decode."""
    try:
        await request.read()
    except RequestPayloadError as exc:  # a bad chunk or content encoding: aiohttp logs it as the client's fault
        fault = client_fault(exc)
        reason = " ".join(str(fault.message).split()) if fault is not None else str(exc)
        raise http_errors.invalid(f"the request body could not be read: {reason}") from None


def _log_refusal(request: web.Request, status: int, message: str) -> None:
    """One line per refused request: what a client was told is in the log too (the 401 and 403 have their own)."""
    (log.warning if status >= 500 else log.info)("http_refused", status=status, method=request.method, error=message)


def _no_route(request: web.Request, exc: web.HTTPException) -> str | None:
    """What to tell a client that asked for a route prefixd does not have (None: the 404 or 405 came from a handler)."""
    if request.match_info.http_exception is None:
        return None
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return f"{request.method} {request.path}: this route takes only {', '.join(sorted(exc.allowed_methods))}"
    if exc.status != 404:
        return None
    paths = sorted({resource.canonical for resource in request.app.router.resources()})
    return f"no route {request.method} {request.path} on prefixd; its routes: {', '.join(paths)}"


def _over_tcp(sock: Any) -> bool:
    # Anything but a Unix socket counts as TCP: a peer the kernel does not name must show the token.
    return sock is None or sock.family != socket.AF_UNIX


def _client_and_lane(request: web.Request, peer: PeerCredentials) -> tuple[str, str]:
    """The request's client id (its queue limits) and its fair lane (whose turn it shares: inbox.py).

    The client id is one per TCP connection, one per process on the Unix
    socket, like msgpack connections. The lane is wider: an HTTP client opens
    a connection per request, or a pool of them, so a connection is not a
    client: over TCP, a client is its host and program (User-Agent); on the
    Unix socket, its process. A burst of a thousand connections is then one
    lane, and a socket client or another program still gets every other turn.
    """
    peername = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peername, tuple):
        host, port = peername[0], peername[1]
        return f"http:{host}:{port}", f"http:{host} {request.headers.get('User-Agent', '')[:100]}".rstrip()
    process = f"http:pid{peer.pid}" if peer.pid else "http"
    return process, process


def _token_matches(request: web.Request, token: str) -> bool:
    # Bearer for OpenAI and Ollama clients (and Anthropic's with an auth token); x-api-key for Anthropic's API key.
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(given.strip().encode(), token.encode())
    return hmac.compare_digest(request.headers.get("x-api-key", "").strip().encode(), token.encode())


def _json_error(
    request: web.Request, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> web.Response:
    error = http_errors.HttpError(status, message, kind, code)
    return web.json_response(http_errors.body_for_path(request.path, error), status=status)
