"""Ollama's request and response shapes (https://github.com/ollama/ollama/blob/main/docs/api.md), to and from prefixd's.

Pure data, no I/O: ``ollama_api`` feeds bodies in and writes what comes out.
Every field of a request is either honoured, accepted where it cannot change
the answer (and named in ``prefixd_notes``), or refused with a 400 naming it.
Replies carry Ollama's counters in the final chunk (prompt_eval_count,
eval_count, durations in nanoseconds) and prefixd's ``cache`` map beside them
as ``prefixd_cache``.

Tools are OpenAI's shape in Ollama's API too: ``tools`` go to the chat
template, a reply's calls come back as ``message.tool_calls``
([{function: {index, name, arguments: object}}]), an assistant message's
``tool_calls`` and a ``tool`` message's ``tool_name`` go back into the chat.
Ollama has no ``tool_choice``: the model decides (prefixd's "auto").

Defaults differ from Ollama's: an omitted temperature is greedy (prefixd's
default), not 0.8, and a model's answer length defaults to 256 tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from ...protocol import methods as m
from ...protocol.keep_alive import parse_keep_alive
from ...protocol.tools import FINISH_TOOL_CALLS
from . import request_fields
from .field_kinds import INTEGER, check_field_kind, check_field_kinds
from .http_errors import invalid, reject_unknown
from .sampling_fields import check_sampling_extras

CHAT_FIELDS = ("model", "messages", "tools", "format", "options", "stream", "keep_alive", "think")
GENERATE_FIELDS = (
    "model",
    "prompt",
    "suffix",
    "images",
    "format",
    "options",
    "system",
    "template",
    "stream",
    "raw",
    "keep_alive",
    "context",
    "think",
)
MESSAGE_FIELDS = ("role", "content", "images", "tool_calls", "thinking", "tool_name")
# Options that tune where and how fast a model runs, never which tokens come out.
RUNTIME_OPTIONS = (
    "num_thread",
    "num_gpu",
    "main_gpu",
    "use_mmap",
    "use_mlock",
    "numa",
    "low_vram",
    "num_batch",
    "f16_kv",
    "vocab_only",
    "logits_all",
    "embedding_only",
)
# Options about truncating a prompt that does not fit: prefixd never truncates (a prompt that does not fit is a 400).
CONTEXT_OPTIONS = ("num_ctx", "num_keep")
NEVER = "2318-01-01T00:00:00Z"  # Ollama's expires_at for a model kept loaded for good
# Ollama ends an answer that called tools with done_reason "stop", as any other that ended by itself.
_DONE_REASONS = {m.FINISH_STOP: "stop", m.FINISH_LENGTH: "length", FINISH_TOOL_CALLS: "stop"}


@dataclass
class OllamaRequest:
    """A parsed /api/chat or /api/generate body: the job's params (None: a bare load request) and the notes to report.

    ``keep_alive``: seconds the model stays loaded once idle (negative: for
    good; None: the daemon's default); a bare load request with 0 unloads it.
    """

    params: m.GenerateParams | None
    model: str
    stream: bool
    notes: list[str] = field(default_factory=list)
    keep_alive: float | None = None


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


# -- requests ---------------------------------------------------------------------------


def chat_request(body: dict[str, Any], default_model: str) -> OllamaRequest:
    reject_unknown(body, CHAT_FIELDS)
    check_field_kinds(body)
    _refuse_features(body, ("think",))
    messages = body.get("messages")
    if messages is None or messages == []:
        return _load_only(body, default_model)  # Ollama's way to load a model: a chat with no messages
    if not isinstance(messages, list):
        raise invalid("'messages' must be an array of {role, content} objects", "messages")
    parsed = [_chat_message(i, message) for i, message in enumerate(messages)]
    tools = {"tools": body["tools"]} if body.get("tools") else {}  # validated by parse_generate
    return _with_options(body, default_model, {"messages": parsed, **tools, **_format_constraint(body.get("format"))})


def generate_request(
    body: dict[str, Any],
    default_model: str,
    fim_prompt: Callable[[str, str], tuple[str, tuple[str, ...]]] | None = None,
) -> OllamaRequest:
    """``fim_prompt(prefix, suffix) -> (prompt text, stop strings)``: the model's FIM format, when ``suffix`` is given."""
    reject_unknown(body, GENERATE_FIELDS)
    check_field_kinds(body)
    _refuse_features(body, ("images", "think", "template", "context"))
    constrained = _format_constraint(body.get("format"))
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise invalid("'prompt' must be a string", "prompt")
    suffix, system, raw = body.get("suffix"), body.get("system"), body.get("raw")
    for name, value, kind in (("suffix", suffix, str), ("system", system, str), ("raw", raw, bool)):
        if value is not None and not isinstance(value, kind):
            raise invalid(f"'{name}' must be a {'string' if kind is str else 'boolean'}", name)
    if not prompt and not suffix:
        return _load_only(body, default_model)  # Ollama's way to load a model: a generate with no prompt
    if suffix:
        if system:
            raise invalid("'system' cannot go with 'suffix': a fill-in-the-middle prompt has no system part", "system")
        assert fim_prompt is not None, "the caller resolves the model's FIM format when a suffix is given"
        text, stops = fim_prompt(prompt or "", suffix)
        return _with_options(body, default_model, {"prompt": text, **constrained}, extra_stops=stops)
    if raw:
        if system:
            raise invalid("'system' cannot go with 'raw': a raw prompt is sent as it is", "system")
        return _with_options(body, default_model, {"prompt": prompt, **constrained})
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return _with_options(body, default_model, {"messages": messages, **constrained})


def _format_constraint(value: Any) -> dict[str, Any]:
    """Ollama's ``format``: "json" (any JSON value: prefixd asks for an object) or a JSON schema, as generate params."""
    if value in (None, ""):
        return {}
    if value == "json":
        return {"constraint": {"json_object": True}}
    if isinstance(value, dict):
        return {"constraint": {"json_schema": value}}
    raise invalid("'format' must be \"json\" or a JSON schema object", "format")


def _refuse_features(body: dict[str, Any], names: tuple[str, ...]) -> None:
    """Fields whose features prefixd does not have yet; their empty values ("", [], false) mean "off" and pass."""
    reasons = {
        "think": "thinking mode is not supported",
        "images": "images are not supported (text models only)",
        "template": "a custom prompt template is not supported; prefixd uses the model's chat template (or raw=true)",
        "context": "the deprecated 'context' token list is not supported; send the conversation to /api/chat "
        "(prefixd's prefix cache makes resending it cheap)",
    }
    for name in names:
        if body.get(name) not in (None, "", [], False):
            raise invalid(f"'{name}' is not supported: {reasons[name]}", name)


def _chat_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise invalid(f"messages[{index}] must be an object with 'role' and 'content'", "messages")
    reject_unknown(message, MESSAGE_FIELDS, f"messages[{index}]")
    for name in ("images", "thinking"):
        if message.get(name) not in (None, "", []):
            raise invalid(f"'messages[{index}].{name}' is not supported yet", f"messages[{index}].{name}")
    role, content = message.get("role"), message.get("content") or ""
    if not isinstance(role, str) or not isinstance(content, str):
        raise invalid(f"messages[{index}] needs a string 'role' and a string 'content'", "messages")
    parsed: dict[str, Any] = {"role": role, "content": content}
    if message.get("tool_calls"):  # {function: {name, arguments: object}}: parse_generate checks them
        parsed["tool_calls"] = message["tool_calls"]
    if message.get("tool_name") is not None:  # a tool result names the tool it comes from (templates read ``name``)
        parsed["name"] = message["tool_name"]
    return parsed


def _load_only(body: dict[str, Any], default_model: str) -> OllamaRequest:
    """Ollama's load request (no prompt, no messages): loads the model, or with keep_alive 0 unloads it."""
    return OllamaRequest(
        None,
        body.get("model") or default_model,
        bool(body.get("stream", True)),
        keep_alive=_keep_alive(body.get("keep_alive")),
    )


def _with_options(
    body: dict[str, Any], default_model: str, prompt: dict[str, Any], extra_stops: tuple[str, ...] = ()
) -> OllamaRequest:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise invalid("'options' must be an object", "options")
    check_field_kinds(options, "options.")
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    sampling = request_fields.generate_fields(
        options, request_fields.FieldNames(max_tokens=None), "options.", extra_stops
    )
    generate: dict[str, Any] = {
        **prompt,
        **sampling,
        "stream": True,
    }  # always streamed to the front; the reply streams if asked
    notes: list[str] = []
    if options.get("num_predict") is not None:
        generate["max_tokens"] = _num_predict(options["num_predict"])
    if body.get("model"):
        generate["model"] = body["model"]
    if body.get("keep_alive") is not None:
        generate["keep_alive"] = _keep_alive(body["keep_alive"])
    extras = {k: v for k, v in options.items() if k not in ("temperature", "top_p", "seed", "stop", "num_predict")}
    for name in RUNTIME_OPTIONS + CONTEXT_OPTIONS:
        if extras.pop(name, None) is not None:
            notes.append(
                f"options.{name}: no effect in prefixd"
                if name in RUNTIME_OPTIONS
                else f"options.{name}: prefixd uses the model's whole context and never truncates a prompt"
            )
    notes += check_sampling_extras(extras, generate.get("temperature", 0.0), "options.")
    params = m.parse_generate(generate)
    return OllamaRequest(params, params.model or default_model, stream, notes, params.keep_alive)


def _num_predict(value: Any) -> int:
    name = "options.num_predict"
    check_field_kind(value, name, (INTEGER,))
    if value in (-1, -2):  # until the end: "infinite" or "fill the context"; the engine stops at the context's end
        return m.MAX_TOKENS_LIMIT
    if value <= 0:
        raise invalid(f"'{name}' must be positive, or -1 (until the model stops or the context is full)", name)
    return request_fields.max_tokens(value, name)


def _keep_alive(value: Any) -> float | None:
    """Seconds (Ollama's durations and numbers; negative: for good), None when absent; a 400 naming it otherwise."""
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise invalid(f"'keep_alive' {exc}", "keep_alive") from None


# -- replies ----------------------------------------------------------------------------


class OllamaReply:
    """The chunks of one /api/chat (``chat``) or /api/generate reply."""

    def __init__(self, chat: bool, model: str, notes: list[str]):
        self.chat = chat
        self.model = model
        self.notes = notes

    def _text(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [_ollama_call(call, position) for position, call in enumerate(calls)]
        return {"message": message}

    def chunk(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A streamed chunk: a piece of text, and the tool calls that became whole in it (prefixd's call maps)."""
        return {"model": self.model, "created_at": now_rfc3339(), **self._text(text, calls), "done": False}

    def final(
        self, result: dict[str, Any], text: str = "", calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The last chunk (``text``, ``calls``: what it carries, the whole answer when not streamed): counters, cache map, notes."""
        timings, usage = result["timings"], result["usage"]
        reply = {
            "model": self.model,
            "created_at": now_rfc3339(),
            **self._text(text, calls),
            "done": True,
            "done_reason": _DONE_REASONS.get(result["finish_reason"], "stop"),
            "total_duration": _ns(timings["total_ms"]),
            "load_duration": 0,  # a model loaded for this request blocked the engine before it was admitted: not timed per request
            "prompt_eval_count": usage["prompt_tokens"],
            "prompt_eval_duration": _ns(timings["prefill_ms"]),
            "eval_count": usage["completion_tokens"],
            "eval_duration": _ns(timings["decode_ms"]),
            "prefixd_cache": result["cache"],
            "prefixd_timings": timings,
        }
        if self.notes:
            reply["prefixd_notes"] = self.notes
        return reply

    def loaded(self, unloaded: bool = False) -> dict[str, Any]:
        """The answer to a load request (no prompt, no messages): the model is loaded now, or (keep_alive 0) unloaded."""
        reply = {
            "model": self.model,
            "created_at": now_rfc3339(),
            **self._text(""),
            "done": True,
            "done_reason": "unload" if unloaded else "load",
        }
        if self.notes:
            reply["prefixd_notes"] = self.notes
        return reply


def _ollama_call(call: dict[str, Any], position: int) -> dict[str, Any]:
    """A call map of prefixd's (OpenAI's: arguments as JSON text) in Ollama's shape: arguments as an object.

    ``index`` counts the answer's calls: a streamed call map has its own, a reply's calls are in order.
    """
    function = call["function"]
    return {
        "function": {
            "index": call.get("index", position),
            "name": function["name"],
            "arguments": json.loads(function["arguments"]),
        }
    }


def _ns(milliseconds: float) -> int:
    return int(round(milliseconds * 1_000_000))


# -- model listings -----------------------------------------------------------------------


def model_entry(model: dict[str, Any], started_at: float) -> dict[str, Any]:
    """One configured model (loaded or not) as /api/tags lists it, from the engine's describe_models."""
    return {
        "name": model["name"],
        "model": model["name"],
        "modified_at": _rfc3339(started_at),
        "size": model["weight_bytes"],
        "digest": model["fingerprint"],
        "details": _details(model),
    }


def running_entry(model: dict[str, Any]) -> dict[str, Any]:
    """One loaded model as /api/ps lists it: its memory and when it unloads (Ollama's far-off "never" while a
    request uses it or it is kept for good); ``prefixd_loaded_at`` says since when."""
    expires_at = model["expires_at"]
    return {
        "name": model["name"],
        "model": model["name"],
        "size": model["resident_bytes"],
        "digest": model["fingerprint"],
        "details": _details(model),
        "expires_at": _rfc3339(expires_at) if expires_at is not None else NEVER,
        "size_vram": 0,
        "context_length": model["context_length"],
        "prefixd_loaded_at": _rfc3339(model["loaded_at"]),
        "prefixd_keep_alive": model["keep_alive"],
    }


def _rfc3339(unix_time: float) -> str:
    return datetime.fromtimestamp(unix_time, timezone.utc).isoformat().replace("+00:00", "Z")


def show_entry(model: dict[str, Any], template: str | None, fim: bool) -> dict[str, Any]:
    capabilities = ["completion"] + (["insert"] if fim else [])
    return {
        "modelfile": "",
        "parameters": "",
        "template": template or "",
        "details": _details(model),
        "model_info": {
            "general.architecture": model.get("architecture") or "",
            "general.basename": model["name"],
            f"{model.get('architecture') or 'prefixd'}.context_length": model["context_length"],
        },
        "capabilities": capabilities,
        "modified_at": now_rfc3339(),
    }


def _details(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "mlx",
        "family": model.get("architecture") or "",
        "families": None,
        "parameter_size": "",
        "quantization_level": model.get("dtype") or "",
    }
