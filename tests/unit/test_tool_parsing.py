"""Tool calls parsed out of literal model answers, whole and streamed, per model family."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from prefixd.daemon.models.tool_call_format import LLAMA3_JSON, ToolCall, tool_call_format
from prefixd.daemon.models.tool_call_stream import ToolCallStream

json_tools = pytest.importorskip("mlx_lm.tool_parsers.json_tools")
mistral = pytest.importorskip("mlx_lm.tool_parsers.mistral")

LLAMA3_TEMPLATE = "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"


def tokenizer_for(module=None, template: str = "") -> SimpleNamespace:
    """What mlx-lm's TokenizerWrapper says of a model's tool calls (inferred at load from its template)."""
    if module is None:
        return SimpleNamespace(tool_parser=None, tool_call_start=None, tool_call_end=None, chat_template=template)
    return SimpleNamespace(tool_parser=module.parse_tool_call, tool_call_start=module.tool_call_start,
                           tool_call_end=module.tool_call_end, chat_template=template)


HERMES = tool_call_format(tokenizer_for(json_tools))
MISTRAL = tool_call_format(tokenizer_for(mistral))
LLAMA3 = tool_call_format(tokenizer_for(template=LLAMA3_TEMPLATE))


def names_and_args(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in calls]


def streamed(fmt, answer: str, piece_size: int) -> list:
    stream = ToolCallStream(fmt)
    events = []
    for start in range(0, len(answer), piece_size):
        events += stream.feed(answer[start:start + piece_size])
    return events + stream.finish()


def test_families_are_told_apart_and_a_template_without_tools_has_no_format():
    assert (HERMES.family, HERMES.start, HERMES.end) == ("json_tools", "<tool_call>", "</tool_call>")
    assert (MISTRAL.family, MISTRAL.start, MISTRAL.end) == ("mistral", "[TOOL_CALLS]", "")
    assert LLAMA3.family == LLAMA3_JSON and LLAMA3.start == ""
    assert tool_call_format(tokenizer_for(template="{{ message['content'] }}")) is None


def test_hermes_calls_are_parsed_and_the_text_around_them_kept():
    answer = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = HERMES.split(answer)
    assert content == "Let me look."
    assert names_and_args(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert all(call.id.startswith("call_") for call in calls) and calls[0].id != calls[1].id


def test_a_call_that_does_not_parse_stays_text():
    answer = 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> done'
    assert HERMES.split(answer) == (answer, [])
    assert HERMES.split("no calls at all") == ("no calls at all", [])


def test_arguments_go_out_as_the_json_text_chat_templates_write_back():
    (call,) = HERMES.split('<tool_call>{"name": "f", "arguments": {"q": "café", "n": [1, 2]}}</tool_call>')[1]
    wire = call.to_openai()
    assert wire["type"] == "function" and wire["function"]["name"] == "f"
    assert wire["function"]["arguments"] == '{"q": "café", "n": [1, 2]}'  # what Jinja's tojson renders


def test_mistral_calls_run_to_the_answers_end_in_both_of_its_syntaxes():
    old = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    assert names_and_args(MISTRAL.split(old)[1]) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    new = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    assert names_and_args(MISTRAL.split(new)[1]) == [("get_weather", {"city": "Oslo"})]


def test_llama3_bare_json_with_or_without_the_python_tag_and_plain_text():
    assert names_and_args(LLAMA3.split('{"name": "get_weather", "parameters": {"city": "Rome"}}')[1]) == [("get_weather", {"city": "Rome"})]
    assert names_and_args(LLAMA3.split('<|python_tag|>{"name": "f", "parameters": {}}')[1]) == [("f", {})]
    assert LLAMA3.split("It is sunny in Rome.") == ("It is sunny in Rome.", [])
    assert LLAMA3.split('{"city": "Rome"}') == ('{"city": "Rome"}', [])  # JSON, but not a call


@pytest.mark.parametrize("piece_size", [1, 3, 7, 1000])
def test_streamed_hermes_gives_text_at_once_and_each_call_whole(piece_size):
    answer = 'Checking <tool_c'  # a marker's start that turns out to be text
    answer += 'ase> then\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events = streamed(HERMES, answer, piece_size)
    texts = [e for e in events if isinstance(e, str)]
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert "".join(texts) == "Checking <tool_case> then\n"
    assert names_and_args(calls) == [("get_weather", {"city": "Paris"})]
    assert isinstance(events[-1], ToolCall)  # no text after the call


def test_streaming_holds_back_only_what_may_start_a_marker():
    stream = ToolCallStream(HERMES)
    assert stream.feed("Hello <tool") == ["Hello "]
    assert stream.feed("box>") == ["<toolbox>"]
    assert stream.feed(" <tool_call>{\"name\": \"f\", \"arguments\": {}}") == [" "]
    (call,) = stream.feed("</tool_call>")
    assert call.name == "f" and stream.num_calls == 1


def test_a_stream_cut_inside_a_call_gives_the_held_text_back():
    stream = ToolCallStream(HERMES)
    assert stream.feed('<tool_call>{"name": "f", "argu') == []
    assert stream.finish() == ['<tool_call>{"name": "f", "argu']


@pytest.mark.parametrize("piece_size", [1, 5, 1000])
def test_streamed_llama3_json_is_held_to_the_end_and_text_is_not(piece_size):
    answer = ' {"name": "get_weather", "parameters": {"city": "Rome"}}'
    events = streamed(LLAMA3, answer, piece_size)
    assert len(events) == 1 and names_and_args(events) == [("get_weather", {"city": "Rome"})]
    stream = ToolCallStream(LLAMA3)
    assert stream.feed("It is") == ["It is"] and stream.feed(" sunny") == [" sunny"] and stream.finish() == []


def test_streamed_mistral_call_is_parsed_at_the_end():
    events = streamed(MISTRAL, 'ok [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', 4)
    assert events[0] == "ok " and names_and_args(events[1:]) == [("f", {"x": 1})]
    assert json.loads(events[1].to_openai()["function"]["arguments"]) == {"x": 1}
