"""Anthropic's Messages API on the HTTP front: POST /v1/messages and /v1/messages/count_tokens.

Streamed replies are server-sent events named by their type (message_start,
content_block_start, content_block_delta, content_block_stop, message_delta,
message_stop), as Anthropic's clients read them.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ...protocol.methods import parse_prompt_input
from .anthropic_shapes import COUNT_FIELDS, MessagesReply, StopSequences, messages_request, prompt_messages
from .anthropic_tools import generate_tool_fields
from .http_errors import anthropic_body, from_rpc, invalid, reject_unknown
from .http_jobs import LazyStream, RunningJob, compact_json, handlers_of, json_object, result_in_stream


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/messages", messages)
    router.add_post("/v1/messages/count_tokens", count_tokens)


def _named_event(obj: dict[str, Any]) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + compact_json(obj) + b"\n\n"


async def messages(request: web.Request) -> web.StreamResponse:
    body = await json_object(request)
    parsed = messages_request(body, handlers_of(request).engine.default_model or "")
    stream_reply = body.get("stream", False)
    if not isinstance(stream_reply, bool):
        raise invalid("'stream' must be a boolean", "stream")
    reply = MessagesReply(parsed.model, parsed.notes)
    stops = StopSequences(parsed.stop_sequences)
    async with RunningJob(request, parsed.params) as job:
        if not stream_reply:
            pieces = []
            async for chunk in job.chunks():
                pieces.append(stops.feed(chunk["text"]))
                if stops.matched is not None:
                    job.stop_early("stop_sequence")
            result = await job.result()
            return web.json_response(reply.message(result, "".join(pieces) + stops.flush(), stops.matched))
        stream = LazyStream(request, "text/event-stream", _named_event)

        async def start(prompt_tokens: int) -> None:
            for event in reply.start_events(prompt_tokens):
                await stream.send(event)

        async for chunk in job.chunks():
            text = stops.feed(chunk["text"])
            if stops.matched is not None:
                job.stop_early("stop_sequence")
            if not stream.started:
                await start(job.prompt_tokens() or 0)  # encoded before any chunk, so known here
            for event in reply.text_events(text) if text else []:
                await stream.send(event)
            for call in chunk.get("tool_calls", []):
                for event in reply.tool_use_events(call):
                    await stream.send(event)
        # An "error" event: the anthropic client raises on it.
        if (result := await result_in_stream(job, stream, lambda err: anthropic_body(from_rpc(err)))) is None:
            return stream.response
        if not stream.started:
            await start(result["usage"]["prompt_tokens"])
        for event in reply.text_events(tail) if (tail := stops.flush()) else []:
            await stream.send(event)
        for event in reply.end_events(result, stops.matched):
            await stream.send(event)
        return await stream.finish()


async def count_tokens(request: web.Request) -> web.Response:
    body = await json_object(request)
    reject_unknown(body, COUNT_FIELDS)
    notes: list[str] = []
    chat = prompt_messages(body, notes)
    model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None
    prompt = parse_prompt_input({"messages": chat, **generate_tool_fields(body, notes)})  # tools are counted too
    _, encoded = await handlers_of(request).intake.encode(model, prompt, generates=None)
    return web.json_response({"input_tokens": len(encoded.tokens)})
