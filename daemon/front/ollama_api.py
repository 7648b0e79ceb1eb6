"""Ollama's API on the HTTP front: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version.

The same jobs as every other front (``RunningJob``), so an editor that only
speaks Ollama shares the one prefix store with everything else. Replies
stream as newline-delimited JSON unless ``"stream": false``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .handlers import DAEMON_VERSION
from .http_errors import from_rpc, invalid, ollama_body, reject_unknown
from .http_jobs import LazyStream, RunningJob, handlers_of, json_object, ndjson_line, result_in_stream
from .infill_api import fim_format_of, require_fim_format
from .ollama_shapes import (
    OllamaReply,
    OllamaRequest,
    chat_request,
    generate_request,
    model_entry,
    running_entry,
    show_entry,
)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/api/chat", chat)
    router.add_post("/api/generate", generate)
    router.add_get("/api/tags", tags)
    router.add_post("/api/show", show)
    router.add_get("/api/ps", running)
    router.add_get("/api/version", version)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await json_object(request)
    return await _answer(request, chat_request(body, _default_model(request)), chat=True)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await json_object(request)
    fim_prompt = None
    if body.get("suffix"):
        model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None
        fim = await require_fim_format(request, model, "suffix")
        fim_prompt = lambda prefix, suffix: (fim.prompt(prefix, suffix), fim.stops)  # noqa: E731
    return await _answer(request, generate_request(body, _default_model(request), fim_prompt), chat=False)


async def _answer(request: web.Request, parsed: OllamaRequest, chat: bool) -> web.StreamResponse:
    reply = OllamaReply(chat, parsed.model, parsed.notes)
    if parsed.params is None:  # a load request: load the model now, or with keep_alive 0 unload it
        engine = handlers_of(request).engine
        name = handlers_of(request).intake.card(parsed.model).name  # 404 for a model that is not configured
        if parsed.keep_alive == 0:
            await engine.call(lambda: engine.controls.unload_model(name))
            return web.json_response(reply.loaded(unloaded=True))
        await engine.call(lambda: engine.controls.load_model(name, parsed.keep_alive))
        return web.json_response(reply.loaded())
    async with RunningJob(request, parsed.params) as job:
        if not parsed.stream:
            pieces = [chunk["text"] async for chunk in job.chunks()]
            result = await job.result()
            return web.json_response(reply.final(result, "".join(pieces), result.get("tool_calls")))
        stream = LazyStream(request, "application/x-ndjson", ndjson_line)
        async for chunk in job.chunks():
            await stream.send(reply.chunk(chunk["text"], chunk.get("tool_calls")))
        # The ollama client raises ResponseError on an error line.
        if (result := await result_in_stream(job, stream, lambda err: ollama_body(from_rpc(err)))) is None:
            return stream.response
        await stream.send(reply.final(result))
        return await stream.finish()


# -- listings -------------------------------------------------------------------------------


async def _models(request: web.Request) -> list[dict[str, Any]]:
    """describe_models of every configured model, loaded or not, from the engine's quick calls."""
    engine = handlers_of(request).engine
    return await engine.call(engine.controls.describe_models)


async def tags(request: web.Request) -> web.Response:
    started_at = handlers_of(request).started_at
    return web.json_response({"models": [model_entry(model, started_at) for model in await _models(request)]})


async def running(request: web.Request) -> web.Response:
    """The loaded models only, as Ollama's /api/ps lists them."""
    return web.json_response({"models": [running_entry(model) for model in await _models(request) if model["loaded"]]})


async def show(request: web.Request) -> web.Response:
    body = await json_object(request)
    reject_unknown(body, ("model", "name", "verbose"))  # verbose only adds tokenizer details; the reply is the same
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("'model' must name a loaded model", "model")
    card = handlers_of(request).intake.card(name)  # 404 for a model that is not configured
    model = next(m for m in await _models(request) if m["name"] == card.name)
    template = getattr(card.encoder.tokenizer, "chat_template", None)
    return web.json_response(
        show_entry(
            model,
            template if isinstance(template, str) else None,
            fim=await fim_format_of(request, card.name) is not None,
        )
    )


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": DAEMON_VERSION})


def _default_model(request: web.Request) -> str:
    return handlers_of(request).engine.default_model or ""
