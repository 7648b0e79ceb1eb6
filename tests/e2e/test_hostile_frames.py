"""Well-formed msgpack that cannot become Python objects gets INVALID_REQUEST, and the connection lives.

A map keyed by an array or a map, and nesting deeper than msgpack's unpacker
allows, used to end the connection without a word (the first with a plain
traceback on stderr, the second with a bogus PARSE_ERROR after the decoder
lost its place). Each test sends the frame on one connection, then a
request on the same connection, while a bystander connection is open, and
checks that everyone is answered.
"""

from __future__ import annotations

import msgpack
import pytest

from tests.e2e.daemon_process import REQUEST, RESPONSE, RawConnection

INVALID_REQUEST, INVALID_PARAMS = -32600, -32602


def generate_with_raw_prompt(msgid: int, prompt_bytes: bytes) -> bytes:
    """[0, msgid, "generate", [{"prompt": <prompt_bytes>, "max_tokens": 2}]] with the prompt's bytes spliced in."""
    head = msgpack.packb([REQUEST, msgid, "generate", [{"max_tokens": 2, "prompt": None}]])
    return head[:-1] + prompt_bytes


HOSTILE_FRAMES = {
    "array as a map key": generate_with_raw_prompt(41, b"\x81\x92\x01\x02\xa1v"),  # "prompt": {[1, 2]: "v"}
    "map as a map key": generate_with_raw_prompt(41, b"\x81\x81\xa1k\x01\xa1v"),  # "prompt": {{"k": 1}: "v"}
    "prompt nested 1,100 deep": generate_with_raw_prompt(41, b"\x91" * 1100 + b"\xc0"),
    "prompt nested 200,000 deep": generate_with_raw_prompt(41, b"\x91" * 200_000 + b"\xa1x"),
}


@pytest.mark.parametrize("frame", HOSTILE_FRAMES.values(), ids=HOSTILE_FRAMES.keys())
def test_a_frame_python_cannot_decode_gets_invalid_request_and_the_connection_goes_on(shared_daemon, frame):
    with RawConnection(shared_daemon.socket_path) as bystander, RawConnection(shared_daemon.socket_path) as conn:
        follow_up = msgpack.packb([REQUEST, 42, "generate", [{"prompt": "after a hostile frame", "max_tokens": 2}]])
        conn.send_bytes(frame + follow_up)  # one write: the decoder must find where the bad frame ends
        refusal = conn.read()
        assert refusal[0] == RESPONSE and refusal[1] is None and refusal[3] is None
        assert refusal[2]["code"] == INVALID_REQUEST
        assert refusal[2]["data"] == {"msgid": 41}, refusal[2]  # who it was, so the sender can stop waiting
        _, answer = conn.reply(42)
        assert answer[2] is None and answer[3]["usage"]["completion_tokens"] >= 1
        assert conn.result("ping")["pong"] is True
        assert bystander.result("ping")["pong"] is True
    assert not shared_daemon.events("client_protocol_error")  # nothing here is a framing error


def test_a_field_nested_1000_deep_still_decodes_and_is_refused_by_the_parameter_check(shared_daemon):
    # Within the unpacker's depth the message is an ordinary (wrong) request.
    with RawConnection(shared_daemon.socket_path) as conn:
        conn.send_bytes(generate_with_raw_prompt(7, b"\x91" * 1000 + b"\xc0"))
        _, response = conn.reply(7)
        assert response[2]["code"] == INVALID_PARAMS and "prompt" in response[2]["message"]
        assert conn.result("ping")["pong"] is True


def test_hostile_frames_back_to_back_byte_by_byte(shared_daemon):
    stream = b"".join(HOSTILE_FRAMES.values()) + msgpack.packb([REQUEST, 43, "ping", []])
    with RawConnection(shared_daemon.socket_path) as conn:
        for start in range(0, len(stream), 4099):  # many small writes, cut anywhere
            conn.send_bytes(stream[start : start + 4099])
        refusals = [conn.read() for _ in HOSTILE_FRAMES]
        assert [r[2]["code"] for r in refusals] == [INVALID_REQUEST] * len(HOSTILE_FRAMES)
        _, pong = conn.reply(43)
        assert pong[3]["pong"] is True
