"""A client that does not read its replies is dropped once they pass the outbox bound; one that reads is not.

In-process: a real ``Connection`` on one end of a Unix socketpair, the test
as the client on the other, and a handler that streams chunk notifications
the way a generate does, until its job is cancelled.
"""

from __future__ import annotations

import asyncio
import gc
import socket

import msgpack
import uvloop
from structlog.testing import capture_logs

from prefixd.daemon.front.connection import Connection
from prefixd.protocol import MAX_MESSAGE_BYTES, Notification, Request, encode

LIMIT = 64 * 1024


class StreamingJob:
    """What Connection.jobs holds for a running generate: something to cancel."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


async def stream_until_cancelled(conn: Connection, request: Request) -> dict:
    job = conn.jobs[request.msgid] = StreamingJob()
    try:
        for index in range(100_000):  # ~100 MB of chunks if nothing stopped it
            if job.cancelled:
                return {"finish_reason": "cancelled", "chunks": index}
            conn.send(Notification("generate.chunk", [{"id": request.msgid, "text": "x" * 1000, "index": index}]))
            await asyncio.sleep(0)  # let the writer run, as the engine's events do
        return {"finish_reason": "length"}
    finally:
        conn.jobs.pop(request.msgid, None)


async def one_big_reply(conn: Connection, request: Request) -> dict:
    conn.send(Notification("generate.chunk", [{"id": request.msgid, "text": "y" * (4 * LIMIT)}]))
    return {"finish_reason": "stop"}


async def serve_one(handler, client: socket.socket, daemon_side: socket.socket, limit: int = LIMIT) -> Connection:
    reader, writer = await asyncio.open_unix_connection(sock=daemon_side)
    conn = Connection(reader, writer, handler, MAX_MESSAGE_BYTES, max_outbox_bytes=limit)
    client.sendall(encode(Request(1, "generate", [{"prompt": "x", "stream": True}])))
    await asyncio.wait_for(conn.serve(), timeout=30)
    return conn


def test_a_client_that_never_reads_is_dropped_and_its_job_cancelled():
    client, daemon_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    jobs_seen: list[StreamingJob] = []

    async def handler(conn, request):
        task = asyncio.ensure_future(stream_until_cancelled(conn, request))
        await asyncio.sleep(0)
        jobs_seen.append(conn.jobs[request.msgid])
        return await task

    with client, capture_logs() as logs:
        conn = asyncio.run(serve_one(handler, client, daemon_side))
        client.settimeout(10)
        received = bytearray()
        while chunk := client.recv(1 << 16):  # what the kernel held, then the end of the stream
            received += chunk
    assert jobs_seen and jobs_seen[0].cancelled
    [too_slow] = [entry for entry in logs if entry["event"] == "client_too_slow"]
    assert too_slow["client"] == conn.client_id and too_slow["queued_bytes"] > LIMIT
    assert too_slow["limit_bytes"] == LIMIT
    assert [entry["reason"] for entry in logs if entry["event"] == "client_disconnected"] == ["too_slow"]
    assert len(received) < 10 * 1024 * 1024  # far less than the handler would have produced


def test_a_client_that_reads_along_gets_a_reply_larger_than_the_bound():
    client, daemon_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    messages: list = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        client.setblocking(False)
        serving = asyncio.ensure_future(serve_one(one_big_reply, client, daemon_side))
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 << 20)
        async with asyncio.timeout(30):
            while len(messages) < 2:
                data = await loop.sock_recv(client, 1 << 16)
                assert data, "the connection was closed before the reply came"
                unpacker.feed(data)
                messages.extend(unpacker)
        client.shutdown(socket.SHUT_WR)  # the client is done: the daemon sees EOF
        await serving

    with client, capture_logs() as logs:
        asyncio.run(run())
    assert not [entry for entry in logs if entry["event"] == "client_too_slow"]
    assert len(messages[0][2][0]["text"]) == 4 * LIMIT and messages[1][3] == {"finish_reason": "stop"}


def test_a_client_that_hangs_up_without_reading_leaves_no_failed_writer_behind():
    # More than the socket buffers hold is unread when the client hangs up;
    # the connection closes under the writer, which must stop quietly (on
    # uvloop, as the daemon runs, drain() returns and a write would raise).
    client, daemon_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    loop_errors: list[dict] = []

    async def four_megabytes(conn, request):
        conn.send(Notification("generate.chunk", [{"id": request.msgid, "text": "z" * (4 << 20)}]))
        return {"finish_reason": "stop"}  # queued behind the chunk

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        serving = asyncio.ensure_future(serve_one(four_megabytes, client, daemon_side, limit=16 << 20))
        await asyncio.sleep(0.2)
        client.shutdown(socket.SHUT_WR)
        await serving  # serve_one gives up after 30 s
        await asyncio.sleep(0.1)  # let the writer task end
        del serving  # the last reference to the connection and its writer task, so that
        gc.collect()  # "Task exception was never retrieved" is reported now, while we listen

    with client, capture_logs() as logs:
        uvloop.run(run())
    assert [entry["reason"] for entry in logs if entry["event"] == "client_disconnected"] == ["eof"]
    assert not loop_errors, [context.get("exception") for context in loop_errors]


def test_a_decoder_failure_is_answered_and_closes_the_connection(monkeypatch):
    client, daemon_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def broken_feed(self, data):
        raise TypeError("a bug in the decoder")

    monkeypatch.setattr("prefixd.protocol.codec.StreamDecoder.feed", broken_feed)
    with client, capture_logs() as logs:
        asyncio.run(serve_one(one_big_reply, client, daemon_side))
        client.settimeout(10)
        unpacker = msgpack.Unpacker(raw=False)
        while chunk := client.recv(1 << 16):
            unpacker.feed(chunk)
    [reply] = list(unpacker)
    assert reply[1] is None and reply[2]["code"] == -32603 and "a bug in the decoder" in reply[2]["message"]
    assert [entry["event"] for entry in logs if entry["log_level"] == "error"] == ["client_decoder_failed"]


def test_small_and_large_messages_reach_a_reading_client_in_the_order_they_were_sent():
    # Small messages go to the socket at once while nothing waits before them, large ones (and any that
    # come while the socket is behind) through the writer task: the client must see one order either way.
    client, daemon_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sizes = [10, 100_000, 10, 10, 300_000, 10] * 5 + [10] * 200
    messages: list = []

    async def mixed(conn, request):
        for index, size in enumerate(sizes):
            conn.send(Notification("generate.chunk", [{"id": request.msgid, "index": index, "text": "m" * size}]))
            if index % 7 == 0:
                await asyncio.sleep(0)
        return {"finish_reason": "stop"}

    async def run() -> None:
        loop = asyncio.get_running_loop()
        client.setblocking(False)
        serving = asyncio.ensure_future(serve_one(mixed, client, daemon_side, limit=16 << 20))
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64 << 20)
        async with asyncio.timeout(30):
            while len(messages) < len(sizes) + 1:
                data = await loop.sock_recv(client, 1 << 16)
                assert data, "the connection was closed before every message came"
                unpacker.feed(data)
                messages.extend(unpacker)
        client.shutdown(socket.SHUT_WR)
        await serving

    with client:
        uvloop.run(run())
    chunks = [message[2][0] for message in messages[:-1]]
    assert [chunk["index"] for chunk in chunks] == list(range(len(sizes)))
    assert [len(chunk["text"]) for chunk in chunks] == sizes
    assert messages[-1][3] == {"finish_reason": "stop"}
