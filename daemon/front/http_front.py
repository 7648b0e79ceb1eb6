"""The opt-in OpenAI-compatible HTTP front (aiohttp, in the daemon's event loop).

``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions``,
streamed as server-sent events or not. It never touches MLX: every request
becomes a GenerateJob run through ``Handlers.run_job``, like a socket request,
so both fronts share one engine and one prefix store. A client that goes
away cancels its job (aiohttp cancels the handler; the job sees the flag).

Exposure: TCP on loopback by default; a non-loopback host is refused unless
a bearer token is set, and a set token is then required on every request.
Over a Unix socket the peer's uid is checked like on the msgpack socket.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from ...protocol.codec import MAX_MESSAGE_BYTES
from ...protocol.errors import ErrorCode, RpcError
from ..engine.jobs import GenerateJob
from ..models.names import model_not_found
from . import openai_shapes as shapes
from .handlers import Handlers
from .http_options import is_loopback
from .listener import SocketFile, bind_unix_socket
from .peer_auth import UNKNOWN, PeerCredentials, PeerPolicy, peer_credentials

log = structlog.get_logger("prefixd.http")
_request_ids = itertools.count(1)
_HANDLERS_KEY = web.AppKey("handlers", Handlers)
_FRONT_KEY = web.AppKey("front", object)
_CLIENT_KEY = web.RequestKey("client_id", str) if hasattr(web, "RequestKey") else "prefixd_client_id"  # aiohttp >= 3.12


class HttpFront:
    """The running HTTP front: its addresses, its jobs, and ``cleanup()`` to stop it."""

    def __init__(self, app: web.Application, unix_path: Path | None, token: str | None, peer_policy: PeerPolicy, shutdown_timeout: float):
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
        self.unix_path = unix_path
        self.socket_file: SocketFile | None = None  # what we bound at unix_path, the one file cleanup removes
        self.token = token
        self.peer_policy = peer_policy
        self.jobs: dict[int, GenerateJob] = {}  # in flight, by request number

    @property
    def addresses(self) -> list[Any]:
        return list(self.runner.addresses)

    @property
    def num_in_flight(self) -> int:
        return len(self.jobs)

    def cancel_all(self) -> None:
        for job in list(self.jobs.values()):
            job.cancel()

    async def cleanup(self) -> None:
        """Stop listening, let running requests end within the shutdown timeout, remove the socket file."""
        await self.runner.cleanup()
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
) -> HttpFront:
    """Serve the OpenAI-compatible API on ``host:port`` and/or the Unix socket ``unix_path``."""
    if host is None and unix_path is None:
        raise ValueError("give a host and port, a unix_path, or both")
    if host is not None and not is_loopback(host) and not token:
        raise ValueError(f"refusing to serve HTTP on non-loopback {host} without a bearer token")
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=MAX_MESSAGE_BYTES)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    path = Path(unix_path).expanduser() if unix_path is not None else None
    front = HttpFront(app, path, token, peer_policy or PeerPolicy(), shutdown_timeout)
    app[_HANDLERS_KEY] = handlers
    app[_FRONT_KEY] = front
    await front.runner.setup()
    try:
        if host is not None:
            await web.TCPSite(front.runner, host, port or 0).start()
        if path is not None:
            sock, front.socket_file = bind_unix_socket(path)
            await web.SockSite(front.runner, sock).start()
    except BaseException:
        await front.cleanup()
        raise
    log.info("http_started", addresses=[str(a) for a in front.addresses], token=bool(token))
    return front


# -- middleware: errors in OpenAI's shape, bearer token, peer check, log context ------------


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    front: HttpFront = request.app[_FRONT_KEY]
    peer = peer_credentials(request.transport.get_extra_info("socket")) if request.transport else UNKNOWN
    request[_CLIENT_KEY] = _client_id(request, peer)
    structlog.contextvars.bind_contextvars(client=request[_CLIENT_KEY], pid=peer.pid, uid=peer.uid, path=request.path)
    if (refusal := front.peer_policy.refusal(peer)) is not None:
        log.warning("client_refused", reason=refusal)
        return _json_error(403, refusal, "permission_error")
    if front.token is not None and not _token_matches(request, front.token):
        log.warning("http_unauthorized")
        return _json_error(401, "a valid bearer token is required (Authorization: Bearer ...)", code="invalid_api_key")
    try:
        return await handler(request)
    except RpcError as err:
        status, body = shapes.error_body(err)
        return web.json_response(body, status=status)
    except web.HTTPException as exc:  # aiohttp's own: 404 route, 405 method, 413 body size
        if exc.status < 400:
            raise
        return _json_error(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason, code=None)
    except Exception as exc:
        log.exception("http_handler_failed")
        return _json_error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _client_id(request: web.Request, peer: PeerCredentials) -> str:
    # The engine queues fairly per client id: one per TCP connection, one per
    # process on the Unix socket, like msgpack connections.
    peername = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peername, tuple):
        return f"http:{peername[0]}:{peername[1]}"
    return f"http:pid{peer.pid}" if peer.pid else "http"


def _token_matches(request: web.Request, token: str) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def _json_error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return web.json_response(shapes.http_error_body(message, kind, code), status=status)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RpcError(ErrorCode.INVALID_PARAMS, f"the request body is not valid JSON: {exc}") from None


# -- endpoints ---------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    handlers = request.app[_HANDLERS_KEY]
    return web.json_response(shapes.models_list(handlers.engine.model_names, int(handlers.started_at)))


async def get_model(request: web.Request) -> web.Response:
    handlers = request.app[_HANDLERS_KEY]
    name = request.match_info["model"]
    if name not in handlers.engine.model_names:
        raise model_not_found(name, handlers.engine.model_names)
    return web.json_response(shapes.models_list((name,), int(handlers.started_at))["data"][0])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    return await _generate(request, shapes.chat_request(body), chat=True, include_usage=shapes.wants_usage(body))


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    return await _generate(request, shapes.completion_request(body), chat=False, include_usage=shapes.wants_usage(body))


async def _generate(request: web.Request, params: Any, chat: bool, include_usage: bool) -> web.StreamResponse:
    handlers: Handlers = request.app[_HANDLERS_KEY]
    front: HttpFront = request.app[_FRONT_KEY]
    reply = shapes.Reply(chat, params.model or handlers.engine.default_model or "")
    number = next(_request_ids)
    events: asyncio.Queue = asyncio.Queue()
    job = asyncio.create_task(
        handlers.run_job(request[_CLIENT_KEY], number, params, on_chunk=events.put_nowait, jobs=front.jobs)
    )
    job.add_done_callback(lambda _: events.put_nowait(None))
    try:
        if not params.stream:
            return web.json_response(reply.complete(await job))
        return await _stream(request, reply, job, events, include_usage)
    finally:
        job.cancel()  # a no-op once it is done; otherwise the client went away


async def _stream(
    request: web.Request, reply: shapes.Reply, job: asyncio.Task, events: asyncio.Queue, include_usage: bool
) -> web.StreamResponse:
    # The response starts with the first chunk, so an error that comes before
    # any text (prompt too long, overloaded) still gets its HTTP status.
    response: web.StreamResponse | None = None
    while (chunk := await events.get()) is not None:
        if response is None:
            response = await _start_sse(request)
            await _send(response, reply.chunk(first=True))
        await _send(response, reply.chunk(chunk["text"]))
    try:
        result = job.result()
    except RpcError as err:
        if response is None:
            raise
        await _send(response, shapes.error_body(err)[1])  # the openai client raises APIError on this
        return response
    if response is None:
        response = await _start_sse(request)
        await _send(response, reply.chunk(first=True))
    await _send(response, reply.closing_chunk(result))
    if include_usage:
        await _send(response, reply.usage_chunk(result))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _start_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, obj: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
