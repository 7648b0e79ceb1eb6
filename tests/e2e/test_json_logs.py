"""With --log-format json, every line the daemon writes to stderr is one JSON object.

aiohttp logs through the standard library's logging, which used to reach
stderr as plain text (a malformed HTTP request's traceback did); so did the
traceback of a connection task that died. The test provokes both kinds of
path on a real daemon and then reads its whole stderr.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.e2e.daemon_process import DaemonProcess, RawConnection

BAD_HTTP_REQUESTS = [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
]


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def send_raw_http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        return conn.recv(1 << 16)


@pytest.fixture
def daemon(tiny_llama_dir, tmp_path):
    port = free_tcp_port()
    daemon = DaemonProcess([tiny_llama_dir], tmp_path / "daemon", ["--http", f"127.0.0.1:{port}"])
    daemon.http_port = port
    with daemon:
        daemon.wait_for_event("daemon_started")  # the HTTP front listens by then
        yield daemon


def test_every_stderr_line_is_json_even_for_library_tracebacks(daemon):
    for request in BAD_HTTP_REQUESTS:
        assert send_raw_http(daemon.http_port, request).startswith(b"HTTP/1.")
    with RawConnection(daemon.socket_path) as conn:
        conn.send_bytes(b"\x81\x91\x01\x02")  # {[1]: 2}: once the traceback of a dying connection task
        try:
            conn.read(timeout=5)  # the answer is test_hostile_frames' business; here only stderr counts
        except (EOFError, TimeoutError):
            pass
    with RawConnection(daemon.socket_path) as conn:
        assert conn.result("ping")["pong"] is True
    malformed = daemon.wait_for_event("http_malformed_request")
    daemon.stop()

    lines = daemon.stderr_text().splitlines()
    assert lines, "the daemon wrote nothing to stderr"
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except ValueError:
            raise AssertionError(f"stderr line {number} is not JSON: {line!r}\nstderr tail:\n{daemon.log_tail()}") from None
        assert isinstance(entry, dict) and "event" in entry and "level" in entry and "timestamp" in entry, line
    assert malformed["level"] == "warning" and malformed["kind"] in ("BadHttpMessage", "LineTooLong")
