"""Bad input from one client gets a clear error, and every other client keeps being served.

Each test keeps a second, well-behaved connection open across the bad one and
checks that it still gets a full answer afterwards: one client's garbage must
never cost another its service (or the daemon its life).
"""

from __future__ import annotations

import socket
import time

import msgpack
import pytest

from tests.e2e.daemon_process import REQUEST, RESPONSE, RawConnection

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
MODEL_NOT_FOUND, PROMPT_TOO_LONG, MESSAGE_TOO_LARGE = -32001, -32002, -32006


def still_served(daemon, prompt: str) -> None:
    """A fresh client still gets a whole generate reply."""
    with RawConnection(daemon.socket_path) as conn:
        result = conn.result("generate", {"prompt": prompt, "max_tokens": 3})
    assert result["usage"]["completion_tokens"] >= 1 and result["finish_reason"] in ("stop", "length")


def test_bytes_that_are_not_msgpack_get_parse_error_then_close(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as bystander, RawConnection(shared_daemon.socket_path) as bad:
        bad.send_bytes(b"\xc1\xc1\xc1 not msgpack")  # 0xc1 is the one byte msgpack never uses
        messages = bad.read_until_closed()
        assert len(messages) == 1
        kind, msgid, error, result = messages[0]
        assert (kind, msgid, result) == (RESPONSE, None, None)
        assert error["code"] == PARSE_ERROR and "msgpack" in error["message"]
        assert bystander.result("ping")["pong"] is True
    still_served(shared_daemon, "after garbage")
    assert shared_daemon.events("client_protocol_error", code=PARSE_ERROR)


@pytest.mark.parametrize("frame, words", [
    ({"method": "ping"}, "array"),  # a map, not a message array
    ([0, 1, "ping"], "[0, msgid, method, params]"),  # a request needs 4 elements
    ([7, 1, "ping", []], "type"),  # no such message type
    ([0, "one", "ping", []], "msgid"),  # msgid must be an integer
    ([0, 1, "ping", "not-an-array"], "params"),
])
def test_a_frame_that_is_not_msgpack_rpc_gets_invalid_request_and_the_connection_lives(shared_daemon, frame, words):
    with RawConnection(shared_daemon.socket_path) as conn:
        conn.send(frame)
        response = conn.read()
        assert response[0] == RESPONSE and response[3] is None
        assert response[2]["code"] == INVALID_REQUEST
        assert words in response[2]["message"], response[2]["message"]
        assert conn.result("ping")["pong"] is True  # the same connection carries on


def test_unknown_method_is_named_in_the_error(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        error = conn.error("generat", {"prompt": "x"})
    assert error["code"] == METHOD_NOT_FOUND and "generat" in error["message"]


@pytest.mark.parametrize("params, field", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": 42}, "prompt"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"prompt": "x", "tokens": [1, 2]}, "prompt"),  # two prompt forms at once
    ({}, "prompt"),  # none at all
    ({"tokens": [1, -5]}, "tokens"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "bogus_field": 1}, "bogus_field"),
])
def test_wrong_parameters_get_invalid_params_naming_the_field(shared_daemon, params, field):
    with RawConnection(shared_daemon.socket_path) as conn:
        error = conn.error("generate", params)
        assert error["code"] == INVALID_PARAMS
        assert field in error["message"], error["message"]
        assert conn.result("ping")["pong"] is True


def test_unknown_model_lists_the_loaded_ones(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        error = conn.error("generate", {"prompt": "x", "model": "gpt-9"})
    assert error["code"] == MODEL_NOT_FOUND
    assert "gpt-9" in error["message"] and "llama" in error["message"]


def test_a_prompt_longer_than_the_context_is_refused_with_its_size(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        context = conn.result("models")["models"][0]["context_length"]
        error = conn.error("generate", {"tokens": [5] * (context + 10), "max_tokens": 1})
    assert error["code"] == PROMPT_TOO_LONG
    assert error["data"]["prompt_tokens"] == context + 10 and error["data"]["context_length"] == context
    still_served(shared_daemon, "after a long prompt")


def test_token_ids_outside_the_vocabulary_are_refused(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        error = conn.error("generate", {"tokens": [1, 2, 10**9], "max_tokens": 1})
    assert error["code"] == INVALID_PARAMS and "vocab" in error["message"], error
    still_served(shared_daemon, "after a bad token id")


def test_an_oversized_message_gets_message_too_large_then_close(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        limit = conn.result("hello")["max_message_bytes"]
    with RawConnection(shared_daemon.socket_path) as bystander, RawConnection(shared_daemon.socket_path) as bad:
        huge = msgpack.packb([REQUEST, 1, "generate", [{"prompt": "x" * (limit + 1024)}]])
        try:
            bad.send_bytes(huge)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may close before it has read it all: that is the point
        messages = bad.read_until_closed()
        assert [m[2]["code"] for m in messages] == [MESSAGE_TOO_LARGE]
        assert str(limit) in messages[0][2]["message"]
        assert bystander.result("ping")["pong"] is True
    still_served(shared_daemon, "after a huge frame")


def test_half_a_frame_then_vanishing_is_logged_and_harmless(shared_daemon):
    frame = msgpack.packb([REQUEST, 1, "generate", [{"prompt": "never finished", "max_tokens": 4}]])
    with RawConnection(shared_daemon.socket_path) as bystander:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(shared_daemon.socket_path))
        sock.sendall(frame[: len(frame) // 2])
        time.sleep(0.1)
        sock.close()
        gone = shared_daemon.wait_for_event("client_gone", unread_bytes=len(frame) // 2)
        assert gone["reason"] == "eof"
        assert bystander.result("ping")["pong"] is True
    still_served(shared_daemon, "after half a frame")


def test_a_request_before_bad_bytes_is_still_answered(shared_daemon):
    """Framing errors close the connection, but what came before them is not lost."""
    with RawConnection(shared_daemon.socket_path) as conn:
        conn.send_bytes(msgpack.packb([REQUEST, 9, "generate", [{"prompt": "answered anyway", "max_tokens": 2}]]) + b"\xc1")
        messages = conn.read_until_closed()
    by_msgid = {m[1]: m for m in messages if m[0] == RESPONSE}
    assert by_msgid[None][2]["code"] == PARSE_ERROR
    assert by_msgid[9][2] is None and by_msgid[9][3]["usage"]["completion_tokens"] >= 1
