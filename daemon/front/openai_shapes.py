"""OpenAI's request and response shapes, translated to and from prefixd's.

Pure data, no I/O: ``openai_api`` feeds request bodies in and writes what
comes out. Requests become the same ``GenerateParams`` the socket front
builds (through ``protocol.methods.parse_generate``, so both fronts validate
alike); replies carry prefixd's ``cache`` map as ``prefixd_cache`` and its
``reused_tokens`` as ``usage.prompt_tokens_details.cached_tokens``.

Fields prefixd cannot honour change the answer, so they are refused (n > 1,
logprobs), and so is any field OpenAI does not define. On /v1/chat/completions,
fields that only label the request or tune OpenAI's own service (user,
metadata, store, service_tier, ...) are accepted, penalties and the sampling
extras other servers take (top_k, min_p, ...) only where they cannot change
the answer (sampling_fields); ``response_format`` becomes a
constraint (constrained decoding); ``tools`` and ``tool_choice`` go to the
generate as they are (OpenAI's shapes are the socket's), and the calls come
back as ``message.tool_calls`` or streamed ``delta.tool_calls``; the
deprecated ``functions`` / ``function_call`` are refused. /v1/completions refuses every
field it does not honour, naming it (``user`` is accepted: it only labels
the caller). ``suffix`` reaches it as a FIM prompt built by ``infill_api``.
Omitted sampling fields take prefixd's defaults: greedy, 256 tokens.
llama.cpp's ``cache_prompt``, ``id_slot`` and ``samplers`` (llama.vim's
instruction mode sends them) are accepted on /v1/chat/completions and named in
``prefixd_notes``; ``cache_prompt: false`` is honoured. ``stream_options``
must be an object. A field of the wrong JSON type is a 400 naming it (field_kinds).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ...protocol import methods as m
from ...protocol.errors import RpcError
from ...protocol.tools import FINISH_TOOL_CALLS
from . import http_errors, request_fields
from .field_kinds import BOOLEAN, check_field_kind, check_field_kinds
from .sampling_fields import GREEDY_EXACT, NEUTRAL_VALUES, check_sampling_extras

_FINISH_REASONS = {m.FINISH_STOP: "stop", m.FINISH_LENGTH: "length", FINISH_TOOL_CALLS: "tool_calls"}
_invalid = http_errors.invalid


def error_body(err: RpcError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI-shaped body for a prefixd error."""
    error = http_errors.from_rpc(err)
    return error.status, http_errors.openai_body(error)


def http_error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict[str, Any]:
    return http_errors.openai_body(http_errors.HttpError(0, message, kind, code))


