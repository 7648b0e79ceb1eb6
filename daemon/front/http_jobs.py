"""What every HTTP API of the front shares: the app's keys, the body, one running job, a lazy stream.

The OpenAI, Ollama, Anthropic and llama.cpp-infill endpoints differ only in
shapes; each of them reads its JSON body with ``json_body``, runs its job as a
``RunningJob`` (one ``Handlers.run_job`` behind all of them: one engine, one
prefix store) and writes a streamed reply through a ``LazyStream``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from ...protocol import methods as m
from ...protocol.errors import ErrorCode, RpcError
from .handlers import Handlers
from .json_body import parse_json_body

HANDLERS_KEY = web.AppKey("handlers", Handlers)
FRONT_KEY = web.AppKey("front", object)
CLIENT_KEY = web.RequestKey("client_id", str) if hasattr(web, "RequestKey") else "prefixd_client_id"  # aiohttp >= 3.12
LANE_KEY = web.RequestKey("fair_lane", str) if hasattr(web, "RequestKey") else "prefixd_fair_lane"
_request_ids = itertools.count(1)


def handlers_of(request: web.Request) -> Handlers:
    return request.app[HANDLERS_KEY]


async def json_body(request: web.Request) -> Any:
    """The request's JSON body; INVALID_PARAMS (a 400 in every API's shape) when it is not JSON."""
    try:
        text = await request.text()
    except UnicodeDecodeError as exc:
        raise RpcError(ErrorCode.INVALID_PARAMS, f"the request body is not valid UTF-8: {exc}") from None
    except LookupError:  # Content-Type names a charset there is no codec for
        message = f"the request body's charset {request.charset!r} is unknown; send UTF-8"
        raise RpcError(ErrorCode.INVALID_PARAMS, message) from None
    return parse_json_body(text)


async def json_object(request: web.Request) -> dict[str, Any]:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise RpcError(ErrorCode.INVALID_PARAMS, "the request body must be a JSON object")
    return body


class RunningJob:
    """One generate job of an HTTP request, its streamed chunks, and its end.

    ``async with RunningJob(request, params) as job``: the job starts at once;
    leaving the block cancels it unless it is done (the client went away, or
    the endpoint stopped reading). ``stop_early()`` ends a job whose answer the
    front has cut itself (a stop sequence it matches, an infill indent rule):
    the engine finishes it as cancelled, the log and the metrics show a stop
    with the front's reason, and the front's reply says why in its own terms.
    """

    def __init__(self, request: web.Request, params: m.GenerateParams, warm_only: bool = False):
        self._handlers = handlers_of(request)
        self._jobs = request.app[FRONT_KEY].jobs
        self._number = next(_request_ids)
        self._events: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(
            self._handlers.run_job(
                request[CLIENT_KEY],
                self._number,
                params,
                warm_only=warm_only,
                on_chunk=self._events.put_nowait,
                jobs=self._jobs,
                lane=request.get(LANE_KEY),
            )
        )
        self.task.add_done_callback(lambda _: self._events.put_nowait(None))

    async def __aenter__(self) -> "RunningJob":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.task.cancel()  # a no-op once it is done

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Stream chunks (maps with ``text``) until the job ends; then ``await job.result()``."""
        while (chunk := await self._events.get()) is not None:
            yield chunk

    async def result(self) -> dict[str, Any]:
        return await self.task

    def prompt_tokens(self) -> int | None:
        """The prompt's token count once it is encoded (before the reply says how much of it the cache held)."""
        job = self._jobs.get(self._number)
        return len(job.encoded.tokens) if job is not None and job.encoded is not None else None

    def stop_early(self, reason: str) -> None:
        """End the job: the front has the whole answer (``reason`` says why: the log and metrics show a stop)."""
        job = self._jobs.get(self._number)
        if job is not None and not job.cancelled.is_set():
            job.stopped_by_front = reason
            self._handlers.engine.cancel(job)


class LazyStream:
    """A streamed reply that starts with its first write.

    So an error that comes before any text (prompt too long, overloaded) is
    still answered with its own HTTP status and a plain error body.
    ``frame`` turns one object into the bytes of one event (SSE, NDJSON, ...).
    """

    def __init__(self, request: web.Request, content_type: str, frame: Callable[[dict[str, Any]], bytes]):
        self.request = request
        self.content_type = content_type
        self.frame = frame
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def send(self, obj: dict[str, Any]) -> None:
        if self.response is None:
            self.response = web.StreamResponse(
                headers={"Content-Type": self.content_type, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
            await self.response.prepare(self.request)
        await self.response.write(self.frame(obj))

    async def finish(self, trailer: bytes = b"") -> web.StreamResponse:
        assert self.response is not None, "finish() after at least one send()"
        if trailer:
            await self.response.write(trailer)
        await self.response.write_eof()
        return self.response


async def result_in_stream(
    job: RunningJob, stream: LazyStream, error_event: Callable[[RpcError], dict[str, Any]]
) -> dict[str, Any] | None:
    """The job's result; or, when it failed after the stream started, None once the error went out as its last event.

    A failure before the stream started is raised, so it gets its own HTTP status.
    """
    try:
        return await job.result()
    except RpcError as err:
        if not stream.started:
            raise
        await stream.send(error_event(err))
        await stream.finish()
        return None


def compact_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse_data(obj: dict[str, Any]) -> bytes:
    """An unnamed server-sent event (OpenAI's streams)."""
    return b"data: " + compact_json(obj) + b"\n\n"


def ndjson_line(obj: dict[str, Any]) -> bytes:
    """One line of newline-delimited JSON (Ollama's streams)."""
    return compact_json(obj) + b"\n"
