"""Client plumbing against a fake daemon: calls, streams, pipelining, errors, cancel.

The real daemon end to end is tested in tests/e2e; here the server is
tests.support.fake_daemon, so these tests pin down what the clients do with
the bytes, not what the model says.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
from pathlib import Path

import pytest

from prefixd.client import AsyncClient, Client, ConnectionLost, DaemonUnavailable, RequestTimeout
from prefixd.client.errors import InvalidParams, ModelNotFound, ParseError, error_from_wire
from tests.support.fake_daemon import FakeDaemon


@pytest.fixture
def socket_path():
    # pytest's tmp_path can exceed the 108-byte limit of a Unix socket path.
    with tempfile.TemporaryDirectory(prefix="prefixd-test-") as directory:
        yield Path(directory) / "d.sock"


@pytest.fixture
def daemon(socket_path):
    with FakeDaemon(socket_path) as fake:
        yield fake


# -- blocking client ---------------------------------------------------------------

def test_sync_calls_and_increasing_msgids(daemon):
    with Client(daemon.path) as client:
        assert client.ping()["pong"] is True
        result = client.generate("hi", max_tokens=3, stop=("\n",), cache=False)
        client.ping()
    assert result["text"] == "echo:hi" and result["finish_reason"] == "stop"
    msgids = [msgid for msgid, _, _ in daemon.requests]
    assert msgids == sorted(msgids) and len(set(msgids)) == 3
    # None options are left out so the daemon's defaults apply; cache=False means neither read nor write.
    assert daemon.requests[1][2] == {"prompt": "hi", "max_tokens": 3, "stop": ["\n"],
                                     "cache": {"use": False, "store": False}}


def test_sync_stream_yields_its_chunks_and_keeps_the_result(daemon):
    with Client(daemon.path) as client:
        stream = client.stream("hi", session="s1")
        chunks = list(stream)
    assert [c["text"] for c in chunks] == ["Hel", "lo"]  # the stray notifications were ignored
    assert [c["index"] for c in chunks] == [0, 1]
    assert stream.result["text"] == "Hello" and stream.result["session"] == "s1"
    assert daemon.requests[0][2]["stream"] is True


def test_sync_calls_work_while_a_stream_is_open(daemon):
    with Client(daemon.path) as client:
        with client.stream("hi") as stream:
            first = next(stream)
            assert client.ping()["pong"] is True
            rest = list(stream)
    assert [first["text"]] + [c["text"] for c in rest] == ["Hel", "lo"]


def test_sync_error_becomes_a_typed_exception(daemon):
    with Client(daemon.path) as client:
        with pytest.raises(ModelNotFound) as info:
            client.generate("hi", model="nope")
        assert client.ping()["pong"]  # the connection survives a daemon error
    assert info.value.code == -32001 and info.value.data == {"models": ["fake"]}
    assert "nope" in str(info.value)


def test_sync_closing_a_stream_early_cancels_it(daemon):
    with Client(daemon.path) as client:
        with client.stream("forever") as stream:
            assert next(stream)["text"] == "Hel"
        assert stream.result["finish_reason"] == "cancelled"
        assert client.ping()["pong"]
    cancels = [params for _, method, params in daemon.requests if method == "cancel"]
    assert cancels == [{"id": stream.msgid}]


def test_sync_dropping_an_unfinished_stream_sends_cancel(daemon):
    with Client(daemon.path) as client:
        for chunk in client.stream("forever"):
            break  # the stream object is dropped here
        client.ping()  # the cancel was sent before this ping, so the daemon has seen it
    assert daemon.methods_seen() == ["generate", "cancel", "ping"]


def test_sync_timeout_raises_and_cancels(daemon):
    with Client(daemon.path, timeout=0.2) as client:
        with pytest.raises(RequestTimeout):
            client.generate("delay:5")
        assert client.ping()["pong"]  # the late reply of the abandoned call is dropped
    assert daemon.methods_seen() == ["generate", "cancel", "ping"]


def test_sync_connection_lost_mid_request(daemon):
    with Client(daemon.path) as client:
        with pytest.raises(ConnectionLost):
            client.generate("drop")
        with pytest.raises(ConnectionLost):
            client.ping()


def test_sync_error_with_nil_msgid_fails_the_waiting_call(daemon):
    with Client(daemon.path) as client:
        with pytest.raises(ParseError):
            client.generate("garbage")


def test_missing_socket_is_daemon_unavailable(socket_path):
    with pytest.raises(DaemonUnavailable, match="prefixd serve --model DIR") as info:
        Client(socket_path)
    assert isinstance(info.value, ConnectionError) and info.value.code is None


def test_stale_socket_is_daemon_unavailable(socket_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))  # bound but never listening: what a crashed daemon leaves
    stale.close()
    with pytest.raises(DaemonUnavailable, match="nothing listens"):
        Client(socket_path)


def test_error_from_wire_picks_the_class_by_code():
    assert isinstance(error_from_wire({"code": -32602, "message": "'max_tokens' must be..."}), InvalidParams)
    unknown = error_from_wire({"code": -32099, "message": "new"})
    assert type(unknown).__name__ == "PrefixdError" and unknown.code == -32099
    assert error_from_wire({"code": "bad", "message": "m"}).message == "m"


# -- async client -----------------------------------------------------------------

async def test_async_pipelined_calls_get_their_own_answers(daemon):
    async with AsyncClient(daemon.path) as client:
        results = await asyncio.gather(
            client.generate("delay:0.3"), client.generate("delay:0.1"), client.generate("delay:0.2"), client.ping()
        )
    assert [r["text"] for r in results[:3]] == ["echo:delay:0.3", "echo:delay:0.1", "echo:delay:0.2"]
    assert results[3]["pong"] is True
    sent = [msgid for msgid, _, _ in daemon.requests]
    assert daemon.reply_order != sent  # the answers really came back out of order


async def test_async_first_calls_at_once_share_one_connection(daemon):
    client = AsyncClient(daemon.path)
    try:
        await asyncio.gather(client.ping(), client.ping(), client.generate("hi"))
    finally:
        await client.close()
    assert daemon.num_connections == 1


async def test_async_streams_and_calls_interleave(daemon):
    client = await AsyncClient.connect(daemon.path)
    try:
        async def collect(prompt):
            stream = client.stream(prompt)
            return [c["text"] async for c in stream], stream.result

        (a, result_a), (b, _), pong = await asyncio.gather(collect("one"), collect("two"), client.ping())
    finally:
        await client.close()
    assert a == b == ["Hel", "lo"] and result_a["text"] == "Hello" and pong["pong"]


async def test_async_error_becomes_a_typed_exception(daemon):
    async with AsyncClient(daemon.path) as client:
        with pytest.raises(ModelNotFound):
            await client.generate("hi", model="nope")
        with pytest.raises(ModelNotFound):
            async for _ in client.stream("hi", model="nope"):
                pass
        assert (await client.ping())["pong"]


async def test_async_closing_a_stream_early_cancels_it(daemon):
    async with AsyncClient(daemon.path) as client:
        async with client.stream("forever") as stream:
            assert (await anext(stream))["text"] == "Hel"
        assert stream.result["finish_reason"] == "cancelled"
    assert ("cancel", {"id": stream.msgid}) in [(m, p) for _, m, p in daemon.requests]


async def test_async_cancelled_task_cancels_its_request(daemon):
    async with AsyncClient(daemon.path) as client:
        task = asyncio.create_task(client.generate("delay:5"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.ping()
    assert daemon.methods_seen() == ["generate", "cancel", "ping"]


async def test_async_dead_connection_fails_every_pending_call(daemon):
    async with AsyncClient(daemon.path) as client:
        pending = [asyncio.ensure_future(client.generate("delay:5")) for _ in range(3)]
        stream = client.stream("forever")
        assert (await anext(stream))["text"] == "Hel"
        with pytest.raises(ConnectionLost):
            await client.generate("drop")
        for future in pending:
            with pytest.raises(ConnectionLost):
                await future
        with pytest.raises(ConnectionLost):
            await anext(stream)
        with pytest.raises(ConnectionLost):
            await client.ping()


async def test_async_missing_socket_is_daemon_unavailable(socket_path):
    with pytest.raises(DaemonUnavailable, match="prefixd serve"):
        await AsyncClient.connect(socket_path)


async def test_async_timeout(daemon):
    async with AsyncClient(daemon.path, timeout=0.2) as client:
        with pytest.raises(RequestTimeout):
            await client.generate("delay:5")
        assert (await client.ping())["pong"]
