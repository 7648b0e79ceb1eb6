"""Tools in generate params: validated into the shapes chat templates read; what cannot go together is refused."""

from __future__ import annotations

import pytest

from prefixd.protocol.errors import ErrorCode, RpcError
from prefixd.protocol.methods import parse_generate

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


def _error(params: dict) -> str:
    with pytest.raises(RpcError) as err:
        parse_generate(params)
    assert err.value.code == ErrorCode.INVALID_PARAMS
    return err.value.message


def test_tools_reach_the_prompt_and_tool_call_arguments_become_maps():
    messages = CHAT + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    params = parse_generate({"messages": messages, "tools": TOOLS})
    assert params.prompt.tools[0]["function"]["name"] == "get_weather"
    call = params.prompt.messages[1]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Paris"} and params.prompt.messages[1]["content"] == ""
    assert params.prompt.messages[2]["tool_call_id"] == "c1"


def test_a_choice_that_forces_a_call_is_taken_for_the_daemon_to_turn_into_a_grammar():
    required = parse_generate({"messages": CHAT, "tools": TOOLS, "tool_choice": "required"})
    named = parse_generate({"messages": CHAT, "tools": TOOLS,
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert required.tool_choice.forces_call and required.tool_choice.function is None
    assert named.tool_choice.forces_call and named.tool_choice.function == "get_weather"
    assert required.constraint is None and named.constraint is None  # the daemon adds it, in the model's format
    assert not parse_generate({"messages": CHAT, "tools": TOOLS, "tool_choice": "none"}).tool_choice.forces_call


@pytest.mark.parametrize("params, says", [
    ({"prompt": "hi", "tools": TOOLS}, "need 'messages'"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, "function.name"),
    ({"messages": CHAT, "tool_choice": "required"}, "needs 'tools'"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "constraint": {"json_object": True}},
     "cannot go with 'constraint'"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "cache": {"verify": True}}, "cannot go with 'cache.verify'"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": "sometimes"}, "must be \"auto\""),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "not in 'tools'"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "not valid JSON"),
])
def test_bad_or_unhonoured_tool_params_are_refused_with_what_is_wrong(params, says):
    assert says in _error(params)
