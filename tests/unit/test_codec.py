"""The wire codec: message shapes, stream framing, limits and parameter validation."""

from __future__ import annotations

import msgpack
import pytest

from prefixd.protocol import (
    MAX_MESSAGE_BYTES, ErrorCode, Notification, Request, Response, RpcError, StreamDecoder, encode, encode_raw,
    parse_message,
)
from prefixd.protocol import methods

MESSAGES = [
    Request(0, "ping", []),
    Request(2**32 - 1, "generate", [{"prompt": "héllo", "max_tokens": 3, "stop": ["\n"]}]),
    Response(7, None, {"pong": True, "time": 1733150000.25}),
    Response(8, {"code": ErrorCode.MODEL_NOT_FOUND, "message": "no model 'x'", "data": {"models": ["a"]}}, None),
    Response(None, {"code": ErrorCode.PARSE_ERROR, "message": "not valid msgpack"}, None),
    Notification("generate.chunk", [{"id": 3, "text": "Hi", "tokens": [1, 2], "index": 0}]),
]


def decode_all(data: bytes, **kwargs) -> list:
    decoder = StreamDecoder(**kwargs)
    decoder.feed(data)
    return list(decoder)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode_all(encode(message)) == [message]


def test_enums_travel_as_plain_ints():
    # Another language's msgpack library must see [0, 1, "ping", []], not an extension type.
    assert encode(Request(1, "ping", [])) == bytes.fromhex("940001a470696e6790")
    assert msgpack.unpackb(encode(Response(1, {"code": ErrorCode.CANCELLED, "message": "x"}, None))) == [
        1, 1, {"code": -32004, "message": "x"}, None,
    ]


@pytest.mark.parametrize(
    "obj",
    [
        {"not": "an array"},
        [],
        [0, 1, "ping"],  # request too short
        [0, 1, "ping", [], "extra"],
        [0, -1, "ping", []],
        [0, 2**32, "ping", []],
        [0, True, "ping", []],
        [0, "1", "ping", []],
        [0, 1, 5, []],
        [0, 1, "ping", {}],
        [1, 1, None],  # response too short
        [1, -1, None, None],
        [1, "x", None, None],
        [2, "generate.chunk"],  # notification too short
        [2, 5, []],
        [2, "generate.chunk", {}],
        [3, 1, "ping", []],
        ["0", 1, "ping", []],
    ],
)
def test_parse_message_rejects(obj):
    with pytest.raises(RpcError) as info:
        parse_message(obj)
    assert info.value.code == ErrorCode.INVALID_REQUEST


def test_rejected_request_keeps_its_msgid_when_readable():
    # So the daemon can answer the right caller instead of msgid nil.
    with pytest.raises(RpcError) as info:
        parse_message([0, 42, 5, []])
    assert info.value.data == {"msgid": 42}


def test_framing_survives_byte_by_byte_reads():
    data = b"".join(encode(m) for m in MESSAGES)
    decoder = StreamDecoder()
    received = []
    for index in range(len(data)):
        decoder.feed(data[index : index + 1])
        received.extend(decoder)
    assert received == MESSAGES
    assert decoder.num_buffered_bytes == 0


def test_half_a_message_waits_for_the_rest():
    data = encode(MESSAGES[1])
    decoder = StreamDecoder()
    decoder.feed(data[:10])
    assert list(decoder) == []
    assert decoder.num_buffered_bytes == 10
    decoder.feed(data[10:])
    assert list(decoder) == [MESSAGES[1]]


def test_two_messages_in_one_read():
    assert decode_all(encode(MESSAGES[0]) + encode(MESSAGES[2])) == [MESSAGES[0], MESSAGES[2]]


def test_non_rpc_object_yields_an_error_and_the_stream_goes_on():
    items = decode_all(encode_raw({"a": 1}) + encode(MESSAGES[0]))
    assert isinstance(items[0], RpcError) and items[0].code == ErrorCode.INVALID_REQUEST
    assert items[1] == MESSAGES[0]


def test_garbage_is_a_parse_error():
    decoder = StreamDecoder()
    decoder.feed(b"\xc1")  # a byte msgpack never uses
    with pytest.raises(RpcError) as info:
        list(decoder)
    assert info.value.code == ErrorCode.PARSE_ERROR


