"""Peer credentials from the kernel, and refusing connections from other users."""

from __future__ import annotations

import asyncio
import os
import socket
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from prefixd.daemon.front.connection import Connection
from prefixd.daemon.front.peer_auth import UNKNOWN, PeerCredentials, PeerPolicy, peer_credentials
from prefixd.protocol import Request, Response, StreamDecoder, encode

NOBODY = 65534
# The peer runs as nobody, who cannot enter /root, where the venv's python may live.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def test_socketpair_reports_our_own_pid_and_uid():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_credentials(a)
    assert peer == PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


def test_tcp_and_missing_sockets_have_no_credentials():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        assert peer_credentials(tcp) is UNKNOWN
    assert peer_credentials(None) is UNKNOWN


def test_policy_allows_own_uid_and_listed_uids_only():
    policy = PeerPolicy(allowed_uids=[1001], own_uid=1000)
    assert policy.refusal(PeerCredentials(pid=1, uid=1000)) is None
    assert policy.refusal(PeerCredentials(pid=1, uid=1001)) is None
    reason = policy.refusal(PeerCredentials(pid=1, uid=0))
    assert reason is not None and "uid 0" in reason and "1000, 1001" in reason and "--allow-uid" in reason
    assert policy.refusal(UNKNOWN) is None  # nothing to judge by: the socket mode guards


async def ping_handler(conn, request):
    return {"pong": True, "uid": conn.peer_uid, "pid": conn.peer_pid}


async def ping_through(policy: PeerPolicy) -> Response | None:
    """Serve one Connection with ``policy`` on a socketpair and send it a ping."""
    server_sock, client_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, writer = await asyncio.open_connection(sock=server_sock)
    serving = asyncio.create_task(Connection(reader, writer, ping_handler, 1 << 20, peer_policy=policy).serve())
    client_reader, client_writer = await asyncio.open_connection(sock=client_sock)
    decoder = StreamDecoder()
    reply = None
    try:
        client_writer.write(encode(Request(1, "ping", [])))
        await client_writer.drain()
        while reply is None and (data := await asyncio.wait_for(client_reader.read(65536), 10)):
            decoder.feed(data)
            reply = next(iter(decoder), None)
    except ConnectionError:
        pass  # the daemon hung up first
    client_writer.close()
    await asyncio.wait_for(serving, 10)
    return reply


async def test_connection_answers_its_own_user():
    reply = await ping_through(PeerPolicy())
    assert reply is not None and reply.error is None
    assert reply.result == {"pong": True, "uid": os.getuid(), "pid": os.getpid()}


async def test_connection_from_another_uid_is_closed_unanswered():
    # Pretend the daemon runs as someone else: this test process is then "another user".
    with capture_logs() as logs:
        reply = await ping_through(PeerPolicy(own_uid=os.getuid() + 1))
    assert reply is None  # closed without an answer
    refused = [entry for entry in logs if entry["event"] == "client_refused"]
    assert len(refused) == 1 and refused[0]["uid"] == os.getuid() and refused[0]["pid"] == os.getpid()


async def test_allow_uid_lets_another_user_in():
    reply = await ping_through(PeerPolicy(allowed_uids=[os.getuid()], own_uid=os.getuid() + 1))
    assert reply is not None and reply.result["pong"] is True


CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
try:
    s.sendall(bytes.fromhex("940001a470696e6790"))  # [0, 1, "ping", []]
except ConnectionError:
    pass
try:
    print(len(s.recv(65536)))
except ConnectionError:
    print(0)
"""


@pytest.mark.skipif(os.name != "posix" or os.getuid() != 0, reason="needs root to connect as another real user")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a python3 in /usr/bin that another user may run")
async def test_a_real_other_user_is_refused_and_allowed_with_allow_uid():
    workdir = Path(tempfile.mkdtemp(prefix="prefixd-peer-"))
    workdir.chmod(0o755)
    path = workdir / "s.sock"

    async def run_client() -> int:
        proc = await asyncio.create_subprocess_exec(
            SYSTEM_PYTHON, "-c", CLIENT, str(path), stdout=subprocess.PIPE, user=NOBODY, cwd="/",
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        return int(out.strip())

    try:
        for policy, expect_reply in ((PeerPolicy(), False), (PeerPolicy(allowed_uids=[NOBODY]), True)):
            seen: list[Connection] = []

            async def on_client(reader, writer, policy=policy):
                conn = Connection(reader, writer, ping_handler, 1 << 20, peer_policy=policy)
                seen.append(conn)
                await conn.serve()

            server = await asyncio.start_unix_server(on_client, path=str(path))
            path.chmod(0o666)  # the daemon's own socket is 0600; open it up so the peer check is what decides
            try:
                num_reply_bytes = await run_client()
            finally:
                server.close()
                await server.wait_closed()
                path.unlink(missing_ok=True)
            assert seen[0].peer_uid == NOBODY and seen[0].peer_pid not in (None, os.getpid())
            assert (num_reply_bytes > 0) is expect_reply
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
