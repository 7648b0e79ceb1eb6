"""Errors of the HTTP APIs: the 400 that names a field, and each API's own error body.

One table maps prefixd's error codes to HTTP statuses; each API then shapes
the body its clients parse (OpenAI's ``{"error": {...}}``, Ollama's
``{"error": "..."}``, Anthropic's ``{"type": "error", "error": {...}}``). The
middleware picks the shape by path, so even a 401, a 404 route or a 413 body
reach an Ollama or Anthropic client in a form it can show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ...protocol.errors import ErrorCode, RpcError

# prefixd error code -> (HTTP status, OpenAI error type, OpenAI error code). A prompt longer than the context is
# OpenAI's (and llama.cpp's) 400, not a 413: Codex shows context_length_exceeded as "ran out of room in the model's
# context window" at once but retries a 413 five times, and opencode takes a 413 for oversized media, compacts
# the conversation and sends it again, forever.
_HTTP_ERRORS: dict[int, tuple[int, str, str | None]] = {
    ErrorCode.INVALID_PARAMS: (400, "invalid_request_error", None),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error", None),
    ErrorCode.METHOD_NOT_FOUND: (404, "invalid_request_error", "not_found"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error", "context_length_exceeded"),
    ErrorCode.MESSAGE_TOO_LARGE: (413, "invalid_request_error", "request_too_large"),
    ErrorCode.OVERLOADED: (503, "server_error", "overloaded"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error", "shutting_down"),
    ErrorCode.CANCELLED: (499, "server_error", "cancelled"),
}

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def invalid(message: str, param: str | None = None) -> RpcError:
    """INVALID_PARAMS (HTTP 400); ``param`` names the field for the error body."""
    return RpcError(ErrorCode.INVALID_PARAMS, message, {"param": param} if param else None)


def reject_unknown(body: dict[str, Any], allowed: Iterable[str], where: str = "") -> None:
    """A 400 naming the first field of ``body`` that is not in ``allowed``: no field is ignored silently."""
    allowed = set(allowed)
    unknown = sorted(str(key) for key in body if key not in allowed)
    if unknown:
        name = f"{where}.{unknown[0]}" if where else unknown[0]
        raise invalid(
            f"'{name}' is not supported by prefixd" + (f" (nor: {', '.join(unknown[1:])})" if unknown[1:] else ""), name
        )


@dataclass(frozen=True)
class HttpError:
    status: int
    message: str
    kind: str = "invalid_request_error"  # OpenAI's error type
    code: str | None = None
    param: str | None = None
    prefixd_code: int | None = None


def from_rpc(err: RpcError) -> HttpError:
    status, kind, code = _HTTP_ERRORS.get(err.code, (500, "server_error", None))
    param = err.data.get("param") if isinstance(err.data, dict) else None  # the validators name the field at fault
    return HttpError(status, err.message, kind, code, param, err.code)


def anthropic_error(err: RpcError) -> HttpError:
    """prefixd's error as Anthropic's API gives it.

    A prompt too long is Anthropic's 400 ``prompt is too long: N tokens > M
    maximum``, not a 413: Claude Code reads the two numbers out of that
    sentence and says the prompt is too long, while it shows any 413 as
    "Request too large (max 32MB)". M is what the prompt may hold: the
    context less the one token the answer needs at least.
    """
    error = from_rpc(err)
    data = err.data if isinstance(err.data, dict) else {}
    if err.code != ErrorCode.PROMPT_TOO_LONG or not {"prompt_tokens", "context_length"} <= data.keys():
        return error
    size = f"at least {data['prompt_tokens']}" if "at least" in err.message else str(data["prompt_tokens"])
    message = (
        f"prompt is too long: {size} tokens > {data['context_length'] - 1} maximum "
        f"(a context of {data['context_length']} tokens, one kept for the answer)"
    )
    return HttpError(400, message, "invalid_request_error", "context_length_exceeded", None, err.code)


def error_for_path(path: str, err: RpcError) -> HttpError:
    """``err`` as the API that ``path`` belongs to answers it (statuses differ where its clients expect them to)."""
    return anthropic_error(err) if path.startswith("/v1/messages") else from_rpc(err)


def openai_body(error: HttpError) -> dict[str, Any]:
    body: dict[str, Any] = {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}
    if error.prefixd_code is not None:
        body["prefixd_code"] = error.prefixd_code
    return {"error": body}


def ollama_body(error: HttpError) -> dict[str, Any]:
    return {"error": error.message}  # what the ollama client raises ResponseError with


def anthropic_body(error: HttpError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def body_for_path(path: str, error: HttpError) -> dict[str, Any]:
    """The error body in the shape of the API that ``path`` belongs to."""
    if path.startswith("/api/"):
        return ollama_body(error)
    if path.startswith("/v1/messages"):
        return anthropic_body(error)
    return openai_body(error)
