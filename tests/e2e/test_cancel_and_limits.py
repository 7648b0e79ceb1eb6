"""Cancel, disconnect, overload and shutdown, seen from clients of a real daemon.

What a user notices: a cancelled or abandoned request stops using the engine
while the others in the same batch finish with the same text they get alone;
past the queue limits an OVERLOADED error comes back at once rather than a
hang; SIGTERM lets running work finish (or cancels it after the grace period),
removes the socket and exits 0; a second daemon never displaces a live one.
"""

from __future__ import annotations

import socket
import subprocess
import time

from tests.e2e.daemon_process import RawConnection, daemon_command, daemon_env

OVERLOADED, SHUTTING_DOWN = -32003, -32005
LONG = 4000  # more tokens than any of these tests lets a request produce before it is stopped


def solo_text(conn: RawConnection, prompt: str, max_tokens: int) -> str:
    return conn.result("generate", {"prompt": prompt, "max_tokens": max_tokens, "cache": {"use": False, "store": False}})["text"]


def start_stream(conn: RawConnection, prompt: str, max_tokens: int = LONG) -> int:
    """Send a streamed generate and return its msgid once its first chunk arrived (it is running)."""
    msgid = conn.request("generate", {"prompt": prompt, "max_tokens": max_tokens, "stream": True})
    while True:
        message = conn.read()
        if message[0] == 2 and message[2][0]["id"] == msgid:
            return msgid
        conn.inbox.append(message)  # someone else's: keep it for later reads


def wait_for_queued(conn: RawConnection, num_queued: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (stats := conn.result("stats")["requests"])["queued"] != num_queued and time.monotonic() < deadline:
        time.sleep(0.02)
    return stats


def test_cancel_stops_one_request_and_the_batch_carries_on(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn, RawConnection(shared_daemon.socket_path) as other:
        expected = solo_text(other, "the neighbour of a cancelled request", 24)
        victim = start_stream(conn, "a request that will be cancelled")
        neighbour = other.request("generate", {"prompt": "the neighbour of a cancelled request", "max_tokens": 24})
        assert conn.result("cancel", {"id": victim}) == {"cancelled": True}
        _, response = conn.reply(victim)
        _, done = other.reply(neighbour)
        assert conn.result("cancel", {"id": victim}) == {"cancelled": False}  # already over
    assert response[2] is None and response[3]["finish_reason"] == "cancelled"
    assert response[3]["usage"]["completion_tokens"] < LONG
    assert done[2] is None and done[3]["text"] == expected


def test_a_client_that_disconnects_frees_its_slot_and_the_others_finish(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as other:
        expected = solo_text(other, "a survivor of a disconnect", 24)
        leaving = RawConnection(shared_daemon.socket_path)
        start_stream(leaving, "a request whose client walks away")
        survivor = other.request("generate", {"prompt": "a survivor of a disconnect", "max_tokens": 24})
        leaving.close()
        _, done = other.reply(survivor)
        assert done[2] is None and done[3]["text"] == expected
        gone = shared_daemon.wait_for_event("client_gone", cancelled_requests=1)
        assert gone["reason"] == "eof"
        abandoned = shared_daemon.wait_for_event("generate", finish_reason="cancelled", client=gone["client"])
        assert abandoned["completion_tokens"] < LONG
        assert other.result("stats")["requests"]["active"] == 0


def test_past_the_queue_limits_overloaded_comes_back_at_once(start_daemon):
    daemon = start_daemon(extra_args=["--max-active", "1", "--max-queued", "2", "--max-queued-per-client", "1"])
    with RawConnection(daemon.socket_path) as a, RawConnection(daemon.socket_path) as b, \
            RawConnection(daemon.socket_path) as c:
        running = start_stream(a, "holds the only active slot")
        queued_a = a.request("generate", {"prompt": "queued behind it", "max_tokens": 2})
        too_many_for_a = a.request("generate", {"prompt": "one more from a", "max_tokens": 2})
        _, refused_a = a.reply(too_many_for_a)
        queued_b = b.request("generate", {"prompt": "queued from b", "max_tokens": 2})
        stats = wait_for_queued(c, 2)  # b's request travels on its own connection
        too_many_in_all = c.request("generate", {"prompt": "one more from c", "max_tokens": 2})
        _, refused_c = c.reply(too_many_in_all)
        # Both refusals arrived while the first request still runs: nobody waited for a slot.
        assert a.result("stats")["requests"]["active"] == 1
        assert a.result("cancel", {"id": running}) == {"cancelled": True}
        for conn, msgid in ((a, running), (a, queued_a), (b, queued_b)):
            assert conn.reply(msgid)[1][2] is None  # the queued ones are then served
    assert refused_a[2]["code"] == OVERLOADED and "this connection" in refused_a[2]["message"]
    assert refused_c[2]["code"] == OVERLOADED and "limit 2" in refused_c[2]["message"]
    assert stats["queued"] == 2 and stats["active"] == 1
    assert sorted(stats["queued_per_client"].values()) == [1, 1]
    assert list(stats["active_per_client"].values()) == [1]


def test_sigterm_lets_a_running_request_finish_then_removes_the_socket(start_daemon):
    daemon = start_daemon()
    with RawConnection(daemon.socket_path) as conn:
        msgid = start_stream(conn, "finishes during shutdown", max_tokens=40)
        daemon.terminate()
        _, response = conn.reply(msgid)
    assert response[2] is None and response[3]["finish_reason"] in ("length", "stop")
    assert daemon.wait() == 0
    assert not daemon.socket_path.exists()
    assert daemon.events("daemon_stopped")


def test_after_the_grace_period_running_requests_are_cancelled(start_daemon):
    daemon = start_daemon(extra_args=["--grace-seconds", "0.2"])
    with RawConnection(daemon.socket_path) as conn:
        msgid = start_stream(conn, "outlives the grace period")
        daemon.terminate()
        _, response = conn.reply(msgid)
    if response[2] is None:
        assert response[3]["finish_reason"] == "cancelled"
    else:
        assert response[2]["code"] == SHUTTING_DOWN
    assert daemon.wait() == 0


def test_a_second_daemon_on_a_live_socket_exits_with_a_clear_message(start_daemon, tiny_llama_dir, tmp_path):
    first = start_daemon()
    second = subprocess.run(daemon_command([tiny_llama_dir], first.socket_path), env=daemon_env(tmp_path),
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert second.returncode != 0
    assert "already serving" in second.stderr and str(first.socket_path) in second.stderr
    assert first.answers_ping()  # untouched


def test_a_stale_socket_file_is_replaced(start_daemon, tmp_path):
    daemon = start_daemon(start=False)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(daemon.socket_path))  # bound, never listening, then abandoned: what a crash leaves
    stale.close()
    assert daemon.socket_path.exists()
    daemon.start()
    with RawConnection(daemon.socket_path) as conn:
        assert conn.result("ping")["pong"] is True
    assert daemon.socket_path.stat().st_mode & 0o777 == 0o600
