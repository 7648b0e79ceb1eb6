"""OpenAI's API on the HTTP front: GET /v1/models, POST /v1/chat/completions and /v1/completions.

Streamed as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``)
or not. The request and reply shapes are ``openai_shapes``; ``suffix`` on
/v1/completions becomes a FIM prompt through ``infill_api``. OpenAI's
Responses API is its own front (``responses_api``).
"""

from __future__ import annotations

from aiohttp import web

from ...protocol import methods as m
from ..models.names import model_not_found
from . import infill_api
from . import openai_shapes as shapes
from .http_jobs import LazyStream, RunningJob, handlers_of, json_body, result_in_stream, sse_data


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/models", list_models)
    router.add_get("/v1/models/{model}", get_model)
    router.add_post("/v1/chat/completions", chat_completions)
    router.add_post("/v1/completions", completions)


async def list_models(request: web.Request) -> web.Response:
    """Every configured model, loaded or not; ``prefixd_residency`` says which are loaded, their memory, since and until when."""
    handlers = handlers_of(request)
    described = await handlers.engine.call(handlers.engine.controls.describe_models)
    return web.json_response(shapes.models_list(described, int(handlers.started_at)))


async def get_model(request: web.Request) -> web.Response:
    handlers = handlers_of(request)
    name = request.match_info["model"]
    if name not in handlers.engine.model_names:
        raise model_not_found(name, handlers.engine.model_names)
    described = await handlers.engine.call(handlers.engine.controls.describe_models)
    return web.json_response(
        shapes.models_list([model for model in described if model["name"] == name], int(handlers.started_at))["data"][0]
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    notes: list[str] = []
    params = shapes.chat_request(body, notes)
    return await _generate(request, params, chat=True, include_usage=shapes.wants_usage(body), notes=notes)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    if isinstance(body, dict) and body.get(
        "suffix"
    ):  # fill-in-the-middle: the model's FIM tokens around prompt and suffix
        body = await infill_api.completion_with_suffix(request, body)
    return await _generate(request, shapes.completion_request(body), chat=False, include_usage=shapes.wants_usage(body))


async def _generate(
    request: web.Request, params: m.GenerateParams, chat: bool, include_usage: bool, notes: list[str] | None = None
) -> web.StreamResponse:
    reply = shapes.Reply(chat, params.model or handlers_of(request).engine.default_model or "", notes)
    async with RunningJob(request, params) as job:
        if not params.stream:
            return web.json_response(reply.complete(await job.result()))
        return await _stream(request, reply, job, include_usage)


async def _stream(
    request: web.Request, reply: shapes.Reply, job: RunningJob, include_usage: bool
) -> web.StreamResponse:
    stream = LazyStream(request, "text/event-stream", sse_data)
    async for chunk in job.chunks():
        if not stream.started:
            await stream.send(reply.chunk(first=True))
        if chunk["text"] or not chunk.get("tool_calls"):
            await stream.send(reply.chunk(chunk["text"]))
        for piece in reply.tool_call_chunks(chunk.get("tool_calls", [])):
            await stream.send(piece)
    # The openai client raises APIError on an error chunk.
    if (result := await result_in_stream(job, stream, lambda err: shapes.error_body(err)[1])) is None:
        return stream.response
    if not stream.started:
        await stream.send(reply.chunk(first=True))
    await stream.send(reply.closing_chunk(result))
    if include_usage:
        await stream.send(reply.usage_chunk(result))
    return await stream.finish(b"data: [DONE]\n\n")
