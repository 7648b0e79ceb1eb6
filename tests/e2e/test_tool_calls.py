"""Tools through the real daemon and socket: a forced call, the calls read back out of answers, an agent loop's reuse.

The model is the random tiny llama with a Hermes tools template
(tests/support/tiny_models.py, llama-tools): constrained decoding makes it
write a valid call when ``tool_choice`` forces one, which tests the parser end
to end. A ``constraint`` that writes a call with text before it stands in for
a model that chooses to call under "auto". The plain tiny llama, whose ChatML
template has no tools, takes them through prefixd's generic tool section.
"""

from __future__ import annotations

import json

import pytest

from prefixd.client import Client
from prefixd.client.errors import PrefixdError
from prefixd.daemon.grammar import forced_tool_call
from prefixd.daemon.models.tool_call_format import ToolCallFormat
from tests.e2e.daemon_process import DaemonProcess
from tests.support.tiny_models import HERMES_TOOLS_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
HERMES = ToolCallFormat("json_tools", "<tool_call>", "</tool_call>", lambda text: [])


@pytest.fixture(scope="module")
def daemon(tiny_tools_dir, tiny_llama_dir, tmp_path_factory):
    with DaemonProcess([tiny_tools_dir, tiny_llama_dir], tmp_path_factory.mktemp("tools")) as running:
        yield running


@pytest.fixture
def client(daemon):
    with Client(daemon.socket_path, timeout=120) as connected:
        yield connected


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def check_weather_arguments(arguments: dict) -> None:
    assert list(arguments) == ["city", "days"] and isinstance(arguments["city"], str) and len(arguments["city"]) <= 10
    assert type(arguments["days"]) is int and 1 <= arguments["days"] <= 7


