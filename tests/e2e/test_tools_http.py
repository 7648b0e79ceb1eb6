"""Tools over HTTP, each API in its own shape, driven by the official clients against the real daemon.

The model is the random tiny llama with a Hermes tools template (llama-tools):
it calls a tool only when forced (OpenAI "required" or a named function,
Anthropic "any" or "tool"), and constrained decoding then makes its call
valid, so the parsers and every front's shapes are tested end to end. Each
front runs an agent loop's second turn and shows, in its native field, that
the whole first turn (prompt and answer) came from the cache.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

from tests.support.http_daemon import http_daemon  # noqa: E402

MODEL = "llama-tools"
# additionalProperties false keeps a random model from writing properties of its own until max_tokens.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
# WEATHER as the ollama client sends it (type, required, properties; no other keyword), for a loop whose turns go
# through different clients and must render the same tools each time. Greedy, the tiny model stops after "days".
OLLAMA_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "enum": [1, 2, 3]}}}}}
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESULT = '{"sky": "clear", "high_c": 21}'


@pytest.fixture(scope="module")
def daemon(tiny_tools_dir, tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("tools-http"), [tiny_tools_dir]) as live:
        yield live


@pytest.fixture
def openai_client(daemon):
    with openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=daemon.token, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def anthropic_client(daemon):
    with anthropic.Anthropic(base_url=daemon.base_url, api_key=daemon.token, max_retries=0, timeout=120) as client:
        yield client


def user(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def check_arguments(name: str, arguments: dict) -> None:
    if name == "get_weather":
        assert list(arguments) == ["city", "days"] and len(arguments["city"]) <= 12 and arguments["days"] in (1, 2, 3)
    else:
        assert name == "get_time" and arguments == {"zone": arguments["zone"]} and arguments["zone"] in ("utc", "local")


# -- OpenAI ------------------------------------------------------------------------------------------


def test_openai_a_named_call_comes_back_as_message_tool_calls(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=user("Weather in Oslo?"), tools=TOOLS, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    check_arguments("get_weather", json.loads(call.function.arguments))


def test_openai_a_streamed_call_arrives_as_delta_tool_calls(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=user("Stream a call"), tools=TOOLS, max_tokens=100, tool_choice="required", stream=True))
    deltas = [d for chunk in chunks if chunk.choices for d in (chunk.choices[0].delta.tool_calls or [])]
    # As OpenAI streams a call: its index, id, type and name first, then its arguments, joined by index.
    head, arguments = deltas
    assert head.index == arguments.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.arguments == "" and arguments.id is None and arguments.function.name is None
    check_arguments(head.function.name, json.loads(arguments.function.arguments))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == ""  # no markup as text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"


def test_openai_an_agent_loop_reuses_the_previous_turn_answer_included(openai_client):
    messages = user("What is the weather in Paris?")
    first = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=100,
                                                  tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8,
                                                   tool_choice="none")
    previous_turn = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= previous_turn
    cache = second.model_extra["prefixd_cache"]
    assert cache["reused_tokens"] >= previous_turn and cache["checkpoint"] == "answer-end", cache
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


def test_openai_what_cannot_be_honoured_is_a_400_naming_the_field(openai_client):
    for kwargs, field in (({"functions": [{"name": "f"}]}, "functions"),
                          ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
                          ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as err:
            openai_client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=4, **kwargs)
        assert f"'{field}'" in str(err.value), err.value
    one = openai_client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=100, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1  # a forced call is always exactly one


# -- Anthropic ---------------------------------------------------------------------------------------


def test_anthropic_a_forced_tool_comes_back_as_a_tool_use_block(anthropic_client):
    message = anthropic_client.messages.create(model=MODEL, max_tokens=100, messages=user("Weather in Rome?"),
                                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    check_arguments("get_weather", block.input)


def test_anthropic_a_streamed_tool_use_block_sends_its_input_as_json_deltas(anthropic_client):
    with anthropic_client.messages.stream(model=MODEL, max_tokens=100, messages=user("Any tool"),
                                          tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}) as stream:
        events = list(stream)
        message = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts[-1] == "tool_use" and message.stop_reason == "tool_use"
    block = message.content[-1]
    check_arguments(block.name, block.input)
    assert all(b.type == "text" and b.text == "" for b in message.content[:-1])  # no call markup as text


def test_anthropic_an_agent_loop_with_tool_result_reuses_the_previous_turn(anthropic_client):
    messages = user("What time is it?")
    first = anthropic_client.messages.create(model=MODEL, max_tokens=100, messages=messages, tools=ANTHROPIC_TOOLS,
                                             tool_choice={"type": "tool", "name": "get_time"})
    (block,) = first.content
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "12:00"},
                                              {"type": "text", "text": "Thanks."}]}]
    second = anthropic_client.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=ANTHROPIC_TOOLS,
                                              tool_choice={"type": "none"})
    previous_turn = (first.usage.input_tokens + first.usage.cache_read_input_tokens) + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens >= previous_turn, second.usage
    assert second.model_extra["prefixd_cache"]["checkpoint"] == "answer-end"
    assert second.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in second.content)
    counted = anthropic_client.messages.count_tokens(model=MODEL, messages=messages, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_anthropic_what_cannot_be_honoured_is_a_400_naming_the_field(anthropic_client):
    for kwargs, field in (({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
                          ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
                           "tool_choice.disable_parallel_tool_use"),
                          ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice")):
        with pytest.raises(anthropic.BadRequestError) as err:
            anthropic_client.messages.create(model=MODEL, max_tokens=4, messages=user("x"), **kwargs)
        assert f"'{field}'" in err.value.body["error"]["message"], err.value.body


# -- Ollama ------------------------------------------------------------------------------------------


def test_ollama_a_tool_loop_sends_calls_and_results_back_and_reuses_the_previous_turn(daemon, openai_client):
    # Ollama's API has no way to force a call: the first turn's call is forced through OpenAI's, on the same store.
    question = user("Weather in Lima for two days?")
    first = openai_client.chat.completions.create(model=MODEL, messages=question, tools=[OLLAMA_WEATHER], max_tokens=100,
                                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    messages = question + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "content": RESULT, "tool_name": call.function.name}]
    # Ollama's replies have no cached-token field and its client drops prefixd's: the cache is read from the raw reply.
    status, raw = daemon.post_json("/api/chat", {"model": MODEL, "messages": messages, "tools": [OLLAMA_WEATHER], "stream": False,
                                                 "options": {"num_predict": 8}})
    previous_turn = first.usage.prompt_tokens + first.usage.completion_tokens
    assert status == 200 and raw["prefixd_cache"]["reused_tokens"] >= previous_turn, raw["prefixd_cache"]
    client = ollama.Client(host=daemon.base_url, headers=daemon.headers(), timeout=120)
    reply = client.chat(model=MODEL, messages=messages, tools=[OLLAMA_WEATHER], stream=False, options={"num_predict": 8})
    assert reply.done and reply.message.role == "assistant" and reply.prompt_eval_count == raw["prompt_eval_count"]
    assert not reply.message.tool_calls  # the random model calls nothing unforced
