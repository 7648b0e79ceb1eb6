"""Anthropic's Messages API, driven by the official ``anthropic`` package against a real daemon (tiny models)."""

from __future__ import annotations

import json
import re

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
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),  # runs on Anthropic's side
    ({"extra_body": {"top_k": 5, "temperature": 0.5}}, "top_k"),  # this client sends sampling fields only as extras
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "messages[0].content[0].type"),
    # Would change what the model reads, and prefixd does not make the change: refused, not ignored.
    ({"extra_body": {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}}, "context_management.edits[0].type"),
    ({"extra_body": {"output_config": {"task_budget": {"type": "tokens", "total": 4000}}}}, "output_config.task_budget"),
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}}, "mcp_servers"),
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


def test_hints_agents_send_are_accepted_and_named(client):
    # What Claude Code sends on every request, plus the other labels of the policy (anthropic_fields).
    raw = client.messages.with_raw_response.create(
        model="llama", max_tokens=2, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 1024},
        service_tier="auto", metadata={"user_id": "someone"}, extra_headers={"anthropic-beta": "context-management-2025-06-27"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                    "output_config": {"effort": "low"}})
    reply = raw.http_response.json()
    named = [note.split(" ", 1)[0].rstrip(":") for note in reply["prefixd_notes"]]
    assert named == ["thinking", "context_management", "service_tier", "output_config.effort", "anthropic-beta",
                     "metadata.user_id"]
    assert reply["content"][0]["type"] == "text"  # no thinking blocks: the model does not think


def test_output_config_format_is_honoured(client):
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}}, "required": ["title"],
              "additionalProperties": False}
    reply = client.messages.create(model="llama", max_tokens=40, messages=MESSAGES,
                                   extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert reply.stop_reason == "end_turn"
    assert set(json.loads(reply.content[0].text)) == {"title"}  # even random weights answer the schema


def test_a_system_message_inside_messages_is_read_where_it_stands(client):
    # Anthropic's mid-conversation system messages; Claude Code sends one after the first user turn.
    late = [*MESSAGES, {"role": "system", "content": "Answer in one word."}]
    plain = client.messages.count_tokens(model="llama", messages=MESSAGES).input_tokens
    with_system = client.messages.count_tokens(model="llama", messages=late).input_tokens
    assert with_system > plain + 4
    reply = client.messages.create(model="llama", max_tokens=3, messages=late)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == with_system


def test_a_prompt_too_long_is_anthropics_400(client):
    # Claude Code reads "prompt is too long: N tokens > M maximum" and says so; a 413 it shows as "Request too large".
    long_text = "the quick brown fox jumps over the lazy dog " * 2000
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="llama", max_tokens=4, messages=[{"role": "user", "content": long_text}])
    error = err.value.body["error"]
    assert err.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert re.match(r"prompt is too long: (at least )?\d+ tokens > 8191 maximum", error["message"]), error["message"]
    tokens = int(re.search(r"(\d+) tokens", error["message"]).group(1))
    assert tokens > 8191
