"""Tools in the HTTP fronts' shapes, without a daemon: requests become prefixd's tool params, replies each API's shape."""

from __future__ import annotations

import pytest

from prefixd.daemon.front.anthropic_shapes import MessagesReply, messages_request
from prefixd.protocol.errors import RpcError
from prefixd.daemon.front.ollama_shapes import OllamaReply, chat_request
from prefixd.daemon.front.openai_shapes import chat_request as openai_chat_request
from prefixd.protocol.tools import FUNCTION, REQUIRED

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
RESULT = {"model": "m", "text": "", "finish_reason": "tool_calls", "tool_calls": [CALL],
          "usage": {"prompt_tokens": 10, "completion_tokens": 5},
          "cache": {"reused_tokens": 4, "prefilled_tokens": 6}, "timings": {"total_ms": 1.0, "prefill_ms": 0.5, "decode_ms": 0.5}}


def test_anthropic_tools_choice_and_tool_blocks_become_prefixds():
    parsed = messages_request({"model": "m", "max_tokens": 8, "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
                               "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}],
                                      "is_error": True}, {"type": "text", "text": "And tomorrow?"}]}]}, "m")
    params = parsed.params
    assert params.prompt.tools[0]["function"] == {"name": "get_weather", "parameters": SCHEMA}
    assert params.tool_choice.mode == FUNCTION and params.tool_choice.function == "get_weather"
    roles = [message["role"] for message in params.prompt.messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assistant, tool = params.prompt.messages[1], params.prompt.messages[2]
    assert assistant["content"] == "Looking." and assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: sunny"}
    assert any("is_error" in note for note in parsed.notes)
    any_choice = messages_request({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"},
                                   "tools": [{"name": "get_weather", "input_schema": SCHEMA}]}, "m")
    assert any_choice.params.tool_choice.mode == REQUIRED


def test_anthropic_reply_and_stream_carry_tool_use_blocks():
    reply = MessagesReply("m", [])
    message = reply.message(RESULT, "")
    assert message["stop_reason"] == "tool_use"
    assert message["content"] == [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}]
    events = reply.start_events(10) + reply.text_events("Hi") + reply.tool_use_events({**CALL, "index": 0}) + reply.text_events("!")
    events += reply.end_events(RESULT)
    blocks = [(e["type"], e.get("index")) for e in events if e["type"].startswith("content_block")]
    assert blocks == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
                      ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
                      ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2)]
    assert events[5]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}


def test_ollama_tool_messages_go_in_and_calls_come_out_as_its_client_reads_them():
    ollama = pytest.importorskip("ollama")
    parsed = chat_request({"model": "m", "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
                           "messages": [{"role": "user", "content": "Weather?"},
                                        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                                        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]}, "m")
    assert parsed.params.prompt.messages[1]["content"] == "" and parsed.params.prompt.messages[2]["name"] == "get_weather"
    reply = ollama.ChatResponse.model_validate(OllamaReply(True, "m", []).final(RESULT, "", RESULT["tool_calls"]))
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Oslo"} and reply.done_reason == "stop"


def test_openai_tool_messages_and_a_deprecated_functions_field():
    params = openai_chat_request({"messages": [{"role": "user", "content": "x"},
                                               {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                                  "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
                                  "tool_choice": "required"})
    assert params.tool_choice.mode == REQUIRED and params.prompt.messages[2]["tool_call_id"] == "call_1"
    assert params.prompt.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    with pytest.raises(RpcError, match="'functions'"):
        openai_chat_request({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]})
