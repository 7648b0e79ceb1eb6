"""The engine thread is supervised: a failure fails the requests it touched, never the daemon's service.

Faults are injected through ``PREFIXD_FAULTS`` (daemon/engine/faults.py), at
each step of the engine loop, in a real daemon; a bystander then checks that
the daemon still answers with the text it gives alone. When the engine cannot
go on, every waiting and later request gets ENGINE_DEAD at once and the
daemon exits non-zero, so that a service manager restarts it.
"""

from __future__ import annotations

import threading

import pytest

from tests.e2e.daemon_process import RawConnection

INTERNAL, ENGINE_DEAD = -32603, -32009


def solo(conn: RawConnection, prompt: str, max_tokens: int = 8) -> str:
    return conn.result("generate", {"prompt": prompt, "max_tokens": max_tokens,
                                    "cache": {"use": False, "store": False}})["text"]


def test_one_token_prompts_at_once_are_answered_and_stored_cleanly(start_daemon):
    """Three 1-token prompts at once killed the engine thread (issue: a prompt-end checkpoint at depth 0).

    Several rounds of six, so that at least three reach the engine in one iteration.
    """
    daemon = start_daemon()
    for round_index in range(3):
        connections = [RawConnection(daemon.socket_path) for _ in range(6)]
        replies: list = [None] * len(connections)
        barrier = threading.Barrier(len(connections))

        def ask(index: int) -> None:
            barrier.wait()
            # One token: its answer is stored with a prompt-end checkpoint at depth 0 unless guarded.
            msgid = connections[index].request("generate", {"tokens": [42 + round_index], "max_tokens": 1})
            replies[index] = connections[index].reply(msgid)[1]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(connections))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for conn in connections:
            conn.close()
        for reply in replies:
            assert reply is not None and reply[2] is None, reply
            assert reply[3]["usage"]["completion_tokens"] <= 1
    with RawConnection(daemon.socket_path) as conn:
        assert conn.result("tokenize", {"prompt": "Hi"})["num_tokens"] >= 1
        assert conn.result("stats")["requests"]["active"] == 0
    failures = [line for line in daemon.log_lines() if line.get("level") in ("error", "critical")]
    assert not failures, failures  # stored cleanly, not merely survived


@pytest.mark.parametrize("point", ["admit", "prefill", "first_token", "decode_step", "token", "finish", "store_answer"])
def test_a_fault_at_each_step_fails_only_the_request_it_touched(start_daemon, point):
    daemon = start_daemon(env={"PREFIXD_FAULTS": f"{point}:1"})  # the first time the engine reaches it
    with RawConnection(daemon.socket_path) as victim, RawConnection(daemon.socket_path) as bystander:
        msgid = victim.request("generate", {"prompt": "a request that meets a fault", "max_tokens": 6})
        _, response = victim.reply(msgid)
        if response[2] is not None:  # the fault hit this request: it says so
            assert response[2]["code"] == INTERNAL and "injected fault" in response[2]["message"]
        expected = solo(bystander, "the bystander's question")
        assert solo(bystander, "the bystander's question") == expected
        stats = bystander.result("stats")["requests"]
        assert stats["active"] == 0 and stats["failed"] + stats["completed"] >= 1
        assert victim.result("ping")["pong"] is True
    logged = [line for line in daemon.log_lines() if "injected fault" in line.get("exception", "")]
    assert logged and all(line["level"] == "error" for line in logged), daemon.log_tail()


def test_a_failed_admission_releases_its_slot(start_daemon):
    daemon = start_daemon(extra_args=["--max-active", "1"], env={"PREFIXD_FAULTS": "start_prefill:2"})
    with RawConnection(daemon.socket_path) as conn:
        conn.result("generate", {"prompt": "a request whose prefix is stored", "max_tokens": 2})
        msgid = conn.request("generate", {"prompt": "a request whose prefix is stored", "max_tokens": 2})
        _, failed = conn.reply(msgid)
        assert failed[2]["code"] == INTERNAL
        # With the only slot leaked, this would queue forever.
        assert conn.result("generate", {"prompt": "the next one", "max_tokens": 2}, timeout=30)["text"] is not None
        assert conn.result("stats")["requests"]["active"] == 0


def test_an_engine_that_cannot_go_on_fails_everyone_at_once_and_the_daemon_exits(start_daemon):
    daemon = start_daemon(env={"PREFIXD_FAULTS": "loop:*"})  # every iteration of the loop fails
    with RawConnection(daemon.socket_path, timeout=20) as conn:
        msgid = conn.request("generate", {"prompt": "anyone there?", "max_tokens": 4})
        _, response = conn.reply(msgid)
    assert response[2]["code"] == ENGINE_DEAD, response
    assert "engine" in response[2]["message"]
    dead = daemon.wait_for_event("engine_dead")
    assert dead["level"] == "critical"
    assert daemon.wait(timeout=30) == 1


def test_a_chunk_that_cannot_be_relayed_fails_its_request_stops_its_job_and_spares_the_rest(start_daemon):
    # The front relays streamed chunks from the engine's event drain (front/chunk_relay.py): a failure there
    # must fail that request alone, in its own reply, and free the engine of a job nobody can read.
    daemon = start_daemon(env={"PREFIXD_FAULTS": "relay_chunk:2"})  # the second chunk relayed
    with RawConnection(daemon.socket_path) as victim, RawConnection(daemon.socket_path) as bystander:
        msgid = victim.request("generate", {"prompt": "a long answer that breaks on its way out", "max_tokens": 200,
                                            "stream": True, "cache": {"use": False, "store": False}})
        chunks, response = victim.reply(msgid)
        assert response[2]["code"] == INTERNAL and "injected fault at relay_chunk" in response[2]["message"]
        assert len(chunks) == 1  # the first went out; nothing after the failure
        assert victim.result("ping")["pong"] is True
        expected = solo(bystander, "the bystander's question")
        assert solo(bystander, "the bystander's question") == expected
        ended = daemon.wait_for_event("generate", finish_reason="cancelled")  # the abandoned job's end is logged
        assert ended["completion_tokens"] < 200, ended
        assert bystander.result("stats")["requests"]["active"] == 0