def test_a_forced_call_comes_back_as_tool_calls_whose_arguments_match_the_schema(client):
    named = client.generate(messages=chat("Weather in Oslo?"), tools=TOOLS, max_tokens=100,
                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named["finish_reason"] == "tool_calls" and named["text"] == ""
    (call,) = named["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    check_weather_arguments(json.loads(call["function"]["arguments"]))
    for seed in (1, 2, 3):
        required = client.generate(messages=chat(f"Anything {seed}?"), tools=TOOLS, max_tokens=100, tool_choice="required",
                                   temperature=1.0, seed=seed)
        (call,) = required["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            check_weather_arguments(arguments)
        else:
            assert call["function"]["name"] == "get_time" and arguments["zone"] in ("utc", "local")
        assert required["finish_reason"] == "tool_calls"


def test_a_streamed_call_arrives_whole_in_a_chunk_and_its_markup_never_as_text(client):
    stream = client.stream(messages=chat("Stream the weather"), tools=TOOLS, max_tokens=100, tool_choice="required")
    chunks = list(stream)
    assert not any("tool_call>" in chunk["text"] for chunk in chunks)
    streamed = [call for chunk in chunks for call in chunk.get("tool_calls", [])]
    result = stream.result
    assert [call["index"] for call in streamed] == [0]
    assert [{k: v for k, v in call.items() if k != "index"} for call in streamed] == result["tool_calls"]
    assert "".join(chunk["text"] for chunk in chunks) == result["text"] == ""
    assert [chunk["index"] for chunk in chunks] == list(range(len(chunks)))


def test_under_auto_a_call_in_the_answer_is_read_out_and_the_text_around_it_kept(client):
    forced = forced_tool_call([WEATHER], HERMES, special_tokens={"<tool_call>", "</tool_call>"})
    lark = forced.source.replace("start: ", 'start: "Let me look.\\n" ', 1)  # a call after some text
    for stream in (False, True):
        params = dict(messages=chat(f"Look it up ({stream})"), tools=TOOLS, max_tokens=120, constraint={"lark": lark})
        if stream:
            with client.stream(**params) as running:
                chunks = list(running)
            reply = running.result
            assert "".join(chunk["text"] for chunk in chunks).strip() == "Let me look."
            assert not any("tool_call>" in chunk["text"] for chunk in chunks)
        else:
            reply = client.generate(**params)
        assert reply["text"] == "Let me look." and reply["finish_reason"] == "tool_calls"
        (call,) = reply["tool_calls"]
        check_weather_arguments(json.loads(call["function"]["arguments"]))
        untouched = client.generate(**params, tool_choice="none")  # "none": the answer is text, calls and all
        assert untouched["text"].startswith("Let me look.\n<tool_call>\n{") and untouched["finish_reason"] == "stop"
        assert "tool_calls" not in untouched


def test_an_agent_loop_reuses_the_whole_previous_context(client):
    messages = chat("What is the weather in Paris this week?")
    first = client.generate(messages=messages, tools=TOOLS, max_tokens=100, tool_choice="required")
    (call,) = first["tool_calls"]
    messages += [{"role": "assistant", "content": first["text"], "tool_calls": first["tool_calls"]},
                 {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear", "high_c": 21}'}]
    second = client.generate(messages=messages, tools=TOOLS, max_tokens=8)
    previous = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["cache"]["reused_tokens"] >= previous, second["cache"]
    assert second["cache"]["checkpoint"] == "answer-end"


def test_what_cannot_be_honoured_is_refused(client):
    with pytest.raises(PrefixdError, match="cannot go with 'constraint'"):
        client.generate(messages=chat("x"), tools=TOOLS, tool_choice="required", constraint={"json_object": True})
    assert client.generate(messages=chat("Still serving?"), max_tokens=4)["finish_reason"] in ("stop", "length")


# -- a model whose template has no tools: prefixd's generic tool section (models/generic_tools.py) --------------


def test_models_say_which_path_each_model_takes_tools_by(client):
    paths = {model["name"]: model["tools"] for model in client.models()["models"]}
    assert paths == {"llama-tools": "template", "llama": "generic"}


def test_a_model_without_tools_in_its_template_takes_tools_through_the_generic_section(client):
    system = [{"role": "system", "content": "You are a coding agent."}]
    free = client.generate(model="llama", messages=system + chat("Hello?"), tools=TOOLS, max_tokens=4)
    assert free["finish_reason"] in ("stop", "length") and free["cache"]["tools"] == "generic"
    native = client.generate(messages=chat("Hello?"), tools=TOOLS, max_tokens=4)
    assert native["cache"]["tools"] == "template"
    assert "tools" not in client.generate(model="llama", messages=chat("Hello?"), max_tokens=2)["cache"]
    named = client.generate(model="llama", messages=chat("Weather in Oslo?"), tools=TOOLS, max_tokens=100,
                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named["finish_reason"] == "tool_calls" and named["text"] == ""
    (call,) = named["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    check_weather_arguments(json.loads(call["function"]["arguments"]))
    with client.stream(model="llama", messages=chat("Any tool"), tools=TOOLS, max_tokens=100,
                       tool_choice="required") as running:
        chunks = list(running)
    assert not any("tool_call>" in chunk["text"] for chunk in chunks)
    assert [c["function"]["name"] for chunk in chunks for c in chunk.get("tool_calls", [])] in (["get_weather"], ["get_time"])


def test_an_agent_loop_on_the_generic_section_reuses_the_whole_previous_turn(client):
    messages = [{"role": "system", "content": "You are an agent with tools."}] + chat("Weather in Rome this week?")
    first = client.generate(model="llama", messages=messages, tools=TOOLS, max_tokens=100, tool_choice="required")
    (call,) = first["tool_calls"]
    messages += [{"role": "assistant", "content": first["text"], "tool_calls": first["tool_calls"]},
                 {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear", "high_c": 21}'}]
    second = client.generate(model="llama", messages=messages, tools=TOOLS, max_tokens=8)
    previous = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["cache"]["reused_tokens"] >= previous, second["cache"]
    assert second["cache"]["checkpoint"] == "answer-end" and second["cache"]["tools"] == "generic"


def test_chat_template_gives_a_model_a_template_that_reads_tools(tiny_llama_dir, tmp_path):
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TOOLS_TEMPLATE)
    with DaemonProcess([tiny_llama_dir], tmp_path / "d", ["--chat-template", f"llama={template}"]) as running, \
            Client(running.socket_path, timeout=120) as templated:
        (model,) = templated.models()["models"]
        assert model["tools"] == "template"
        reply = templated.generate(messages=chat("Weather in Oslo?"), tools=TOOLS, max_tokens=100, tool_choice="required")
        assert reply["cache"]["tools"] == "template" and reply["finish_reason"] == "tool_calls"


def test_a_chat_template_that_names_no_model_stops_the_daemon_at_start(tiny_llama_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(HERMES_TOOLS_TEMPLATE)
    daemon = DaemonProcess([tiny_llama_dir], tmp_path / "d", ["--chat-template", f"lama={template}"])
    # Code 1, though MLX's C++ teardown at the interpreter's exit at times aborts instead (see main.exit_now).
    with pytest.raises(RuntimeError, match="exited with code"):
        daemon.start()
    daemon.stop()  # its socket's folder
    assert f"--chat-template lama={template}: no model is named 'lama' (models: llama)" in daemon.stderr_text()