def test_oversized_message_in_one_read_is_refused():
    big = encode(Request(1, "generate", [{"prompt": "x" * 2000}]))
    decoder = StreamDecoder(max_message_bytes=1024)
    with pytest.raises(RpcError) as info:
        decoder.feed(big)
        list(decoder)
    assert info.value.code == ErrorCode.MESSAGE_TOO_LARGE


def test_oversized_message_is_refused_before_it_is_all_buffered():
    # A 17 MiB string announced in its header, arriving in 1 MiB reads.
    size = MAX_MESSAGE_BYTES + (1 << 20)
    header = encode_raw([0, 1, "generate", [{"prompt": ""}]])[:-1] + b"\xdb" + size.to_bytes(4, "big")
    decoder = StreamDecoder()
    decoder.feed(header)
    with pytest.raises(RpcError) as info:
        for _ in range(size >> 20):
            decoder.feed(b"x" * (1 << 20))
            list(decoder)
    assert info.value.code == ErrorCode.MESSAGE_TOO_LARGE


def test_message_just_under_the_limit_passes():
    message = Request(1, "generate", [{"prompt": "x" * (MAX_MESSAGE_BYTES - 100)}])
    assert decode_all(encode(message)) == [message]


def test_rpc_error_wire_round_trip():
    err = RpcError(ErrorCode.PROMPT_TOO_LONG, "too long", {"limit": 8192})
    wire = {"code": -32002, "message": "too long", "data": {"limit": 8192}}
    assert err.to_wire() == wire and RpcError.from_wire(wire).to_wire() == wire
    assert "data" not in RpcError(ErrorCode.INTERNAL, "x").to_wire()


# -- parameter validation -------------------------------------------------------

def test_generate_defaults():
    params = methods.parse_generate({"prompt": "hi"})
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (256, 0.0, 1.0, None)
    assert (params.stop, params.stream, params.session) == ((), False, None)
    assert (params.cache.use, params.cache.store) == (True, True)
    assert params.prompt.text == "hi"


def test_stop_accepts_a_string_or_an_array():
    assert methods.parse_generate({"prompt": "x", "stop": "\n"}).stop == ("\n",)
    assert methods.parse_generate({"prompt": "x", "stop": ["a", "b"]}).stop == ("a", "b")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "session": 5}, "session"),
        ({"prompt": "x", "model": 5}, "model"),
        ({"prompt": "x", "cache": {"use": "no"}}, "use"),
        ({"prompt": "x", "cache": {"reuse": True}}, "reuse"),
        ({"prompt": "x", "temprature": 1}, "temprature"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "tokens": [1]}, "tokens"),
        ({"tokens": []}, "tokens"),
        ({"tokens": [1, -2]}, "tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]}, "messages[1]"),
        ({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 1}, "add_generation_prompt"),
    ],
)
def test_generate_validation_names_the_field(params, field):
    with pytest.raises(RpcError) as info:
        methods.parse_generate(params)
    assert info.value.code == ErrorCode.INVALID_PARAMS
    assert field in info.value.message


@pytest.mark.parametrize(
    "params, field",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"prompt": "x", "keep_alive": "a while"}, "keep_alive"),
        ({"prompt": "x", "constraint": {"regex": ""}}, "constraint.regex"),
        ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {}}]},
         "tools[0].function.name"),
        ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_an_invalid_field_is_named_in_the_errors_data(params, field):
    with pytest.raises(RpcError) as info:
        methods.parse_generate(params)
    assert info.value.data == {"param": field} and info.value.to_wire()["data"] == {"param": field}
    assert field in info.value.message


def test_prompt_request_and_cancel_validation():
    prompt, model = methods.parse_prompt_request({"messages": [{"role": "user", "content": "a"}], "model": "m"})
    assert prompt.messages == ({"role": "user", "content": "a"},) and model == "m"
    with pytest.raises(RpcError, match="max_tokens"):
        methods.parse_prompt_request({"prompt": "x", "max_tokens": 3})
    assert methods.parse_cancel({"id": 9}) == 9
    for bad in ({}, {"id": "9"}, {"id": True}):
        with pytest.raises(RpcError, match="'id'"):
            methods.parse_cancel(bad)


def test_params_must_be_one_map():
    assert methods.single_map_param([]) == {}
    assert methods.single_map_param([{"a": 1}]) == {"a": 1}
    for bad in ([1], [{}, {}], ["x"]):
        with pytest.raises(RpcError) as info:
            methods.single_map_param(bad)
        assert info.value.code == ErrorCode.INVALID_PARAMS
