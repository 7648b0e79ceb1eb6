"""A request field of the wrong JSON type is a 400 naming the field, on every HTTP API, never a 500 or a silent yes.

Through the real daemon's HTTP front: for each API's sampling, length and
switch fields, each JSON type the field does not take (a string, an array,
an object, a boolean for a number; a number for a boolean ...) is sent in an
otherwise good request. ``n: true`` used to pass as 1, ``top_k: "40"`` as
nothing at temperature 0, Ollama's ``options.stop: 5`` was a 500.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.support.http_daemon import http_daemon

MESSAGES = [{"role": "user", "content": "Say hi."}]
WRONG_VALUES = {"string": "1", "array": [1], "object": {"value": 1}, "boolean": True, "integer": 1, "fraction": 1.5}
# The kinds of WRONG_VALUES each field takes; every other kind is sent and refused.
NUMBER, INTEGER, BOOLEAN = ("integer", "fraction"), ("integer",), ("boolean",)
STRING_OR_ARRAY, OBJECT = ("string", "array"), ("object",)

# path -> (a good body, {field (dotted: nested): the JSON types it takes})
FRONTS: dict[str, tuple[dict[str, Any], dict[str, tuple[str, ...]]]] = {
    "/v1/chat/completions": ({"messages": MESSAGES, "max_tokens": 2}, {
        "max_tokens": INTEGER, "max_completion_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER,
        "seed": INTEGER, "n": INTEGER, "top_logprobs": INTEGER, "top_k": INTEGER, "min_p": NUMBER, "typical_p": NUMBER,
        "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "repeat_penalty": NUMBER, "stream": BOOLEAN,
        "stream_options": OBJECT, "stream_options.include_usage": BOOLEAN, "parallel_tool_calls": BOOLEAN,
        "cache_prompt": BOOLEAN, "id_slot": INTEGER, "stop": STRING_OR_ARRAY}),
    "/v1/completions": ({"prompt": "Say hi.", "max_tokens": 2}, {
        "max_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER, "seed": INTEGER, "n": INTEGER, "best_of": INTEGER,
        "presence_penalty": NUMBER, "frequency_penalty": NUMBER, "stream": BOOLEAN, "stream_options": OBJECT,
        "stream_options.include_usage": BOOLEAN, "echo": BOOLEAN, "stop": STRING_OR_ARRAY}),
    "/v1/messages": ({"messages": MESSAGES, "max_tokens": 2}, {
        "max_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER, "top_k": INTEGER, "stream": BOOLEAN}),
    "/api/chat": ({"messages": MESSAGES, "stream": False, "options": {"num_predict": 2}}, {
        "stream": BOOLEAN, "keep_alive": ("string", "integer", "fraction"), "options": OBJECT, "options.num_predict": INTEGER,
        "options.temperature": NUMBER, "options.top_p": NUMBER, "options.seed": INTEGER, "options.top_k": INTEGER,
        "options.min_p": NUMBER, "options.repeat_penalty": NUMBER, "options.repeat_last_n": INTEGER,
        "options.num_ctx": INTEGER, "options.num_thread": INTEGER, "options.use_mmap": BOOLEAN,
        "options.stop": STRING_OR_ARRAY}),
    "/api/generate": ({"prompt": "Say hi.", "stream": False, "options": {"num_predict": 2}}, {
        "stream": BOOLEAN, "raw": BOOLEAN, "options.num_predict": INTEGER, "options.temperature": NUMBER,
        "options.top_k": INTEGER, "options.stop": STRING_OR_ARRAY}),
    "/infill": ({"model": "llama-fim", "input_prefix": "def f(", "input_suffix": ")", "n_predict": 2}, {
        "n_predict": INTEGER, "max_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER, "seed": INTEGER,
        "top_k": INTEGER, "min_p": NUMBER, "repeat_penalty": NUMBER, "repeat_last_n": INTEGER, "n_indent": NUMBER,
        "t_max_predict_ms": NUMBER, "t_max_prompt_ms": NUMBER, "id_slot": INTEGER, "n_keep": INTEGER,
        "stream": BOOLEAN, "cache_prompt": BOOLEAN, "stop": STRING_OR_ARRAY}),
    "/v1/responses": ({"input": "Say hi.", "max_output_tokens": 2}, {
        "max_output_tokens": INTEGER, "temperature": NUMBER, "top_p": NUMBER, "stream": BOOLEAN, "store": BOOLEAN,
        "parallel_tool_calls": BOOLEAN, "top_logprobs": INTEGER, "stream_options": OBJECT}),
}
CASES = [(path, field, kind) for path, (_, fields) in FRONTS.items() for field, takes in fields.items()
         for kind in WRONG_VALUES if kind not in takes]


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("field-types")) as live:
        yield live


def with_field(body: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """``body`` with ``field`` set to ``value``; a dotted field goes into the object it names (made if absent)."""
    body = copy.deepcopy(body)
    *parents, name = field.split(".")
    place = body
    for parent in parents:
        place = place.setdefault(parent, {})
    place[name] = value
    return body


def error_message(body: dict[str, Any]) -> str:
    """The message of an error body in any API's shape: OpenAI's, Anthropic's or Ollama's."""
    error = body["error"]
    return error if isinstance(error, str) else error["message"]


def test_every_good_body_is_answered(daemon):
    for path, (body, _) in FRONTS.items():
        status, reply = daemon.post_json(path, body)
        assert status == 200, (path, reply)


@pytest.mark.parametrize("path, field, kind", CASES, ids=[f"{path}:{field}:{kind}" for path, field, kind in CASES])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(daemon, path, field, kind):
    good, _ = FRONTS[path]
    status, reply = daemon.post_json(path, with_field(good, field, WRONG_VALUES[kind]))
    assert status == 400, (status, reply)
    assert f"'{field}'" in error_message(reply), reply


def test_no_wrong_type_reached_the_daemon_as_its_own_fault(daemon):
    faults = [line for line in daemon.log_lines() if line["level"] in ("error", "critical")]
    assert not faults, faults
