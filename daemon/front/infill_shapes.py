"""llama.cpp's /infill request and reply, as llama.vim and llama.vscode send and read them.

Pure data, no I/O (``infill_api`` runs it). Fields, as in llama.cpp's server:
``input_prefix``, ``input_suffix``, ``input_extra`` ([{filename, text}]),
``prompt`` (the cursor line's text before the cursor, appended to the
prefix), ``n_predict`` (0: a warm-up that only fills the cache), sampling
fields, ``stop``, ``stream``, ``n_indent`` and ``t_max_predict_ms`` (answers cut
as llama.cpp cuts them), ``cache_prompt``, ``response_fields``. Fields that
cannot change prefixd's answer (``id_slot``: prefixd has one shared prefix
store, no slots; ``t_max_prompt_ms``: llama.cpp does not implement it either;
``samplers`` under prefixd's own sampling) are accepted and named in the
reply's ``prefixd_notes``; anything else is a 400 naming it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...protocol import methods as m
from . import request_fields
from .field_kinds import INTEGER, check_field_kind, check_field_kinds
from .fim_formats import FimFormat
from .http_errors import invalid, reject_unknown
from .sampling_fields import check_sampling_extras

_PROMPT_FIELDS = ("input_prefix", "input_suffix", "input_extra", "prompt")
_GENERATE_FIELDS = (
    "model",
    "n_predict",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "cache_prompt",
)
_CUT_FIELDS = ("n_indent", "t_max_predict_ms")
_NOTED_FIELDS = {
    "id_slot": "id_slot: prefixd has one prefix store shared by every request, no slots",
    "t_max_prompt_ms": "t_max_prompt_ms: not applied (llama.cpp does not apply it either)",
    "samplers": "samplers: prefixd samples with temperature and top_p (greedy at temperature 0), not llama.cpp's chain",
    "n_keep": "n_keep: prefixd never truncates a prompt (one that does not fit is a 400)",
    "timings_per_token": None,  # accepted when false (checked below)
    "return_tokens": None,
    "response_fields": None,  # honoured
}
_SAMPLING_EXTRAS = (
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "penalize_nl",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "xtc_probability",
    "xtc_threshold",
    "min_keep",
)
CHUNK_FIELDS = ("filename", "text", "time")


@dataclass
class InfillRequest:
    params: m.GenerateParams
    warm_only: bool  # n_predict 0: fill the cache, answer nothing
    stream: bool
    n_indent: float = 0.0
    t_max_predict_ms: float = 0.0
    response_fields: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


def infill_request(body: dict[str, Any], fim: FimFormat) -> InfillRequest:
    reject_unknown(body, (*_PROMPT_FIELDS, *_GENERATE_FIELDS, *_CUT_FIELDS, *_NOTED_FIELDS, *_SAMPLING_EXTRAS))
    check_field_kinds(body)
    texts = {name: _string(body, name) for name in ("input_prefix", "input_suffix", "prompt")}
    extra = _extra_chunks(body.get("input_extra"))
    notes = [note for name, note in _NOTED_FIELDS.items() if note and name in body]
    if any("time" in chunk for chunk in body.get("input_extra") or ()):
        notes.append("input_extra[].time: no effect on the prompt (as in llama.cpp)")
    for name in ("timings_per_token", "return_tokens"):
        if body.get(name):
            raise invalid(f"'{name}' is not supported", name)
    text = fim.prompt(texts["input_prefix"] + texts["prompt"], texts["input_suffix"], extra, with_files=True)
    sampling = request_fields.generate_fields(body, request_fields.FieldNames(max_tokens=None), added_stops=fim.stops)
    generate: dict[str, Any] = {
        "prompt": text,
        **sampling,
        "stream": True,
    }  # always streamed to the front, which may cut the answer
    length = _answer_length(body)
    warm_only = length == 0
    if length is not None:
        generate["max_tokens"] = 1 if warm_only else length
    if body.get("model") is not None:
        generate["model"] = body["model"]
    if body.get("cache_prompt") is False:
        generate["cache"] = {"use": False}  # llama.cpp's "do not reuse a cached prefix"
    notes += check_sampling_extras(
        {k: body[k] for k in _SAMPLING_EXTRAS if k in body}, generate.get("temperature", 0.0)
    )
    params = m.parse_generate(generate)
    return InfillRequest(
        params,
        warm_only,
        _bool(body, "stream"),
        request_fields.non_negative(body.get("n_indent"), "n_indent"),
        request_fields.non_negative(body.get("t_max_predict_ms"), "t_max_predict_ms"),
        _response_fields(body.get("response_fields")),
        notes,
    )


def _answer_length(body: dict[str, Any]) -> int | None:
    """llama.cpp's n_predict (or max_tokens): 0 a warm-up, negative until the model stops or the context is full; None: absent."""
    name = "n_predict" if body.get("n_predict") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    check_field_kind(value, name, (INTEGER,))
    if value <= 0:
        return 0 if value == 0 else m.MAX_TOKENS_LIMIT
    return request_fields.max_tokens(value, name)


