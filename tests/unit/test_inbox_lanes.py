"""Admissions are shared fairly between lanes (clients), not connections; queue limits stay per connection."""

from __future__ import annotations

import threading

import pytest

from prefixd.daemon.engine.inbox import Inbox
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.protocol.errors import ErrorCode, RpcError
from prefixd.protocol.methods import GenerateParams, PromptInput


def job(client: str, lane: str | None = None, msgid: int = 1, answers: list | None = None) -> GenerateJob:
    def emit(kind, payload):
        if answers is not None:
            answers.append((client, msgid, payload.code))
    return GenerateJob(client, msgid, GenerateParams(prompt=PromptInput(text="x")), emit=emit, lane=lane)


def test_a_burst_over_many_connections_of_one_lane_takes_turns_with_another_client():
    inbox = Inbox(max_queued=100, max_queued_per_client=5)
    for i in range(20):  # twenty HTTP connections of one program
        inbox.put_job(job(f"http:127.0.0.1:{5000 + i}", lane="http:127.0.0.1 burst"))
    inbox.put_job(job("c7"))  # a socket client, after all of them
    taken = [inbox.take_job().client_id for _ in range(3)]
    assert taken == ["http:127.0.0.1:5000", "c7", "http:127.0.0.1:5001"]


def test_a_connection_without_a_lane_is_its_own_lane():
    inbox = Inbox(max_queued=100, max_queued_per_client=5)
    for msgid in range(3):
        inbox.put_job(job("c1", msgid=msgid))
    inbox.put_job(job("c2"))
    assert [(j.client_id, j.msgid) for j in (inbox.take_job(), inbox.take_job(), inbox.take_job())] == [
        ("c1", 0), ("c2", 1), ("c1", 1)]


def test_the_queue_limit_counts_per_connection_not_per_lane():
    inbox = Inbox(max_queued=100, max_queued_per_client=2)
    for i in range(10):  # one lane, ten connections: no connection over its limit
        inbox.put_job(job(f"conn{i}", lane="one program"))
    inbox.put_job(job("conn0", lane="one program", msgid=2))
    with pytest.raises(RpcError) as refused:
        inbox.put_job(job("conn0", lane="one program", msgid=3))
    assert refused.value.code == ErrorCode.OVERLOADED and "this connection already has 2" in refused.value.message
    assert inbox.counts()["queued_per_client"]["conn0"] == 2
    assert inbox.counts()["queued"] == 11


def test_cancelled_jobs_leave_their_lane_and_free_their_connections_places():
    answers: list = []
    inbox = Inbox(max_queued=100, max_queued_per_client=1)
    first, second = job("a", lane="L", answers=answers), job("b", lane="L", answers=answers)
    inbox.put_job(first)
    inbox.put_job(second)
    first.cancel()
    inbox.put_job(job("a", lane="L", msgid=2))  # a's place was freed by its cancelled job
    assert answers == [("a", 1, ErrorCode.CANCELLED)]
    assert [(j.client_id, j.msgid) for j in (inbox.take_job(), inbox.take_job())] == [("b", 1), ("a", 2)]
    assert inbox.take_job() is None and inbox.counts() == {"queued": 0, "encoding": 0, "queued_per_client": {}}


def test_close_returns_every_lanes_jobs():
    inbox = Inbox(max_queued=100, max_queued_per_client=5)
    jobs = [job("a", lane="L"), job("b", lane="L"), job("c")]
    for queued in jobs:
        inbox.put_job(queued)
    assert set(map(id, inbox.close())) == set(map(id, jobs))
    assert not inbox.wait(timeout=0) and inbox.take_job() is None


def test_a_waiting_take_wakes_for_a_job_put_on_another_thread():
    inbox = Inbox(max_queued=10, max_queued_per_client=5)
    threading.Timer(0.05, lambda: inbox.put_job(job("late", lane="L"))).start()
    assert inbox.wait(timeout=10) and inbox.take_job().client_id == "late"


def test_one_lane_cannot_fill_the_quarter_of_the_queue_kept_for_other_clients():
    inbox = Inbox(max_queued=8, max_queued_per_client=5)
    for i in range(5):  # five connections of one program queue; a sixth is still being encoded
        inbox.put_job(job(f"http:{i}", lane="burst"))
    inbox.reserve("http:5", "burst")
    with pytest.raises(RpcError) as refused:
        inbox.reserve("http:6", "burst")  # 6 of 8 in line: the last quarter is for everyone else
    assert refused.value.code == ErrorCode.OVERLOADED and "other clients" in refused.value.message
    inbox.put_job(job("c1"))  # a socket client still gets in, and so does a second one
    inbox.reserve("c2")
    with pytest.raises(RpcError):
        inbox.put_job(job("c3"))  # the whole queue is full now
    inbox.release("c2")
    inbox.release("http:5", "burst")
    inbox.take_job()  # the burst's first request starts: the burst may queue one more
    inbox.put_job(job("http:7", lane="burst"))


def test_cancelled_and_closed_jobs_give_their_lane_its_places_back():
    inbox = Inbox(max_queued=4, max_queued_per_client=5)
    answers: list = []
    jobs = [job(f"http:{i}", lane="burst", answers=answers) for i in range(3)]
    for queued in jobs:
        inbox.put_job(queued)
    jobs[0].cancelled.set()
    inbox.drop_cancelled("http:0")
    inbox.put_job(job("http:3", lane="burst"))  # the cancelled one's place
    assert len(inbox.close()) == 3
    assert inbox._in_line_per_lane == {}