# -- requests -------------------------------------------------------------------------


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling and prefixd fields shared by both endpoints, as generate params."""
    if body.get("n") not in (None, 1):
        raise _invalid("only n=1 is supported", "n")
    for name in ("logprobs", "top_logprobs"):
        if body.get(name):
            raise _invalid("logprobs are not supported", name)
    # max_completion_tokens replaced max_tokens on chat; a client may send both (the newer one counts).
    length = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = request_fields.generate_fields(body, request_fields.FieldNames(max_tokens=length))
    for key, value in (
        ("stream", body.get("stream")),
        ("model", body.get("model") or None),
        ("session", body.get("session")),
        ("cache", body.get("cache")),
    ):
        if value is not None:
            params[key] = value
    return params


# /v1/chat/completions: the fields prefixd honours; those that only label the request or tune OpenAI's own
# service (they cannot change the answer); penalties and other servers' sampling extras (checked by
# sampling_fields); prefixd's own session and cache. Any other is a 400 naming it.
CHAT_FIELDS = (
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "session",
    "cache",
)
CHAT_LABEL_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
CHAT_SAMPLING_EXTRAS = GREEDY_EXACT + tuple(NEUTRAL_VALUES)
# llama.cpp server's own fields, which llama.vim's instruction mode sends: hints here, named in prefixd_notes.
# cache_prompt false is honoured (no cached prefix reused), as on /infill.
LLAMA_CPP_HINTS = {
    "cache_prompt": "cache_prompt: prefixd reuses and stores every prompt prefix on its own",
    "id_slot": "id_slot: prefixd has one prefix store shared by every request, no slots",
    "samplers": "samplers: prefixd samples with temperature and top_p (greedy at temperature 0), not llama.cpp's chain",
}


def chat_request(body: Any, notes: list[str] | None = None) -> m.GenerateParams:
    """A /v1/chat/completions body as GenerateParams; what was accepted without effect is appended to ``notes``."""
    if not isinstance(body, dict):
        raise _invalid("the request body must be a JSON object")
    http_errors.reject_unknown(body, CHAT_FIELDS + CHAT_LABEL_FIELDS + CHAT_SAMPLING_EXTRAS + tuple(LLAMA_CPP_HINTS))
    check_field_kinds(body)
    if body.get("logit_bias"):
        raise _invalid("'logit_bias' is not supported", "logit_bias")
    _check_stream_options(body)
    hints = _llama_cpp_hints(body)
    if notes is not None:
        notes += hints
    extras = {name: body.get(name) for name in CHAT_SAMPLING_EXTRAS}
    check_sampling_extras(extras, request_fields.temperature(body.get("temperature"), "temperature"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty array", "messages")
    params = {
        **_common(body),
        **_tool_fields(body),
        "messages": [_chat_message(i, msg) for i, msg in enumerate(messages)],
    }
    if body.get("cache_prompt") is False and "cache" not in params:
        params["cache"] = {"use": False}  # llama.cpp's "do not reuse a cached prefix"
    constraint = response_format_constraint(body.get("response_format"))
    if constraint is not None:
        params["constraint"] = constraint
    return m.parse_generate(params)


def _check_stream_options(body: dict[str, Any]) -> None:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("'stream_options' must be an object, such as {\"include_usage\": true}", "stream_options")
    if options is not None:
        check_field_kind(options.get("include_usage"), "stream_options.include_usage", (BOOLEAN,))


def _llama_cpp_hints(body: dict[str, Any]) -> list[str]:
    """Notes on llama.cpp's fields in ``body`` (their types are checked with the others': field_kinds)."""
    return [
        note
        for name, note in LLAMA_CPP_HINTS.items()
        if body.get(name) is not None and not (name == "cache_prompt" and body[name] is False)
    ]


def response_format_constraint(response_format: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as a generate's ``constraint`` map (None for plain text).

    ``json_object``: any JSON object; ``json_schema``: the schema, always
    enforced (constrained decoding makes every answer match it, so
    ``strict: false`` gets the same guarantee).
    """
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _invalid("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
        return {"json_schema": schema}
    raise _invalid('\'response_format.type\' must be "text", "json_object" or "json_schema"', "response_format")


def _tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as generate params (validated there); what prefixd cannot honour is refused."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise _invalid(f"'{name}' is OpenAI's deprecated form of tool calls: send 'tools' and 'tool_choice'", name)
    choice = body.get("tool_choice")
    if body.get("parallel_tool_calls") is False and body.get("tools") and choice in (None, "auto"):
        # A forced call is always exactly one; under "auto" the model writes as many as it likes.
        raise _invalid(
            "'parallel_tool_calls' false is honoured only with a 'tool_choice' that forces one call "
            '("required" or a named function)',
            "parallel_tool_calls",
        )
    return {key: body[key] for key in ("tools", "tool_choice") if body.get(key) is not None}


def _chat_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _invalid(f"messages[{index}] must be an object with a string 'role'", "messages")
    content = message.get("content")
    if content is None and message.get("tool_calls"):
        content = ""  # an assistant turn that only calls tools
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _invalid(f"messages[{index}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _invalid(f"messages[{index}].content must be a string or an array of text parts", "messages")
    role = "system" if message["role"] == "developer" else message["role"]
    # tool_calls (assistant) and tool_call_id / name (tool) are checked by parse_generate
    tool_keys = {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if message.get(key) is not None}
    return {"role": role, "content": content, **tool_keys}


# /v1/completions: every field OpenAI defines (and prefixd's own session and cache); any other is a 400 naming it.
COMPLETION_FIELDS = (
    "model",
    "prompt",
    "suffix",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "best_of",
    "logit_bias",
    "user",
    "seed",
    "session",
    "cache",
)


def completion_request(body: Any) -> m.GenerateParams:
    """A /v1/completions body as GenerateParams (prompt: text, [text] or [token ids]).

    ``suffix`` must have been turned into a FIM prompt by the front first
    (infill_api.completion_with_suffix): only the front knows the model's FIM tokens.
    """
    if not isinstance(body, dict):
        raise _invalid("the request body must be a JSON object")
    http_errors.reject_unknown(body, COMPLETION_FIELDS)
    check_field_kinds(body)
    _check_stream_options(body)
    if body.get("suffix"):
        raise _invalid("'suffix' (fill-in-the-middle) must go through the front's FIM prompt", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _invalid(f"'{name}' is not supported except at 0", name)
    if body.get("best_of") not in (None, 1):
        raise _invalid("only best_of=1 is supported", "best_of")
    if body.get("logit_bias"):
        raise _invalid("'logit_bias' is not supported", "logit_bias")
    if body.get("echo"):
        raise _invalid("'echo' is not supported", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return m.parse_generate({**_common(body), "prompt": prompt})
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return m.parse_generate({**_common(body), "tokens": prompt})
    raise _invalid("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")


def wants_usage(body: Any) -> bool:
    """stream_options.include_usage: a last streamed chunk with the usage."""
    options = body.get("stream_options") if isinstance(body, dict) else None
    return isinstance(options, dict) and bool(options.get("include_usage"))


# -- replies ----------------------------------------------------------------------------


class Reply:
    """Builds the objects of one reply, streamed or not; id and created stay fixed."""

    def __init__(self, chat: bool, model: str, notes: list[str] | None = None):
        self.chat = chat
        self.model = model
        self.notes = notes or []  # fields accepted without effect (prefixd_notes)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def complete(self, result: dict[str, Any]) -> dict[str, Any]:
        """The whole reply of a non-streamed request."""
        finish = _FINISH_REASONS.get(result["finish_reason"], "stop")
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": result["text"]}
            if result.get("tool_calls"):
                message = {"role": "assistant", "content": result["text"] or None, "tool_calls": result["tool_calls"]}
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": result["text"], "finish_reason": finish, "logprobs": None}
        return {**self._envelope(self.object, [choice]), **self.extras(result)}

    def extras(self, result: dict[str, Any]) -> dict[str, Any]:
        """usage (with cached_tokens), prefixd_cache and prefixd_timings."""
        usage = result["usage"]
        return {
            "usage": {
                "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": usage["completion_tokens"],
                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": result["cache"]["reused_tokens"]},
            },
            "prefixd_cache": result["cache"],
            "prefixd_timings": result["timings"],
            **({"prefixd_notes": self.notes} if self.notes else {}),
        }

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        """One streamed chunk: a piece of text, or the closing chunk with its finish reason."""
        finish = _FINISH_REASONS.get(finish_reason, "stop") if finish_reason else None
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope(
            "text_completion", [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
        )

    def tool_call_chunks(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Whole calls as OpenAI streams them: per call a ``delta.tool_calls`` chunk with its index, id, type and
        name (arguments ""), then one with its arguments; clients join the pieces by ``index``.

        prefixd holds a call back until it is complete (its markup must not
        reach the text), so its arguments come in one piece, not token by token.
        """
        chunks = []
        for call in calls:
            function = call["function"]
            head = {
                "index": call["index"],
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": ""},
            }
            chunks += [
                self._tool_delta(head),
                self._tool_delta({"index": call["index"], "function": {"arguments": function["arguments"]}}),
            ]
        return chunks

    def _tool_delta(self, piece: dict[str, Any]) -> dict[str, Any]:
        return self._envelope(
            "chat.completion.chunk",
            [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None, "logprobs": None}],
        )

    def closing_chunk(self, result: dict[str, Any]) -> dict[str, Any]:
        """The chunk that carries the finish reason, plus prefixd's cache figures."""
        extras = self.extras(result)
        return {
            **self.chunk(finish_reason=result["finish_reason"]),
            **{key: value for key, value in extras.items() if key.startswith("prefixd_")},
        }

    def usage_chunk(self, result: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        return {**self._envelope(self.object + (".chunk" if self.chat else ""), []), **self.extras(result)}


RESIDENCY_KEYS = ("loaded", "resident_bytes", "weight_bytes", "loaded_at", "expires_at", "keep_alive", "active_jobs")


def models_list(described: list[dict[str, Any]], created: int) -> dict[str, Any]:
    """OpenAI's model list from the engine's describe_models, with each model's residency and tools path beside OpenAI's fields."""
    return {
        "object": "list",
        "data": [
            {
                "id": model["name"],
                "object": "model",
                "created": created,
                "owned_by": "prefixd",
                "prefixd_residency": {key: model[key] for key in RESIDENCY_KEYS},
                "prefixd_tools": model.get("tools"),
            }  # template | generic | none: how the model takes tools, once known
            for model in described
        ],
    }
