"""Anthropic's Messages API, driven by the official ``anthropic`` package against a real daemon (tiny models)."""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")

from tests.support.http_daemon import http_daemon  # noqa: E402

SYSTEM = "You are the terse assistant of an Anthropic client test."
MESSAGES = [{"role": "user", "content": "Which events does a streamed message send?"}]


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("anthropic")) as live:
        yield live


@pytest.fixture
def client(daemon):
    # The token as the API key: the client sends it as x-api-key, which the daemon accepts like a bearer token.
    with anthropic.Anthropic(base_url=daemon.base_url, api_key=daemon.token, max_retries=0, timeout=60) as client:
        yield client


def test_message_usage_splits_the_prompt_into_computed_and_cached(client):
    first = client.messages.create(model="llama", max_tokens=8, system=SYSTEM, messages=MESSAGES)
    again = client.messages.create(model="llama", max_tokens=8, system=SYSTEM, messages=MESSAGES)
    assert first.type == "message" and first.role == "assistant" and first.content[0].type == "text"
    assert first.stop_reason in ("end_turn", "max_tokens") and first.content[0].text == again.content[0].text
    assert first.usage.output_tokens == again.usage.output_tokens <= 8
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert total == again.usage.input_tokens + again.usage.cache_read_input_tokens > 10
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert again.usage.input_tokens < first.usage.input_tokens


def test_max_tokens_stop_reason(client):
    reply = client.messages.create(model="llama", max_tokens=1, messages=MESSAGES)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 1


def test_stop_sequence_is_named(client):
    # Random weights: learn what the model says first, then stop on a piece of it.
    said = client.messages.create(model="llama", max_tokens=12, messages=MESSAGES).content[0].text  # greedy
    assert len(said) > 4
    stop = said[2:4]
    reply = client.messages.create(model="llama", max_tokens=12, messages=MESSAGES, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == said[: said.find(stop)]


def test_streaming_sends_every_event_and_the_final_usage(client):
    with client.messages.stream(model="llama", max_tokens=10, system=SYSTEM, messages=MESSAGES) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    assert final.usage.cache_read_input_tokens > 0  # the same system prompt and question as above


def test_count_tokens_matches_the_prompt(client):
    count = client.messages.count_tokens(model="llama", system=SYSTEM, messages=MESSAGES).input_tokens
    reply = client.messages.create(model="llama", max_tokens=1, system=SYSTEM, messages=MESSAGES)
    assert count == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_content_blocks_with_cache_control_are_text(daemon):
    body = {"model": "llama", "max_tokens": 2, "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]}
    status, reply = daemon.post_json("/v1/messages", body)
    assert status == 200 and reply["usage"]["cache_read_input_tokens"] > 0
    assert any("cache_control" in note for note in reply["prefixd_notes"]) and "prefixd_cache" in reply


@pytest.mark.parametrize("kwargs, field", [
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ({"extra_body": {"top_k": 5, "temperature": 0.5}}, "top_k"),  # this client sends sampling fields only as extras
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "messages[0].content[0].type"),
    ({"service_tier": "auto"}, "service_tier"),
    ({"output_config": {"effort": "low"}}, "output_config"),
])
def test_unsupported_fields_are_400_naming_the_field(client, kwargs, field):
    arguments = {"model": "llama", "max_tokens": 4, "messages": MESSAGES, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**arguments)
    error = err.value.body["error"]
    assert error["type"] == "invalid_request_error" and f"'{field}'" in error["message"]


def test_a_wrong_key_is_refused_in_anthropics_shape(daemon):
    with anthropic.Anthropic(base_url=daemon.base_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as err:
            client.messages.create(model="llama", max_tokens=1, messages=MESSAGES)
    assert err.value.body["error"]["type"] == "authentication_error"
