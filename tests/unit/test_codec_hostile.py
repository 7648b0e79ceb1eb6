"""Well-formed msgpack that Python's msgpack cannot turn into objects: the decoder answers and stays in sync.

Two shapes used to break the stream: a map keyed by an array or a map (no
dict can hold it; the unpacker raised TypeError and lost its place) and
nesting deeper than the C unpacker's stack (StackError, also mid-message).
Both must come out as one INVALID_REQUEST item, and the next message must
decode as if nothing had happened, however the bytes are split into reads.
"""

from __future__ import annotations

import random

import msgpack
import pytest

from prefixd.protocol import ErrorCode, Request, RpcError, StreamDecoder, encode, encode_raw
from prefixd.protocol.codec import MAX_DECODABLE_DEPTH, ObjectEnd

PING = Request(77, "ping", [])


def nested(depth: int, innermost: bytes = b"\xc0") -> bytes:
    """``depth`` single-item arrays around ``innermost``: [[[...nil...]]] (msgpack.packb stops at 512)."""
    return b"\x91" * depth + innermost


def request_with_field(msgid: int, field_bytes: bytes) -> bytes:
    """[0, msgid, "generate", [{"prompt": <field_bytes>}]] with the field's bytes spliced in."""
    return encode_raw([0, msgid, "generate", [{"prompt": None}]])[:-1] + field_bytes


def decode_in_reads(data: bytes, read_size: int, **kwargs) -> list:
    decoder = StreamDecoder(**kwargs)
    items = []
    for start in range(0, len(data), read_size):
        decoder.feed(data[start : start + read_size])
        items.extend(decoder)
    assert decoder.num_buffered_bytes == 0
    return items


def assert_refused_then_ping(items: list, msgid: int | None, words: str) -> None:
    assert len(items) == 2, items
    refusal, after = items
    assert isinstance(refusal, RpcError) and refusal.code == ErrorCode.INVALID_REQUEST
    assert words in refusal.message, refusal.message
    assert refusal.data == (None if msgid is None else {"msgid": msgid})
    assert after == PING


# -- maps keyed by arrays or maps ------------------------------------------------------

UNHASHABLE_KEY_FRAMES = {
    "array key at the top": (b"\x81\x91\x01\x02", None),  # {[1]: 2}
    "map key at the top": (b"\x81\x81\xa1k\x01\x02", None),  # {{"k": 1}: 2}
    "array key in params": (request_with_field(5, b"\x81\x92\x01\x02\xa1v"), 5),  # "prompt": {[1, 2]: "v"}
    "map key deep in params": (request_with_field(6, b"\x91\x91\x81\x80\xc3"), 6),  # [[{{}: true}]]
    "bad key in a notification": (encode_raw([2, "note", []])[:-1] + b"\x91\x81\x90\x01", None),
}


@pytest.mark.parametrize("read_size", [1, 3, 1 << 16])
@pytest.mark.parametrize("frame, msgid", UNHASHABLE_KEY_FRAMES.values(), ids=UNHASHABLE_KEY_FRAMES.keys())
def test_a_map_keyed_by_an_array_or_a_map_is_refused_and_the_stream_goes_on(frame, msgid, read_size):
    items = decode_in_reads(frame + encode(PING), read_size)
    assert_refused_then_ping(items, msgid, "map keys must be strings")


def test_hashable_non_string_keys_still_decode():
    # Not the codec's business: the method's parameter check names them.
    [request] = decode_in_reads(encode_raw([0, 1, "generate", [{1: "a", None: 2, b"b": 3}]]), 1 << 16)
    assert request == Request(1, "generate", [{1: "a", None: 2, b"b": 3}])


def test_a_bad_key_does_not_taint_the_next_message():
    items = decode_in_reads(UNHASHABLE_KEY_FRAMES["array key in params"][0] + encode(PING) + encode(PING), 2)
    assert items[1:] == [PING, PING]


# -- nesting deeper than the unpacker's stack ---------------------------------------------

DEPTHS_AND_READS = [(depth, read_size) for depth in (MAX_DECODABLE_DEPTH, MAX_DECODABLE_DEPTH + 1, 5000)
                    for read_size in (7, 4096, 1 << 20)] + [(1 << 20, 4096), (1 << 20, 1 << 20)]


@pytest.mark.parametrize("depth, read_size", DEPTHS_AND_READS)
def test_a_field_nested_too_deep_is_refused_with_its_msgid_and_the_stream_goes_on(depth, read_size):
    frame = request_with_field(9, nested(depth - 3))  # the request's own array, its params and their map are 3 of the levels
    items = decode_in_reads(frame + encode(PING), read_size)
    if depth <= MAX_DECODABLE_DEPTH:
        assert isinstance(items[0], Request) and items[0].msgid == 9 and items[1:] == [PING]
    else:
        assert_refused_then_ping(items, 9, f"at most {MAX_DECODABLE_DEPTH} deep")