def _string(body: dict[str, Any], name: str) -> str:
    value = body.get(name, "")
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string", name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean", name)
    return value


def _extra_chunks(chunks: Any) -> list[tuple[str, str]]:
    if chunks is None:
        return []
    if not isinstance(chunks, list):
        raise invalid("'input_extra' must be an array of {filename, text} objects", "input_extra")
    parsed = []
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, dict):
            raise invalid(f"input_extra[{index}] must be an object {{filename, text}}", "input_extra")
        reject_unknown(chunk, CHUNK_FIELDS, f"input_extra[{index}]")
        filename, text = chunk.get("filename", "tmp"), chunk.get("text", "")  # llama.cpp's default name: tmp
        if not isinstance(filename, str) or not isinstance(text, str):
            raise invalid(f"input_extra[{index}]: 'filename' and 'text' must be strings", "input_extra")
        parsed.append((filename, text))
    return parsed


def _response_fields(fields: Any) -> tuple[str, ...]:
    if fields is None:
        return ()
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise invalid(
            "'response_fields' must be an array of field paths such as \"timings/prompt_n\"", "response_fields"
        )
    return tuple(fields)


# -- cutting an answer as llama.cpp does ----------------------------------------------------------


class AnswerCut:
    """llama.cpp's two infill limits on a growing answer.

    ``n_indent``: a line after the first whose indentation is smaller ends
    the answer, cut just before that line's first non-blank character.
    ``t_max_predict_ms``: once that long has passed since the first text and
    the answer holds a newline, it ends where it is.
    """

    def __init__(self, n_indent: float, t_max_predict_ms: float):
        self.n_indent = n_indent
        self.deadline_s = t_max_predict_ms / 1000.0
        self.text = ""
        self.cut = False
        self.cut_by = ""  # the limit that cut the answer: "n_indent" or "t_max_predict_ms"
        self._started: float | None = None
        self._checked_to = 0  # where the next unchecked line begins

    def feed(self, piece: str) -> str:
        """The part of ``piece`` that stays in the answer; after a cut, nothing more."""
        if self.cut:
            return ""
        now = time.monotonic()
        self._started = now if self._started is None else self._started
        before = len(self.text)
        self.text += piece
        if self.n_indent > 0 and (end := self._indent_cut()) is not None:
            self.cut, self.cut_by = True, "n_indent"
            self.text = self.text[:end]
            return self.text[before:]
        if self.deadline_s > 0 and now - self._started > self.deadline_s and "\n" in self.text:
            self.cut, self.cut_by = True, "t_max_predict_ms"
        return piece

    def _indent_cut(self) -> int | None:
        text = self.text
        while (newline := text.find("\n", self._checked_to)) >= 0:
            start = newline + 1
            position = start
            while position < len(text) and text[position] in " \t":
                position += 1
            if position == len(text) or text[position] == "\n":
                if position == len(text):
                    return None  # the line's indentation is not known yet
                self._checked_to = position
                continue  # a blank line says nothing about indentation
            if position - start < self.n_indent:
                return position
            self._checked_to = start
        return None


# -- the reply ------------------------------------------------------------------------------------


def infill_reply(result: dict[str, Any], content: str, cut: bool, request: InfillRequest) -> dict[str, Any]:
    """llama.cpp's completion object, with prefixd's cache map beside; filtered to ``response_fields`` if given."""
    usage, timings, cache = result["usage"], result["timings"], result["cache"]
    predicted = usage["completion_tokens"]
    prefilled = cache["prefilled_tokens"]
    reply = {
        "content": content,
        "stop": True,
        "model": result["model"],
        "tokens_predicted": predicted,
        "tokens_evaluated": usage["prompt_tokens"],
        "tokens_cached": cache["reused_tokens"],
        "truncated": False,  # prefixd never truncates a prompt
        "stopped_limit": result["finish_reason"] == m.FINISH_LENGTH or cut,
        "timings": {
            "prompt_n": prefilled,
            "prompt_ms": timings["prefill_ms"],
            "prompt_per_token_ms": timings["prefill_ms"] / prefilled if prefilled else 0.0,
            "prompt_per_second": prefilled / timings["prefill_ms"] * 1000 if timings["prefill_ms"] else 0.0,
            "predicted_n": predicted,
            "predicted_ms": timings["decode_ms"],
            "predicted_per_token_ms": timings["decode_ms"] / predicted if predicted else 0.0,
            "predicted_per_second": timings["decode_tokens_per_s"],
            "cache_n": cache["reused_tokens"],
        },
        "prefixd_cache": cache,
        "prefixd_timings": timings,
    }
    if request.notes:
        reply["prefixd_notes"] = request.notes
    if request.response_fields:
        return {path: value for path in request.response_fields if (value := _at_path(reply, path)) is not _MISSING}
    return reply


_MISSING = object()


def _at_path(obj: Any, path: str) -> Any:
    """llama.cpp's response_fields: "timings/prompt_n" is reply["timings"]["prompt_n"], returned under that path."""
    for key in path.split("/"):
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj
