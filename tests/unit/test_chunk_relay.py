"""A job's chunks go straight to its client from the mailbox's drain; only its end wakes the waiting task."""

from __future__ import annotations

import asyncio

from prefixd.daemon.engine.jobs import CHUNK, DONE
from prefixd.daemon.front.chunk_relay import RELAY_FAILED, ChunkRelay


async def test_chunks_go_out_in_order_and_only_the_end_wakes_the_task():
    sent = []
    relay = ChunkRelay(sent.append)
    for n in range(3):
        relay.deliver((CHUNK, {"index": n}))
    assert [c["index"] for c in sent] == [0, 1, 2]
    assert relay.ends.empty()  # nothing for the task to do yet
    relay.deliver((DONE, {"text": "abc"}))
    assert await asyncio.wait_for(relay.ends.get(), 1) == (DONE, {"text": "abc"})


async def test_the_answer_reader_sees_each_chunk_before_the_client():
    class Upper:
        def chunk(self, payload):
            return {**payload, "text": payload["text"].upper()}

    sent = []
    relay = ChunkRelay(sent.append)
    relay.reader = Upper()
    relay.deliver((CHUNK, {"text": "hi"}))
    assert sent == [{"text": "HI"}]


async def test_a_chunk_that_fails_to_relay_fails_the_request_and_no_later_chunk_goes_out():
    sent = []

    def on_chunk(chunk):
        if chunk["index"] == 1:
            raise ValueError("cannot relay this one")
        sent.append(chunk)

    relay = ChunkRelay(on_chunk)
    for n in range(4):
        relay.deliver((CHUNK, {"index": n}))  # never raises: it runs inside everyone's drain
    assert [c["index"] for c in sent] == [0]
    kind, exc = await asyncio.wait_for(relay.ends.get(), 1)
    assert kind == RELAY_FAILED and isinstance(exc, ValueError)


async def test_a_stopped_relay_drops_text_but_still_reports_the_end():
    sent = []
    relay = ChunkRelay(sent.append)
    relay.stop()
    relay.deliver((CHUNK, {"index": 0}))
    relay.deliver((DONE, {"finish_reason": "cancelled"}))
    assert sent == []
    assert (await asyncio.wait_for(relay.ends.get(), 1))[0] == DONE
