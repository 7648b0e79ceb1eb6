"""Requests still being encoded hold their place in line: the queue limits count them."""

from __future__ import annotations

import pytest

from prefixd.daemon.engine.inbox import Inbox
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.protocol.errors import ErrorCode, RpcError
from prefixd.protocol.methods import GenerateParams, PromptInput


def job(client: str) -> GenerateJob:
    return GenerateJob(client, 1, GenerateParams(prompt=PromptInput(text="x")), emit=lambda kind, payload: None)


def test_a_reserved_place_counts_against_the_per_client_limit():
    inbox = Inbox(max_queued=10, max_queued_per_client=1)
    inbox.reserve("a")  # encoding
    with pytest.raises(RpcError) as refused:
        inbox.reserve("a")
    assert refused.value.code == ErrorCode.OVERLOADED and "this connection already has 1" in refused.value.message
    inbox.reserve("b")  # another client is not affected
    inbox.put_job(job("a"), reserved=True)  # the encoded request fills its own place
    assert inbox.take_job().client_id in ("a",)


def test_reserved_places_count_against_the_total_and_are_given_back():
    inbox = Inbox(max_queued=2, max_queued_per_client=5)
    inbox.reserve("a")
    inbox.reserve("b")
    with pytest.raises(RpcError, match="2 requests already queued"):
        inbox.reserve("c")
    inbox.release("a")  # a's request failed while encoding
    inbox.reserve("c")
    inbox.put_job(job("b"), reserved=True)
    inbox.put_job(job("c"), reserved=True)
    with pytest.raises(RpcError, match="limit 2"):
        inbox.put_job(job("d"))


def test_releasing_more_than_was_reserved_changes_nothing():
    inbox = Inbox(max_queued=1, max_queued_per_client=1)
    inbox.release("a")
    inbox.reserve("a")
    inbox.release("a")
    inbox.release("a")
    inbox.reserve("a")
    with pytest.raises(RpcError):
        inbox.reserve("z")
