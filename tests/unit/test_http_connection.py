"""The HTTP front's read deadlines and its log of malformed requests, with short timeouts and no model.

A client that sends part of a request and stops is cut off once the header
(or body) deadline passes, with a warning that names it and what was
missing, while other clients are served; an idle connection is closed
silently after the keep-alive timeout; a request aiohttp's parser refuses is
one warning without a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import aiohttp
import pytest
from structlog.testing import capture_logs

from prefixd.daemon.front.http_front import start_http_front
from tests.unit.test_http_front import fake_handlers

HEADER_TIMEOUT, BODY_TIMEOUT, KEEPALIVE_TIMEOUT = 0.6, 1.5, 1.0
POST_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: prefixd\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n")


async def start(handlers=None, **timeouts):
    timeouts = {"header_timeout": HEADER_TIMEOUT, "body_timeout": BODY_TIMEOUT, "keepalive_timeout": KEEPALIVE_TIMEOUT,
                **timeouts}
    front = await start_http_front(handlers or fake_handlers(), host="127.0.0.1", port=0, **timeouts)
    return front, front.addresses[0][:2]


async def closed_after(reader: asyncio.StreamReader, started: float, limit: float = 5.0) -> float:
    """Seconds from ``started`` until the server closed the connection; fails if it answered anything."""
    assert await asyncio.wait_for(reader.read(), limit) == b""
    return time.monotonic() - started


async def get_models(host, port) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{host}:{port}/v1/models") as response:
            return response.status


@pytest.mark.parametrize("half_request, missing, deadline", [
    (b"POST /v1/chat/comp", "request line", HEADER_TIMEOUT),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: prefixd\r\nContent-Ty", "headers", HEADER_TIMEOUT),
    (POST_HEAD + b'{"model": ', "body", BODY_TIMEOUT),
], ids=["request-line", "headers", "body"])
async def test_a_half_sent_request_is_cut_off_at_its_deadline_while_others_are_served(half_request, missing, deadline):
    front, (host, port) = await start()
    try:
        with capture_logs() as logs:
            reader, writer = await asyncio.open_connection(host, port)
            started = time.monotonic()
            writer.write(half_request)
            await writer.drain()
            assert await get_models(host, port) == 200  # a bystander meanwhile, on its own connection
            assert time.monotonic() - started < deadline
            assert deadline - 0.1 < await closed_after(reader, started) < deadline + 2.0
            writer.close()
    finally:
        await front.cleanup()
    timeouts = [entry for entry in logs if entry["event"] == "http_read_timeout"]
    assert len(timeouts) == 1 and timeouts[0]["log_level"] == "warning", logs
    line = timeouts[0]
    local_port = writer.get_extra_info("sockname")[1]
    assert line["missing"] == missing and line["peer"] == f"127.0.0.1:{local_port}" and line["timeout_s"] == deadline
    if missing == "body":
        assert line["received_bytes"] == len(b'{"model": ') and line["expected_bytes"] == 100
    else:
        assert line["received_bytes"] == len(half_request)


async def test_the_head_and_the_body_have_deadlines_of_their_own():
    # 1 s to send a body in pieces is within the body deadline, though longer than the header deadline.
    front, (host, port) = await start()
    try:
        reader, writer = await asyncio.open_connection(host, port)
        body = b'{"messages": []}'.ljust(100)
        writer.write(POST_HEAD.replace(b"100", b"%d" % len(body)))
        for start_byte in range(0, len(body), 25):
            await asyncio.sleep(0.25)
            writer.write(body[start_byte:start_byte + 25])
        status_line = await asyncio.wait_for(reader.readline(), 5.0)
        assert status_line.startswith(b"HTTP/1.1 400")  # answered (no messages), not cut off
        writer.close()

        # A head trickled in slower than its deadline is cut off, though each byte comes well within it.
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        head = b"GET /v1/models HTTP/1.1\r\nHost: prefixd\r\nX-Slow: " + b"a" * 50
        trickle = asyncio.create_task(send_slowly(writer, head))
        assert await closed_after(reader, started) < HEADER_TIMEOUT + 1.0
        trickle.cancel()
        writer.close()
    finally:
        await front.cleanup()


async def send_slowly(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One byte every 50 ms, until the server closes the connection."""
    try:
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)
    except ConnectionError:
        pass


