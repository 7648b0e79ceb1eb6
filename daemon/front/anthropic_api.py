"""Anthropic's Messages API on the HTTP front: POST /v1/messages and /v1/messages/count_tokens.

Streamed replies are server-sent events named by their type (message_start,
content_block_start, content_block_delta, content_block_stop, message_delta,
message_stop), as Anthropic's clients read them.

A system-role message inside ``messages`` goes to the model's template where
it stands. A template that cannot place one there (it raises) gets Anthropic's
own 400 for models without mid-conversation system messages, ``role 'system'
is not supported on this model``: on that wording Claude Code sends the
request again with the message folded into the user turn (checked with Claude
Code 2.1.197; any other wording stops it with "API Error: 400").
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.methods import parse_prompt_input
from .agent_prompts import PromptNormalizer
from .anthropic_fields import hint_notes
from .anthropic_shapes import COUNT_FIELDS, MessagesReply, MessagesRequest, messages_request, prompt_messages
from .anthropic_tools import generate_tool_fields
from .http_errors import anthropic_body, anthropic_error, invalid, reject_unknown
from .http_jobs import CLIENT_KEY, LazyStream, RunningJob, compact_json, handlers_of, json_object, result_in_stream

NORMALIZER_KEY = web.AppKey("prompt_normalizer", PromptNormalizer)
TEMPLATE_REJECTED = (
    "the chat template rejected the messages"  # prompt_encoding's INVALID_PARAMS for a template that raised
)
SYSTEM_ROLE_REFUSED = "role 'system' is not supported on this model"  # Anthropic's wording, which Claude Code acts on

log = structlog.get_logger("prefixd.http")


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/messages", messages)
    router.add_post("/v1/messages/count_tokens", count_tokens)


def _named_event(obj: dict[str, Any]) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + compact_json(obj) + b"\n\n"


def _sender(request: web.Request) -> str:
    """Who sent the request, for once-per-client log lines: its User-Agent (one per agent and version), else its connection."""
    return request.headers.get("User-Agent") or request[CLIENT_KEY]


def _parse(request: web.Request, body: dict[str, Any]) -> MessagesRequest:
    normalizer, sender = request.app[NORMALIZER_KEY], _sender(request)
    parsed = messages_request(
        body,
        handlers_of(request).engine.default_model or "",
        request.headers.get("anthropic-beta"),
        lambda system: normalizer.anthropic_system(system, sender),
    )
    if parsed.notes:
        fields = sorted({note.split(" ", 1)[0].rstrip(":") for note in parsed.notes})
        if normalizer.first_time(sender, "notes:" + ",".join(fields)):
            log.info("request_fields_without_effect", client_agent=sender, fields=fields, notes=parsed.notes)
    return parsed


async def messages(request: web.Request) -> web.StreamResponse:
    body = await json_object(request)
    parsed = _parse(request, body)
    try:
        return await _answer(request, body, parsed)
    except RpcError as err:
        if (
            parsed.system_in_messages
            and err.code == ErrorCode.INVALID_PARAMS
            and err.message.startswith(TEMPLATE_REJECTED)
        ):
            raise invalid(
                f"{SYSTEM_ROLE_REFUSED}: the model's chat template takes system text only where it puts the "
                f"system prompt ({err.message})",
                "messages",
            ) from None
        raise


async def _answer(request: web.Request, body: dict[str, Any], parsed: MessagesRequest) -> web.StreamResponse:
    stream_reply = body.get("stream", False)
    if not isinstance(stream_reply, bool):
        raise invalid("'stream' must be a boolean", "stream")
    reply = MessagesReply(parsed.model, parsed.notes, parsed.normalized)
    async with RunningJob(request, parsed.params) as job:
        if not stream_reply:
            pieces = [chunk["text"] async for chunk in job.chunks()]
            result = await job.result()
            return web.json_response(reply.message(result, "".join(pieces)))
        stream = LazyStream(request, "text/event-stream", _named_event)

        async def start(prompt_tokens: int) -> None:
            for event in reply.start_events(prompt_tokens):
                await stream.send(event)

        async for chunk in job.chunks():
            if not stream.started:
                await start(job.prompt_tokens() or 0)  # encoded before any chunk, so known here
            for event in reply.text_events(chunk["text"]) if chunk["text"] else []:
                await stream.send(event)
            for call in chunk.get("tool_calls", []):
                for event in reply.tool_use_events(call):
                    await stream.send(event)
        # An "error" event: the anthropic client raises on it.
        if (result := await result_in_stream(job, stream, lambda err: anthropic_body(anthropic_error(err)))) is None:
            return stream.response
        if not stream.started:
            await start(result["usage"]["prompt_tokens"])
        for event in reply.end_events(result):
            await stream.send(event)
        return await stream.finish()


async def count_tokens(request: web.Request) -> web.Response:
    body = await json_object(request)
    reject_unknown(body, COUNT_FIELDS)
    notes = hint_notes(body, None)  # checked as for a message, so that a count never passes what a message refuses
    normalizer, sender = request.app[NORMALIZER_KEY], _sender(request)
    chat = prompt_messages(body, notes, lambda system: normalizer.anthropic_system(system, sender))
    model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else None
    prompt = parse_prompt_input({"messages": chat, **generate_tool_fields(body, notes)})  # tools are counted too
    _, encoded = await handlers_of(request).intake.encode(model, prompt, generates=None)
    return web.json_response({"input_tokens": len(encoded.tokens)})
