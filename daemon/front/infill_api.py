"""Fill-in-the-middle over HTTP: llama.cpp's POST /infill, and the suffix of /v1/completions and /api/generate.

A model can fill in the middle when its tokenizer has FIM tokens
(``fim_formats``); the format is read once per model, on an encode thread.
Other models get a 400 saying so.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..models.loaded_model import ModelCard
from .fim_formats import FimFormat, detect_fim_format
from .http_errors import invalid
from .http_jobs import LazyStream, RunningJob, handlers_of, json_object, result_in_stream, sse_data
from .infill_shapes import AnswerCut, InfillRequest, infill_reply, infill_request
from .request_fields import stop_strings

_formats: dict[str, FimFormat | None] = {}  # by model fingerprint: a model's tokens never change


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/infill", infill)


def _added_tokens(card: ModelCard) -> list[str]:
    return list(card.encoder.tokenizer.get_added_vocab())


async def fim_format_of(request: web.Request, model: str | None) -> FimFormat | None:
    """The model's FIM format, None when its tokenizer has no FIM tokens."""
    handlers = handlers_of(request)
    card = handlers.intake.card(model)
    if card.fingerprint not in _formats:
        _formats[card.fingerprint] = detect_fim_format(await handlers.intake.run(_added_tokens, card))
    return _formats[card.fingerprint]


async def require_fim_format(request: web.Request, model: str | None, field: str) -> FimFormat:
    fim = await fim_format_of(request, model)
    if fim is None:
        name = handlers_of(request).intake.card(model).name
        raise invalid(
            f"'{field}': model {name} cannot fill in the middle: its tokenizer has no FIM tokens "
            "(<|fim_prefix|>/<|fim_suffix|>/<|fim_middle|>, <fim_prefix>/..., or DeepSeek's)",
            field,
        )
    return fim


async def completion_with_suffix(request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/completions body with ``suffix``, as the same body with the FIM prompt in ``prompt``."""
    prompt, suffix = body.get("prompt", ""), body["suffix"]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not isinstance(suffix, str):
        raise invalid("with 'suffix', 'prompt' and 'suffix' must be strings", "suffix")
    model = body.get("model") or None
    fim = await require_fim_format(request, model if isinstance(model, str) else None, "suffix")
    stops = stop_strings(body.get("stop"), "stop", fim.stops)
    rest = {key: value for key, value in body.items() if key not in ("suffix", "stop")}
    return {**rest, "prompt": fim.prompt(prompt, suffix), **({"stop": list(stops)} if stops else {})}


async def infill(request: web.Request) -> web.StreamResponse:
    body = await json_object(request)
    model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None
    parsed = infill_request(body, await require_fim_format(request, model, "input_prefix"))
    cut = AnswerCut(parsed.n_indent, parsed.t_max_predict_ms)
    async with RunningJob(request, parsed.params, warm_only=parsed.warm_only) as job:
        if parsed.stream:
            return await _stream(request, job, cut, parsed)
        pieces = []
        async for chunk in job.chunks():
            pieces.append(cut.feed(chunk["text"]))
            if cut.cut:
                job.stop_early(cut.cut_by)
        result = await job.result()
        return web.json_response(infill_reply(result, "".join(pieces), cut.cut, parsed))


async def _stream(request: web.Request, job: RunningJob, cut: AnswerCut, parsed: InfillRequest) -> web.StreamResponse:
    # llama.cpp streams /infill as server-sent events: {"content", "stop": false} pieces, then the full object.
    stream = LazyStream(request, "text/event-stream", sse_data)
    async for chunk in job.chunks():
        if text := cut.feed(chunk["text"]):
            await stream.send({"content": text, "stop": False})
        if cut.cut:
            job.stop_early(cut.cut_by)
    if (
        result := await result_in_stream(
            job, stream, lambda err: {"error": {"message": err.message, "prefixd_code": err.code}}
        )
    ) is None:
        return stream.response
    await stream.send(infill_reply(result, "", cut.cut, parsed))
    return await stream.finish()
