"""Structured output through the HTTP fronts' official clients: OpenAI's response_format, Ollama's format.

The tiny llama has random weights, so only constrained decoding can make its
answers parse: every answer here must be JSON matching the schema asked for.
"""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from tests.e2e.test_openai_http import default_token_file, wait_for_http
from tests.support.http_daemon import http_daemon
from tests.support.live_daemon import LiveDaemon, free_tcp_port

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Name a city and its population, as JSON."}]


@pytest.fixture(scope="module")
def openai_client(tiny_llama_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("structured-openai")
    port = free_tcp_port()
    with LiveDaemon(tiny_llama_dir, workdir, ["--http", f"127.0.0.1:{port}"]) as live:
        base_url = f"http://127.0.0.1:{port}/v1"
        with httpx.Client(base_url=base_url) as probe:
            wait_for_http(probe, live)
        token = default_token_file(workdir).read_text().strip()
        with openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=120) as client:
            yield client


def _matches_schema(answer: str) -> dict:
    value = json.loads(answer)
    assert set(value) == {"city", "population"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["population"], int) and not isinstance(value["population"], bool)
    return value


def test_openai_json_schema_answers_match_the_schema_and_a_repeat_is_a_hit(openai_client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    first = openai_client.chat.completions.create(model="llama", messages=CHAT, max_tokens=96,
                                                  response_format=response_format)
    again = openai_client.chat.completions.create(model="llama", messages=CHAT, max_tokens=96,
                                                  response_format=response_format)
    assert first.choices[0].finish_reason == "stop"  # the grammar completed the object
    _matches_schema(first.choices[0].message.content)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.model_extra["prefixd_cache"]["hit"] == "exact"


def test_openai_json_object_and_the_streamed_answer_parses(openai_client):
    stream = openai_client.chat.completions.create(model="llama", messages=CHAT, max_tokens=48, stream=True,
                                                   response_format={"type": "json_object"})
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(pieces)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert finish == "length" and text.startswith("{")


def test_openai_bad_response_format_and_tools_are_400s_naming_the_field(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="llama", messages=CHAT, max_tokens=4,
                                              response_format={"type": "yaml"})
    assert "response_format" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="llama", messages=CHAT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert "json_schema" in str(err.value)
    tools = [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="llama", messages=CHAT, max_tokens=4, tools=tools)
    assert "tools[0].function.parameters" in str(err.value)
    # The daemon still serves.
    assert openai_client.chat.completions.create(model="llama", messages=CHAT, max_tokens=2).choices


def test_ollama_format_schema_and_json(tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("structured-ollama")) as live:
        client = ollama.Client(host=live.base_url, headers=live.headers(), timeout=120)
        chat = client.chat(model="llama", messages=CHAT, format=SCHEMA, stream=False, options={"num_predict": 96})
        _matches_schema(chat.message.content)
        generated = client.generate(model="llama", prompt="JSON please:", format="json", stream=False,
                                    options={"num_predict": 48})
        if generated.done_reason == "stop":
            assert isinstance(json.loads(generated.response), dict)
        else:
            assert generated.response.startswith("{")
