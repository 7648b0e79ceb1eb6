"""OpenAI's Responses API (/v1/responses), driven by the official ``openai`` client against a real daemon.

What Codex CLI and the Agents SDK speak: items in, items out, streamed as
named events, and stateful through ``previous_response_id``, whose next turn
must reuse the whole previous turn from the prefix cache, answer included.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from tests.e2e.test_openai_http import client, daemon  # noqa: E402,F401  (the HTTP daemon and its client)
from tests.support.live_daemon import LiveDaemon, free_tcp_port  # noqa: E402

INSTRUCTIONS = "You are a terse assistant for the prefixd project. Answer in one line."


def cache_of(response) -> dict:
    return response.model_extra["prefixd_cache"]


def test_a_repeat_reports_cached_tokens(client):
    first = client.responses.create(model="llama", instructions=INSTRUCTIONS, input="What is a radix tree?",
                                    max_output_tokens=8)
    second = client.responses.create(model="llama", instructions=INSTRUCTIONS, input="What is a radix tree?",
                                     max_output_tokens=8)
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.output_text and second.output_text == first.output_text  # greedy, cached or not
    assert second.usage.input_tokens == first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens == second.usage.input_tokens == cache_of(second)["reused_tokens"]
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens"


def test_the_stream_sends_openais_events_in_order(client):
    whole = client.responses.create(model="llama", input="Stream a few words about caches.", max_output_tokens=10)
    events = list(client.responses.create(model="llama", input="Stream a few words about caches.",
                                          max_output_tokens=10, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.usage.input_tokens_details.cached_tokens == final.usage.input_tokens


def test_previous_response_id_reuses_the_whole_previous_turn(client):
    first = client.responses.create(model="llama", instructions=INSTRUCTIONS, max_output_tokens=12,
                                    input="Name three uses of a prefix cache.")
    second = client.responses.create(model="llama", instructions=INSTRUCTIONS, max_output_tokens=6,
                                     previous_response_id=first.id, input="And one more?")
    assert second.previous_response_id == first.id
    # The whole first turn, its answer included, came from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    assert cache_of(second)["hit"] == "partial"
    # The same turn sent as items (store: false, the way Codex sends it) is the same prompt.
    items = [{"role": "user", "content": "Name three uses of a prefix cache."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
             {"role": "user", "content": "And one more?"}]
    again = client.responses.create(model="llama", instructions=INSTRUCTIONS, max_output_tokens=6, input=items, store=False)
    assert again.usage.input_tokens == second.usage.input_tokens and again.output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)  # store: false keeps nothing


def test_stored_responses_can_be_read_listed_and_deleted(client):
    created = client.responses.create(model="llama", input="Hello there", max_output_tokens=4, metadata={"run": "7"})
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text and fetched.metadata == {"run": "7"}
    items = client.responses.input_items.list(created.id)
    assert [item.role for item in items.data] == ["user"]
    assert client.responses.delete(created.id) is None or True  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="llama", input="next", previous_response_id=created.id)
    assert "previous_response_id" in str(missing.value) or created.id in str(missing.value)


def test_structured_output_through_text_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
    response = client.responses.create(model="llama", input="Name a city as JSON.", max_output_tokens=48,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    if response.status == "completed":
        assert "city" in json.loads(response.output_text)


CODEX_LIKE = {
    "model": "llama", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0b9e1d2c", "client_metadata": {"session_id": "0b9e1d2c"},
    "input": [
        {"type": "message", "id": "msg_a", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>cwd /tmp</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]},
    ],
    "tools": [
        {"type": "web_search", "external_web_access": False},
    ],
}


def test_what_codex_sends_is_accepted_and_the_left_out_parts_are_named(daemon):
    import urllib.request

    request = urllib.request.Request(daemon.base_url + "/responses", data=json.dumps({**CODEX_LIKE, "max_output_tokens": 6}).encode(),
                                     headers={"Authorization": f"Bearer {daemon.token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in reply.read().decode().splitlines() if line.startswith("data: ")]
    final = events[-1]["response"]
    assert final["status"] in ("completed", "incomplete") and final["store"] is False
    notes = " ".join(final["prefixd_notes"])
    for left_out in ("reasoning", "reasoning.encrypted_content", "prompt_cache_key", "'web_search'"):
        assert left_out in notes
    assert "request_fields_left_out" in daemon.log_text()


@pytest.mark.parametrize("extra, field", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="llama", input="hi", extra_body=extra)  # raw, past the SDK's own checks
    assert refused.value.body["param"] == field


def test_stored_conversations_outlive_a_restart_with_the_disk_cache(tiny_llama_dir, tmp_path):
    port = free_tcp_port()
    args = ["--http", f"127.0.0.1:{port}", "--http-no-token", "--disk-cache-bytes", "64M", "--cache-dir", str(tmp_path / "kv")]
    with LiveDaemon(tiny_llama_dir, tmp_path, args) as live:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=5) as client:
            first = client.responses.create(model="llama", input="Remember the word 'radix'.", max_output_tokens=6)
    with LiveDaemon(tiny_llama_dir, tmp_path, args) as live:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=5) as client:
            assert client.responses.retrieve(first.id).output_text == first.output_text
            second = client.responses.create(model="llama", input="Which word?", previous_response_id=first.id,
                                             max_output_tokens=4)
            assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert "responses_loaded" in live.log_text()


READ_FILE = {"type": "function", "name": "read_file", "description": "Read a file of the project.",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
SHELL = {"type": "namespace", "name": "shell", "description": "Shell tools.",
         "tools": [{"type": "function", "name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                                        "required": ["cmd"]}}]}


def test_a_function_call_and_its_output_continue_the_stored_conversation(client):
    # The tiny llama's template has no tools: prefixd's generic tool section carries them (tools: generic).
    first = client.responses.create(model="llama", input="Read the README.", tools=[READ_FILE], tool_choice="required",
                                    max_output_tokens=64)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "read_file"
    assert "path" in json.loads(calls[0].arguments)
    assert cache_of(first)["tools"] == "generic"
    second = client.responses.create(model="llama", previous_response_id=first.id, tools=[READ_FILE], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "# prefixd"}])
    # The call came back as the model wrote it, so the whole first turn, the call included, is reused.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1


def test_a_namespaced_tool_is_called_by_its_namespace_and_name(client):
    events = list(client.responses.create(model="llama", input="List the files.", tools=[SHELL], max_output_tokens=64,
                                          tool_choice={"type": "function", "name": "shell.run"}, stream=True))
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = events[-1].response.output[-1]
    assert call.type == "function_call" and call.namespace == "shell" and call.name == "run"
    assert "cmd" in json.loads(call.arguments)
