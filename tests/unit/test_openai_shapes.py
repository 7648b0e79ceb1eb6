"""OpenAI request bodies to GenerateParams, and prefixd errors to OpenAI's error shape (no model)."""

from __future__ import annotations

import pytest

from prefixd.daemon.front import openai_shapes as shapes
from prefixd.daemon.front.http_options import is_loopback, parse_http_address
from prefixd.protocol import ErrorCode, RpcError


def test_chat_body_becomes_generate_params():
    params = shapes.chat_request({
        "model": "llama", "max_completion_tokens": 7, "temperature": 0.5, "stop": "\n", "stream": True, "user": "ignored",
        "presence_penalty": 0, "session": "s1", "cache": {"store": False},
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]},
        ],
    })
    assert params.prompt.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, there"})
    assert (params.model, params.max_tokens, params.temperature, params.stop, params.stream) == ("llama", 7, 0.5, ("\n",), True)
    assert params.session == "s1" and params.cache.store is False and params.cache.use is True


def test_omitted_fields_take_prefixd_defaults():
    params = shapes.completion_request({"prompt": ["just one"]})
    assert params.prompt.text == "just one" and params.model is None
    assert (params.max_tokens, params.temperature, params.stream) == (256, 0.0, False)
    assert shapes.completion_request({"prompt": [1, 2, 3]}).prompt.tokens == (1, 2, 3)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
])
def test_bad_chat_bodies_are_400_naming_the_param(body, param):
    with pytest.raises(RpcError) as err:
        shapes.chat_request(body)
    status, error = shapes.error_body(err.value)
    assert status == 400 and error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param


def test_completion_refuses_what_it_cannot_do():
    for body in ({"prompt": ["a", "b"]}, {"prompt": "a", "suffix": "z"}, {"prompt": "a", "echo": True}, {"prompt": 3}):
        with pytest.raises(RpcError):
            shapes.completion_request(body)


@pytest.mark.parametrize("code, status", [
    (ErrorCode.MODEL_NOT_FOUND, 404), (ErrorCode.PROMPT_TOO_LONG, 400), (ErrorCode.OVERLOADED, 503),
    (ErrorCode.SHUTTING_DOWN, 503), (ErrorCode.INTERNAL, 500),
])
def test_error_statuses(code, status):
    assert shapes.error_body(RpcError(code, "x"))[0] == status


def test_reply_usage_carries_cached_tokens():
    result = {"model": "m", "text": "hi", "finish_reason": "length", "usage": {"prompt_tokens": 10, "completion_tokens": 2},
              "cache": {"reused_tokens": 9, "hit": "exact"}, "timings": {"ttft_ms": 1.0}}
    reply = shapes.Reply(chat=True, model="m").complete(result)
    assert reply["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 9}}
    assert reply["prefixd_cache"]["hit"] == "exact" and reply["choices"][0]["finish_reason"] == "length"


def test_http_addresses():
    assert parse_http_address("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_http_address("[::1]:9") == ("::1", 9)
    assert parse_http_address("8080") == ("127.0.0.1", 8080)
    with pytest.raises(ValueError):
        parse_http_address("localhost:http")
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.com")