def test_a_deep_object_that_is_no_request_is_refused_with_msgid_nil():
    items = decode_in_reads(nested(3000) + encode(PING), 1000)
    assert_refused_then_ping(items, None, "deep")


def test_a_deep_message_with_every_kind_of_item_is_skipped_exactly():
    # Items of every size class around and inside the deep part, so a
    # miscounted header would leave the decoder in the middle of something.
    siblings = encode_raw(["s" * 40, "t" * 300, b"b" * 70000, 1.5, 2**40, -3, -(2**40), True, None,
                           {"k": [1, 2, {"x": b""}]}, msgpack.ExtType(3, b"e" * 5), list(range(300)),
                           {str(i): i for i in range(20)}])[1:]  # the items, without their array's header
    inner = b"\x92" + nested(1200) + b"\xdc\x00\x0d" + siblings  # [deep, [the 13 siblings]]
    frame = request_with_field(12, b"\x82\xa1a" + inner + b"\xa1b" + inner)  # {"a": inner, "b": inner}
    for read_size in (1, 97, len(frame)):
        items = decode_in_reads(frame + encode(PING) + encode(PING), read_size)
        assert [type(item) for item in items] == [RpcError, Request, Request]
        assert items[0].data == {"msgid": 12} and items[1:] == [PING, PING]


def test_two_deep_messages_in_a_row():
    frame = request_with_field(3, nested(2000))
    items = decode_in_reads(frame + frame + encode(PING), 333)
    assert [item.data for item in items[:2]] == [{"msgid": 3}, {"msgid": 3}] and items[2] == PING


def test_a_deep_message_over_the_size_limit_is_refused_before_it_is_all_buffered():
    decoder = StreamDecoder(max_message_bytes=64 * 1024)
    decoder.feed(request_with_field(1, b"\x91" * 4096))
    assert list(decoder) == []  # still reading the deep message
    with pytest.raises(RpcError) as info:
        for _ in range(100):
            decoder.feed(b"\x91" * 4096)
            list(decoder)
    assert info.value.code == ErrorCode.MESSAGE_TOO_LARGE


def test_a_deep_message_announcing_a_huge_string_is_refused_at_once():
    decoder = StreamDecoder(max_message_bytes=64 * 1024)
    decoder.feed(nested(2000, b"\xdb\x10\x00\x00\x00"))  # a 256 MiB string follows, supposedly
    with pytest.raises(RpcError) as info:
        list(decoder)
    assert info.value.code == ErrorCode.MESSAGE_TOO_LARGE


def test_bytes_that_are_not_msgpack_inside_a_deep_message_are_a_parse_error():
    decoder = StreamDecoder()
    decoder.feed(nested(2000, b"\xc1"))
    with pytest.raises(RpcError) as info:
        list(decoder)
    assert info.value.code == ErrorCode.PARSE_ERROR


# -- the scanner on its own -----------------------------------------------------------------

def random_object(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 3 or roll < 0.4:
        return rng.choice([
            None, True, False, rng.randint(-(2**63), 2**64 - 1), rng.randint(-40, 300), rng.random(),
            "x" * rng.choice([0, 1, 31, 32, 255, 256, 70000]), b"b" * rng.choice([0, 5, 255, 256, 70000]),
            msgpack.ExtType(5, b"e" * rng.choice([1, 2, 4, 8, 16, 3, 255, 256])),
        ])
    if roll < 0.7:
        return [random_object(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 15, 16, 17]))]
    return {str(index): random_object(rng, depth + 1) for index in range(rng.choice([0, 1, 15, 16, 17]))}


def test_the_scanner_finds_the_end_of_any_object_however_it_arrives():
    rng = random.Random(20240601)
    for _ in range(200):
        data = msgpack.packb(random_object(rng), use_bin_type=True, use_single_float=rng.random() < 0.5)
        scanner = ObjectEnd()
        for cut in sorted(rng.sample(range(len(data)), min(4, len(data) - 1)))[1:]:
            assert scanner.scan(data[:cut]) is None
            assert scanner.min_end <= len(data)
        assert scanner.scan(data + b"\x00 trailing") == len(data)


def test_a_million_levels_keep_the_scanner_small():
    scanner = ObjectEnd()
    assert scanner.scan(nested(1 << 20) + b"rest") == (1 << 20) + 1
    tail_chain = b"\x92\x01" * 100_000 + b"\xc0"  # [1, [1, [1, ...]]]
    scanner = ObjectEnd()
    assert scanner.scan(tail_chain) == len(tail_chain)
    assert len(scanner._open_items) <= 1
