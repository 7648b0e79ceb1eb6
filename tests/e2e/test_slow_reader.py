"""A client that streams generations and never reads is cut off; everyone else carries on.

The daemon runs with a 64 KiB outbox bound (``PREFIXD_MAX_OUTBOX_BYTES``) so
the test need not wait for 16 MiB of chunks. A slow client pipelines long
streamed generates and reads nothing; the daemon must log
``client_too_slow``, cancel that client's jobs and close it, while a
bystander keeps getting its greedy answer, and memory must stay flat.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import msgpack
import pytest

from tests.e2e.daemon_process import REQUEST, DaemonProcess, RawConnection

OUTBOX_LIMIT = 64 * 1024
NUM_STREAMS = 8  # fewer than --max-active (32): the bystander runs beside them, not after them
BYSTANDER = {"prompt": "A bystander asks the same thing again", "max_tokens": 6}


@pytest.fixture
def daemon(tiny_llama_dir, tmp_path):
    with DaemonProcess([tiny_llama_dir], tmp_path / "daemon", env={"PREFIXD_MAX_OUTBOX_BYTES": str(OUTBOX_LIMIT)}) as daemon:
        yield daemon


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def flood_without_reading(socket_path: Path) -> socket.socket:
    """A client that asks for long streams and reads nothing."""
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(str(socket_path))
    slow.sendall(b"".join(
        msgpack.packb([REQUEST, msgid, "generate", [{"prompt": f"flood {msgid}", "max_tokens": 4000, "stream": True,
                                                       "cache": {"store": False}}]])  # memory below is the outbox's, not the cache's
        for msgid in range(1, NUM_STREAMS + 1)
    ))
    return slow


def read_to_the_end(sock: socket.socket, timeout: float = 20.0) -> int:
    """Bytes the kernel still held for the client, once the daemon has closed; fails if it never does."""
    sock.settimeout(timeout)
    received = 0
    try:
        while chunk := sock.recv(1 << 16):
            received += len(chunk)
    except ConnectionResetError:
        pass  # also an end
    return received


def test_a_client_that_never_reads_is_closed_and_the_bystander_is_served(daemon):
    with RawConnection(daemon.socket_path) as bystander:
        known_answer = bystander.result("generate", BYSTANDER)["text"]
        rss_after_round: list[int] = []
        for _ in range(3):  # more rounds must not need more memory
            num_dropped_before = len(daemon.events("client_too_slow"))
            slow = flood_without_reading(daemon.socket_path)
            deadline = time.monotonic() + 120
            while True:  # the bystander is answered at least once while the flood runs
                assert bystander.result("generate", BYSTANDER)["text"] == known_answer
                if len(daemon.events("client_too_slow")) > num_dropped_before:
                    break
                assert time.monotonic() < deadline, f"no client_too_slow within 120 s; stderr tail:\n{daemon.log_tail()}"
            dropped = daemon.events("client_too_slow")[-1]
            assert dropped["queued_bytes"] > OUTBOX_LIMIT and dropped["limit_bytes"] == OUTBOX_LIMIT
            left_in_the_kernel = read_to_the_end(slow)
            slow.close()
            assert left_in_the_kernel < 8 * 1024 * 1024
            gone = daemon.wait_for_event("client_disconnected", client=dropped["client"])
            assert gone["reason"] == "too_slow"
            wait_until_idle(bystander)  # its jobs were cancelled, not left to run 4,000 tokens each
            assert bystander.result("generate", BYSTANDER)["text"] == known_answer
            rss_after_round.append(rss_bytes(daemon.pid))
    # The first round warms allocators up; after it, memory stays put.
    assert rss_after_round[2] - rss_after_round[0] < 32 * 1024 * 1024, rss_after_round


def wait_until_idle(conn: RawConnection, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        requests = conn.result("stats")["requests"]
        if requests["active"] == 0 and requests["queued"] == 0:
            return
        assert time.monotonic() < deadline, f"still running after the client was dropped: {requests}"
        time.sleep(0.1)
