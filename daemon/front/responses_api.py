"""OpenAI's Responses API on the HTTP front: what Codex, the Agents SDK and ``client.responses`` speak.

``POST /v1/responses`` (streamed as named server-sent events, or not),
``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``
and ``POST /v1/responses/input_tokens``. A request becomes one generate job
like every other front's (one engine, one prefix store); ``previous_response_id``
continues a stored conversation (response_store), rendered exactly as the
turn before it, so the next turn reuses all of it, answer included.

Streamed events, in OpenAI's order: ``response.created``,
``response.in_progress``; per text answer ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; per call ``response.output_item.added``,
``response.function_call_arguments.delta``, ``.done``,
``response.output_item.done``; then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it, or
``response.failed`` when the job failed after the stream began).
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from aiohttp import web

from ...protocol.errors import RpcError
from ...protocol.methods import parse_prompt_input
from . import http_errors
from .http_jobs import LazyStream, RunningJob, compact_json, handlers_of, json_body
from .response_store import ResponseStore
from .responses_items import function_call_item, message_item, new_item_id, output_items
from .responses_shapes import ResponsesRequest, final_status, response_object, responses_request

log = structlog.get_logger("prefixd.http")
STORE_KEY = web.AppKey("responses_store", ResponseStore)
MAX_OUTPUT_TOKENS_KEY = web.AppKey(
    "responses_max_output_tokens", int
)  # when a request names none (--max-output-tokens)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/responses", create)
    router.add_post("/v1/responses/input_tokens", input_tokens)
    router.add_get("/v1/responses/{response_id}", retrieve)
    router.add_delete("/v1/responses/{response_id}", delete)
    router.add_get("/v1/responses/{response_id}/input_items", list_input_items)


def _not_found(response_id: str, param: str | None = None) -> web.Response:
    what = "Previous response" if param else "Response"
    error = http_errors.HttpError(
        404,
        f"{what} with id '{response_id}' not found (responses are kept in memory, "
        "bounded in number and size, and across restarts only with the disk cache on)",
        "invalid_request_error",
        "previous_response_not_found" if param else "not_found",
        param,
    )
    return web.json_response(http_errors.openai_body(error), status=404)


def _store(request: web.Request) -> ResponseStore:
    return request.app[STORE_KEY]


async def _parsed(request: web.Request) -> tuple[ResponsesRequest, list[dict[str, Any]]] | web.Response:
    body = await json_body(request)
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    history: list[dict[str, Any]] = []
    if isinstance(previous, str):
        found = _store(request).conversation(previous)
        if found is None:
            return _not_found(previous, "previous_response_id")
        history = found
    parsed = responses_request(body, history, request.app[MAX_OUTPUT_TOKENS_KEY])
    if parsed.notes:
        log.info("request_fields_left_out", api="responses", notes=parsed.notes)
    return parsed, history


async def create(request: web.Request) -> web.StreamResponse:
    parsed_or_error = await _parsed(request)
    if isinstance(parsed_or_error, web.Response):
        return parsed_or_error
    parsed, history = parsed_or_error
    model = parsed.params.model or handlers_of(request).engine.default_model or ""
    response_id, created_at = new_item_id("resp"), int(time.time())
    async with RunningJob(request, parsed.params) as job:
        if not parsed.stream:
            result = await job.result()
            final = response_object(
                response_id,
                parsed,
                model,
                created_at,
                final_status(result),
                output_items(result, parsed.namespaces),
                result,
            )
            _remember(request, parsed, final, history)
            return web.json_response(final)
        events = ResponseEvents(response_id, parsed, model, created_at)
        stream = LazyStream(request, "text/event-stream", _named_event)
        async for chunk in job.chunks():
            if not stream.started:
                await _send_all(stream, events.start())
            if chunk["text"]:
                await _send_all(stream, events.text(chunk["text"]))
            for call in chunk.get("tool_calls", []):
                await _send_all(stream, events.call(call))
        try:
            result = await job.result()
        except RpcError as err:
            if not stream.started:
                raise  # its own HTTP status and error body
            await _send_all(stream, events.failed(err))
            return await stream.finish()
        if not stream.started:
            await _send_all(stream, events.start())
        final_events = events.finish(result)
        _remember(request, parsed, final_events[-1]["response"], history)
        await _send_all(stream, final_events)
        return await stream.finish()


def _remember(
    request: web.Request, parsed: ResponsesRequest, final: dict[str, Any], history: list[dict[str, Any]]
) -> None:
    if parsed.store:
        _store(request).put(final, history, parsed.items)


async def _send_all(stream: LazyStream, events: list[dict[str, Any]]) -> None:
    for event in events:
        await stream.send(event)


def _named_event(obj: dict[str, Any]) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + compact_json(obj) + b"\n\n"


class ResponseEvents:
    """The streamed events of one response, numbered; the output items they build, as the final object holds them."""

    def __init__(self, response_id: str, parsed: ResponsesRequest, model: str, created_at: int):
        self.response_id = response_id
        self.parsed = parsed
        self.model = model
        self.created_at = created_at
        self.output: list[dict[str, Any]] = []  # finished items
        self._text_id: str | None = None  # the message item being streamed
        self._text = ""
        self._num_events = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        return event

    def _object(
        self, status: str, result: dict[str, Any] | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return response_object(
            self.response_id, self.parsed, self.model, self.created_at, status, list(self.output), result, error
        )

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._object("in_progress")),
            self._event("response.in_progress", response=self._object("in_progress")),
        ]

    def text(self, piece: str) -> list[dict[str, Any]]:
        events = []
        if self._text_id is None:
            self._text_id, self._text = new_item_id("msg"), ""
            where = {"output_index": len(self.output)}
            events += [
                self._event("response.output_item.added", **where, item=message_item(self._text_id, "", "in_progress")),
                self._event(
                    "response.content_part.added",
                    item_id=self._text_id,
                    **where,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                ),
            ]
        self._text += piece
        return events + [
            self._event(
                "response.output_text.delta",
                item_id=self._text_id,
                output_index=len(self.output),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        ]

    def _close_text(self) -> list[dict[str, Any]]:
        if self._text_id is None:
            return []
        item = message_item(self._text_id, self._text)
        where = {"item_id": self._text_id, "output_index": len(self.output), "content_index": 0}
        events = [
            self._event("response.output_text.done", **where, text=self._text, logprobs=[]),
            self._event("response.content_part.done", **where, part=item["content"][0]),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self._text_id = None
        return events

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call (prefixd holds a call back until it is complete): its item, its arguments in one delta."""
        events = self._close_text()
        item_id, index = new_item_id("fc"), len(self.output)
        item = function_call_item(item_id, call, self.parsed.namespaces)
        events += [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, self.parsed.namespaces, "in_progress", ""),
            ),
            self._event(
                "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=item["arguments"]
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        return events

    def finish(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events; the last one's ``response`` is the final object (the one stored)."""
        if not self.output and self._text_id is None:
            self.text("")  # an empty answer is still one message item, as a non-streamed reply has
        events = self._close_text()
        status = final_status(result)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self._object(status, result))]

    def failed(self, err: RpcError) -> list[dict[str, Any]]:
        error = http_errors.from_rpc(err)
        return self._close_text() + [
            self._event(
                "response.failed",
                response=self._object("failed", error={"code": error.code or "server_error", "message": error.message}),
            )
        ]


async def retrieve(request: web.Request) -> web.Response:
    stored = _store(request).get(request.match_info["response_id"])
    if stored is None:
        return _not_found(request.match_info["response_id"])
    return web.json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not _store(request).delete(response_id):
        return _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    stored = _store(request).get(request.match_info["response_id"])
    if stored is None:
        return _not_found(request.match_info["response_id"])
    items = [{"id": item.get("id") or new_item_id("item"), **item} for item in stored.input_items]
    return web.json_response(
        {
            "object": "list",
            "data": items,
            "has_more": False,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
        }
    )


async def input_tokens(request: web.Request) -> web.Response:
    """The prompt's token count, tools included, as the request would render it."""
    parsed_or_error = await _parsed(request)
    if isinstance(parsed_or_error, web.Response):
        return parsed_or_error
    prompt = parsed_or_error[0].params.prompt
    fields: dict[str, Any] = {"messages": list(prompt.messages)}
    if prompt.tools:
        fields["tools"] = list(prompt.tools)
    _, encoded = await handlers_of(request).intake.encode(
        parsed_or_error[0].params.model, parse_prompt_input(fields), generates=None
    )
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(encoded.tokens)})
