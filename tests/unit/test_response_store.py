"""The Responses API's stored responses, without a model: bounds, chains, and the copy on disk."""

from __future__ import annotations

import asyncio

from prefixd.daemon.front.response_store import ResponseStore


def response(response_id: str, text: str, previous: str | None = None, created_at: int = 0) -> dict:
    return {"id": response_id, "object": "response", "created_at": created_at, "previous_response_id": previous,
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]}


def user(text: str) -> list[dict]:
    return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]


def test_a_chain_holds_every_turn_and_outlives_its_predecessors_eviction():
    store = ResponseStore(max_responses=2)
    store.put(response("resp_1", "a1"), [], user("q1"))
    store.put(response("resp_2", "a2", "resp_1"), store.conversation("resp_1"), user("q2"))
    store.put(response("resp_3", "a3", "resp_2"), store.conversation("resp_2"), user("q3"))
    assert store.get("resp_1") is None and len(store) == 2  # the least recently used went
    texts = [part["text"] for item in store.conversation("resp_3") for part in item["content"]]
    assert texts == ["q1", "a1", "q2", "a2", "q3", "a3"]


def test_the_byte_bound_evicts_the_least_recently_used():
    store = ResponseStore(max_bytes=600)
    for number in range(5):
        store.put(response(f"resp_{number}", "x" * 100), [], user("y" * 100))
    store.get("resp_2")  # used: kept over older ones
    store.put(response("resp_9", "x" * 100), [], user("y" * 100))
    assert store.num_bytes <= 600 and store.get("resp_9") is not None
    assert store.get("resp_0") is None


def test_deleted_is_gone():
    store = ResponseStore()
    store.put(response("resp_1", "a"), [], user("q"))
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert store.get("resp_1") is None and store.num_bytes == 0


def test_the_copy_on_disk_rebuilds_the_chains_and_skips_orphans(tmp_path):
    async def write() -> None:
        store = ResponseStore(directory=tmp_path)
        store.put(response("resp_1", "a1", created_at=1), [], user("q1"))
        store.put(response("resp_2", "a2", "resp_1", created_at=2), store.conversation("resp_1"), user("q2"))
        store.put(response("resp_x", "ax", "resp_gone", created_at=3), [], user("qx"))  # continued one never stored
        store.put(response("resp_d", "ad", created_at=4), [], user("qd"))
        store.delete("resp_d")
        await store.flush()

    asyncio.run(write())
    (tmp_path / "resp_bad.json").write_text("{not json")
    again = ResponseStore(directory=tmp_path)
    assert again.load() == 2
    texts = [part["text"] for item in again.conversation("resp_2") for part in item["content"]]
    assert texts == ["q1", "a1", "q2", "a2"]
    assert again.get("resp_x") is None and again.get("resp_d") is None
