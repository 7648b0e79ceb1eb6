"""A client's mistakes are warnings in the daemon's log, never errors, and the daemon serves others meanwhile.

Through the real daemon: malformed HTTP on its HTTP front, messages that are
not msgpack-RPC on its Unix socket, and an HTTP client that sends half a
request and stops while another is answered. The JSON log lines are read
back: each mistake left a warning without a traceback, and no line is at
level error (which would mean the daemon is at fault).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import msgpack
import pytest

from tests.e2e.daemon_process import REQUEST, RESPONSE, RawConnection
from tests.support.http_daemon import http_daemon

INVALID_REQUEST = -32600
MALFORMED_HTTP = {
    "bad Content-Length": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "header too long": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    "bad HTTP version": b"GET / HTTP/9.9\r\n\r\n",
    "bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "TLS on the plain port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
}
NOT_RPC_MESSAGES = {
    "a string": msgpack.packb("hello"),
    "a number": msgpack.packb(42),
    "message type 7": msgpack.packb([7, 1, "ping", []]),
    "a text msgid": msgpack.packb([REQUEST, "one", "ping", []]),
    "a method that is a number": msgpack.packb([REQUEST, 1, 5, []]),
    "a request of 3 items": msgpack.packb([REQUEST, 1, "ping"]),
    "a map keyed by an array": b"\x81\x91\x01\x02",
}


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("client-faults"), model_dirs=[tiny_llama_dir]) as live:
        live.http_port = int(live.base_url.rsplit(":", 1)[1])
        yield live


def send_raw_http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        return conn.recv(1 << 16)


def chat(daemon, content: str) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 3}).encode()
    request = urllib.request.Request(daemon.base_url + "/v1/chat/completions", data=body, method="POST",
                                     headers={**daemon.headers(), "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_mistakes_on_both_fronts_are_warnings_without_tracebacks_and_never_errors(daemon):
    for request in MALFORMED_HTTP.values():
        assert send_raw_http(daemon.http_port, request).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    with RawConnection(daemon.socket_path) as conn:
        for frame in NOT_RPC_MESSAGES.values():
            conn.send_bytes(frame)
            refusal = conn.read()
            assert refusal[0] == RESPONSE and refusal[2]["code"] == INVALID_REQUEST, refusal
        conn.send_bytes(msgpack.packb([RESPONSE, 9, None, "a response nobody asked for"]))
        assert conn.result("ping")["pong"] is True  # the same connection goes on
    assert chat(daemon, "Still there?")["choices"][0]["finish_reason"] in ("stop", "length")

    daemon.wait_for_event("client_response_ignored")
    malformed = daemon.events("http_malformed_request")
    invalid = daemon.events("client_invalid_message")
    assert len(malformed) == len(MALFORMED_HTTP) and len(invalid) == len(NOT_RPC_MESSAGES)
    for line in malformed + invalid + daemon.events("client_response_ignored"):
        assert line["level"] == "warning" and "exception" not in line, line
    assert all(line["peer"].startswith("127.0.0.1:") and line["status"] == 400 for line in malformed)
    assert {line["code"] for line in invalid} == {INVALID_REQUEST}
    faults = [line for line in daemon.log_lines() if line["level"] in ("error", "critical") or "exception" in line]
    assert not faults, faults


def test_a_half_sent_request_waits_alone_while_another_client_is_answered(daemon):
    slow = socket.create_connection(("127.0.0.1", daemon.http_port), timeout=10)
    try:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: prefixd\r\nContent-Le")
        started = time.monotonic()
        reply = chat(daemon, "Are you free?")
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        assert time.monotonic() - started < 10  # the slow sender holds nobody up
        slow.settimeout(0.2)
        with pytest.raises(socket.timeout):
            slow.recv(1)  # still open, waiting for the rest of its head: its deadline is 30 s away
    finally:
        slow.close()
    assert not daemon.events("http_read_timeout")
