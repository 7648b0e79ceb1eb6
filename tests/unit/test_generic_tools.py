"""The generic tool section for templates without tools: what the model sees, and that every turn renders the same.

Rendered through PromptEncoder with plain Jinja (the tiny models' ChatML
template and SmolLM2-135M-Instruct's, copied here), no model and no tokenizer.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jinja2.sandbox
import pytest

from prefixd.daemon.grammar import forced_tool_call
from prefixd.daemon.models.generic_tools import (GENERIC, GENERIC_CALL_FORMAT, NO_TEMPLATE, TEMPLATE, call_format,
                                                 generic_messages, tools_path)
from prefixd.daemon.models.prompt_encoding import PromptEncoder
from prefixd.protocol.methods import parse_generate
from tests.support.tiny_models import CHATML_TEMPLATE, HERMES_TOOLS_TEMPLATE

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# What the forced-call grammar has a model write (the separators of compiler.JSON_OPTIONS).
ANSWER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'


class JinjaTokenizer:
    """A tokenizer as PromptEncoder reads it, rendering its template with plain Jinja (``tools`` passed through)."""

    def __init__(self, template: str):
        self.chat_template = template
        self.has_chat_template = True
        self._template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, tools=None):
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools)


def encoder(template: str) -> PromptEncoder:
    return PromptEncoder(JinjaTokenizer(template), "tiny", 8192)


def request(messages: list[dict], tools=(WEATHER, TIME)):
    """Messages and tools as the daemon gets them: validated by the protocol (call arguments as maps)."""
    prompt = parse_generate({"messages": messages, "tools": list(tools) or None}).prompt
    return list(prompt.messages), prompt.tools


def test_the_path_follows_the_template():
    assert tools_path(JinjaTokenizer(CHATML_TEMPLATE)) == GENERIC
    assert tools_path(JinjaTokenizer(HERMES_TOOLS_TEMPLATE)) == TEMPLATE
    assert tools_path(SimpleNamespace(has_chat_template=False, chat_template=None)) == NO_TEMPLATE
    assert call_format(JinjaTokenizer(CHATML_TEMPLATE)) is GENERIC_CALL_FORMAT
    assert encoder(SMOLLM2_TEMPLATE).tools_path == GENERIC


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, SMOLLM2_TEMPLATE])
def test_the_tools_go_into_the_system_prompt_in_the_hermes_format(template):
    messages, tools = request([{"role": "system", "content": "You are a coding agent."},
                               {"role": "user", "content": "Weather in Zürich?"}])
    text = encoder(template).render_messages(messages, True, tools)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in listed] == [WEATHER, TIME]  # in the order given, each whole
    assert 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' in system
    assert "SmolLM" not in text and text.endswith("<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n")


def test_a_chat_without_a_system_message_gets_one_for_the_tools_and_without_tools_none():
    messages, tools = request([{"role": "user", "content": "Hi"}])
    rewritten = generic_messages(messages, tools)
    assert [m["role"] for m in rewritten] == ["system", "user"] and rewritten[0]["content"].startswith("# Tools")
    assert generic_messages(messages, None) == [{"role": "user", "content": "Hi"}]
    assert encoder(SMOLLM2_TEMPLATE).render_messages(messages, True, None).startswith("<|im_start|>system\nYou are a helpful")


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, SMOLLM2_TEMPLATE])
def test_a_call_the_model_wrote_renders_back_as_it_wrote_it_and_the_next_turn_extends_the_last(template):
    chat = encoder(template)
    messages, tools = request([{"role": "system", "content": "Agent."}, {"role": "user", "content": "Weather?"}])
    first = chat.render_messages(messages, True, tools)
    content, calls = GENERIC_CALL_FORMAT.split(ANSWER)
    sent_back = [{"role": "assistant", "content": content, "tool_calls": [call.to_openai() for call in calls]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear"}'}]
    messages, tools = request(messages + sent_back)
    second = chat.render_messages(messages, True, tools)
    assert second.startswith(first + ANSWER + "<|im_end|>\n")
    assert second.endswith("<|im_start|>user\n<tool_response>\n{\"sky\": \"clear\"}\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert chat.render_messages(messages, True, tools) == second  # deterministic


def test_text_before_calls_and_several_calls_render_as_the_parser_reads_them():
    answer = ("Let me look.\n" + ANSWER + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = GENERIC_CALL_FORMAT.split(answer)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather", "get_time"]
    messages, _ = request([{"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}])
    assert generic_messages(messages, None) == [{"role": "assistant", "content": answer}]


def test_the_forced_call_grammar_writes_the_generic_format():
    lark = forced_tool_call([WEATHER], GENERIC_CALL_FORMAT).source
    assert lark.startswith('start: "<tool_call>\\n" call "\\n</tool_call>"')


def test_prefixd_models_shows_each_models_path():
    from prefixd.client.display import format_models

    described = {"name": "SmolLM2", "default": True, "context_length": 8192, "dtype": "float32", "hybrid": False,
                 "loaded": False, "path": "/m/SmolLM2", "tools": GENERIC}
    assert format_models({"models": [described]}) == "* SmolLM2  ctx 8,192  float32  kv  tools generic  not loaded  /m/SmolLM2"