async def test_an_idle_connection_is_closed_after_the_keepalive_timeout_without_a_warning():
    front, (host, port) = await start()
    try:
        with capture_logs() as logs:
            reader, writer = await asyncio.open_connection(host, port)  # a fresh one that never sends
            started = time.monotonic()
            assert KEEPALIVE_TIMEOUT - 0.1 < await closed_after(reader, started) < KEEPALIVE_TIMEOUT + 2.0
            writer.close()

            reader, writer = await asyncio.open_connection(host, port)  # one kept alive after a request
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: prefixd\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            assert head.startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            assert KEEPALIVE_TIMEOUT - 0.1 < await closed_after(reader, started) < KEEPALIVE_TIMEOUT + 2.0
            writer.close()
    finally:
        await front.cleanup()
    assert not [entry for entry in logs if entry["log_level"] in ("warning", "error")], logs


async def test_the_deadline_starts_again_for_each_request_and_never_cuts_a_slow_reply():
    async def slow_job(client_id, number, params, on_chunk, jobs, warm_only=False, lane=None):
        await asyncio.sleep(2 * BODY_TIMEOUT)  # answering is not reading
        return {"finish_reason": "stop", "text": "late", "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                "cache": {"reused_tokens": 0}, "timings": {}}

    handlers = fake_handlers()
    handlers.run_job = slow_job
    front, (host, port) = await start(handlers)
    try:
        reader, writer = await asyncio.open_connection(host, port)
        for _ in range(3):  # one kept-alive connection, requests apart by more than the header deadline
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: prefixd\r\n\r\n")
            status, _ = await read_reply(reader)
            assert status == b"HTTP/1.1 200 OK"
            await asyncio.sleep(HEADER_TIMEOUT + 0.2)
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: prefixd\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        status, reply = await read_reply(reader)
        assert status == b"HTTP/1.1 200 OK" and b'"late"' in reply
        writer.close()
    finally:
        await front.cleanup()


async def read_reply(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(status line, body) of one HTTP/1.1 reply with a Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
    return lines[0], await asyncio.wait_for(reader.readexactly(length), 5.0)


@pytest.mark.parametrize("request_bytes, kind", [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", "BadHttpMessage"),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n", "LineTooLong"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", "BadHttpMethod"),  # TLS sent to the plain port
], ids=["bad-content-length", "header-too-long", "tls"])
async def test_a_malformed_request_is_one_warning_naming_the_peer_without_a_traceback(tmp_path, caplog, request_bytes,
                                                                                     kind):
    path = tmp_path / "http.sock"
    front = await start_http_front(fake_handlers(), unix_path=path)
    try:
        with capture_logs() as logs:
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(request_bytes)
            assert (await asyncio.wait_for(reader.readline(), 5.0)).startswith(b"HTTP/1.")
            writer.close()
            await asyncio.sleep(0.1)
    finally:
        await front.cleanup()
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]  # aiohttp's, with a traceback
    assert [entry["event"] for entry in logs] == ["http_malformed_request"], logs
    line = logs[0]
    assert line["log_level"] == "warning" and line["kind"] == kind and line["status"] == 400 and line["error"]
    assert line["peer"] == "unix" and line["pid"] == os.getpid() and "exc_info" not in line


@pytest.mark.parametrize("head, body, error, malformed", [
    (b"Content-Encoding: gzip\r\n", b"not gzip at all", "the request body could not be read", ["ContentEncodingError"]),
    (b"Content-Type: application/json; charset=klingon\r\n", b"{}", "charset 'klingon' is unknown", []),
], ids=["bad-gzip", "unknown-charset"])
async def test_a_body_that_cannot_be_decoded_is_a_400_not_a_500(caplog, head, body, error, malformed):
    front, (host, port) = await start()
    try:
        with capture_logs() as logs:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: prefixd\r\nContent-Length: %d\r\n%s\r\n%s"
                         % (len(body), head, body))
            status, reply = await read_reply(reader)
            writer.close()
            await asyncio.sleep(0.1)
    finally:
        await front.cleanup()
    assert status == b"HTTP/1.1 400 Bad Request" and error.encode() in reply, reply
    assert not [entry for entry in logs if entry["log_level"] == "error"], logs
    assert [entry["kind"] for entry in logs if entry["event"] == "http_malformed_request"] == malformed, logs
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
