"""The request fields every HTTP API reads: the socket's rules, and a 400 naming the field as each API spells it."""

from __future__ import annotations

import pytest

from prefixd.daemon.front import request_fields
from prefixd.daemon.front.anthropic_shapes import messages_request
from prefixd.daemon.front.fim_formats import FimFormat
from prefixd.daemon.front.infill_shapes import infill_request
from prefixd.daemon.front.ollama_shapes import chat_request as ollama_chat
from prefixd.daemon.front.openai_shapes import chat_request as openai_chat
from prefixd.daemon.front.openai_shapes import completion_request
from prefixd.daemon.front.responses_shapes import responses_request
from prefixd.protocol import methods as m
from prefixd.protocol.errors import RpcError

CHAT = [{"role": "user", "content": "Hi"}]
FIM = FimFormat("test", "<pre>", "<suf>", "<mid>", stops=("<end>",))
TOO_MANY_STOPS = [f"s{n}" for n in range(m.MAX_STOP_STRINGS + 1)]

# Each API's request with one generate field set, and the name that field has there.
REQUESTS = {
    "openai chat": (lambda name, value: openai_chat({"messages": CHAT, name: value}), {}),
    "openai completions": (lambda name, value: completion_request({"prompt": "hi", name: value}), {}),
    "anthropic": (lambda name, value: messages_request({"messages": CHAT, "max_tokens": 4, name: value}, "m").params,
                  {"stop": "stop_sequences", "seed": None}),
    "ollama": (lambda name, value: ollama_chat({"messages": CHAT, "options": {name: value}}, "m").params,
               {"max_tokens": "num_predict"}),
    "infill": (lambda name, value: infill_request({"input_prefix": "a", name: value}, FIM).params, {"max_tokens": "n_predict"}),
    "responses": (lambda name, value: responses_request({"input": "hi", name: value}, [], 64).params,
                  {"max_tokens": "max_output_tokens", "seed": None, "stop": None}),
}
WHERE = {"ollama": "options."}
BAD_VALUES = [("max_tokens", m.MAX_TOKENS_LIMIT + 1), ("temperature", 100.5), ("temperature", -0.1), ("top_p", 0),
              ("top_p", 1.5), ("seed", -1), ("stop", TOO_MANY_STOPS), ("stop", [""])]


CASES = [(api, field, value) for api, (_, renamed) in REQUESTS.items() for field, value in BAD_VALUES
         if renamed.get(field, field) is not None]


@pytest.mark.parametrize("api, field, value", CASES, ids=[f"{api}:{field}={value!r:.20}" for api, field, value in CASES])
def test_a_value_out_of_range_is_refused_on_every_api_naming_the_field_as_sent(api, field, value):
    make, renamed = REQUESTS[api]
    name = renamed.get(field, field)
    with pytest.raises(RpcError) as err:
        make(name, value)
    sent = WHERE.get(api, "") + name
    assert f"'{sent}'" in err.value.message and err.value.data == {"param": sent}, err.value.message


@pytest.mark.parametrize("field, value", BAD_VALUES + [("max_tokens", 0), ("seed", 2**63)])
def test_the_socket_refuses_the_same_values(field, value):
    with pytest.raises(RpcError):
        m.parse_generate({"prompt": "hi", field: value})
    with pytest.raises(RpcError):
        request_fields.generate_fields({field: value})


@pytest.mark.parametrize("field, value", [("max_tokens", 1), ("max_tokens", m.MAX_TOKENS_LIMIT), ("temperature", 0),
                                          ("temperature", 100), ("top_p", 1), ("top_p", 1e-9), ("seed", 0),
                                          ("seed", 2**63 - 1), ("stop", "x"), ("stop", ["a"] * m.MAX_STOP_STRINGS)])
def test_what_the_socket_takes_the_fronts_take_alike(field, value):
    read = request_fields.generate_fields({field: value})
    assert m.parse_generate({"prompt": "hi", **read}) == m.parse_generate({"prompt": "hi", field: value})


def test_openai_names_max_completion_tokens_when_it_is_the_one_sent():
    with pytest.raises(RpcError) as err:
        openai_chat({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 0})
    assert err.value.data == {"param": "max_completion_tokens"}
    assert openai_chat({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 7}).max_tokens == 7


def test_the_fronts_own_stops_fill_the_room_the_clients_leave():
    assert request_fields.stop_strings(None, "stop", ("<end>",)) == ("<end>",)
    assert request_fields.stop_strings("x", "stop", ("x", "<end>")) == ("x", "<end>")
    full = [f"s{n}" for n in range(m.MAX_STOP_STRINGS)]
    assert request_fields.stop_strings(full, "stop", ("<end>",)) == tuple(full)
    assert infill_request({"input_prefix": "a", "stop": full}, FIM).params.stop == tuple(full)
    assert infill_request({"input_prefix": "a", "stop": ["x"]}, FIM).params.stop == ("x", "<end>")


def test_anthropic_stop_sequences_reach_the_engine_and_must_be_an_array():
    parsed = messages_request({"messages": CHAT, "max_tokens": 4, "stop_sequences": ["\n\nHuman:", "END"]}, "m")
    assert parsed.params.stop == ("\n\nHuman:", "END")
    with pytest.raises(RpcError) as err:
        messages_request({"messages": CHAT, "max_tokens": 4, "stop_sequences": "END"}, "m")
    assert err.value.data == {"param": "stop_sequences"}


def test_lengths_that_mean_until_the_end_and_a_warm_up():
    assert ollama_chat({"messages": CHAT, "options": {"num_predict": -1}}, "m").params.max_tokens == m.MAX_TOKENS_LIMIT
    warm = infill_request({"input_prefix": "a", "n_predict": 0}, FIM)
    assert warm.warm_only and warm.params.max_tokens == 1
    assert infill_request({"input_prefix": "a", "n_predict": -1}, FIM).params.max_tokens == m.MAX_TOKENS_LIMIT
    assert infill_request({"input_prefix": "a", "max_tokens": 9}, FIM).params.max_tokens == 9


@pytest.mark.parametrize("field", ["n_indent", "t_max_predict_ms"])
def test_infill_cut_limits_are_non_negative_numbers(field):
    assert getattr(infill_request({"input_prefix": "a", field: 2.5}, FIM), field) == 2.5
    with pytest.raises(RpcError) as err:
        infill_request({"input_prefix": "a", field: -1}, FIM)
    assert err.value.data == {"param": field}
