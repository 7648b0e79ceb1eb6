"""What a save asks of the engine thread: one listing, then MLX serialization in bounded batches, nothing else."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from types import SimpleNamespace

import mlx.core as mx

from prefixd.daemon.persist import format as entry_format
from prefixd.daemon.persist import persistence as persistence_module
from prefixd.daemon.persist.cache_dir import DiskCache
from prefixd.daemon.persist.entries import list_edges
from prefixd.daemon.persist.export_plan import ExportPlan, plan_export
from prefixd.daemon.persist.persistence import DiskCacheSettings, Persistence
from tests.support.engine_thread import EngineThread
from tests.unit.test_disk_cache_startup import FP, LLAMA, MLX, kv, make_store

SESSIONS = 30
TURNS = 4


def chat_store(engine: EngineThread) -> int:
    """SESSIONS chats of TURNS turns on one system prompt, stored turn by turn; returns the edge count."""
    system = list(range(1, 65))

    def fill() -> int:
        for session in range(SESSIONS):
            tokens = list(system)
            for turn in range(TURNS):
                start = len(tokens) if turn else 0  # the first turn stores the system prompt too (once)
                tokens += [1000 + session * 100 + turn * 20 + j for j in range(20)]
                engine.store.insert(FP, tokens, start, kv(tokens[start:]), {len(tokens): ("answer-end", None)})
        return engine.store.stats().total.num_nodes

    return engine.run(fill)


def test_a_save_leaves_ids_digests_checksums_and_framing_to_worker_threads(tmp_path, monkeypatch):
    engine = EngineThread(make_store(), {FP: LLAMA})
    num_edges = chat_store(engine)
    assert num_edges == 1 + SESSIONS * TURNS
    sha_threads: list[threading.Thread] = []
    mlx_threads: list[threading.Thread] = []

    def sha256(*args):
        sha_threads.append(threading.current_thread())
        return hashlib.sha256(*args)

    real_save = mx.save_safetensors

    def save_safetensors(*args, **kwargs):
        mlx_threads.append(threading.current_thread())
        return real_save(*args, **kwargs)

    monkeypatch.setattr(entry_format, "hashlib", SimpleNamespace(sha256=sha256))
    monkeypatch.setattr(mx, "save_safetensors", save_safetensors)
    monkeypatch.setattr(persistence_module, "SAVE_BATCH_BYTES", 64 << 10)  # several serialization calls

    async def save_once() -> None:
        persistence = Persistence(engine, DiskCacheSettings(tmp_path / "kv", 1 << 30, 3600.0))
        await persistence.start()
        await persistence.loaded.wait()
        engine.call_seconds.clear()
        sha_threads.clear()
        await persistence.save()
        assert persistence.counts["written"] == num_edges
        await persistence.stop()

    asyncio.run(save_once())
    assert sha_threads and engine.thread not in sha_threads  # entry ids, token digests, checksums
    assert set(mlx_threads) == {engine.thread} and len(mlx_threads) == num_edges
    edge_bytes = engine.run(lambda: max(e.nbytes for e in engine.store.edges(FP)))
    num_batches = len(engine.call_seconds) - 1  # beside the one listing
    assert num_batches >= engine.run(lambda: engine.store.num_bytes) // ((64 << 10) + edge_bytes)
    headers = DiskCache(tmp_path / "kv", 1 << 30, MLX).scan({FP}).headers
    assert len(headers) == num_edges


def test_batches_are_bounded_by_bytes_and_by_edges():
    edges = [SimpleNamespace(stored=SimpleNamespace(nbytes=n)) for n in (10, 10, 10, 50, 1, 1, 1, 1)]
    plan = ExportPlan(live=set(), new=edges)
    assert [[e.stored.nbytes for e in b] for b in plan.batches(25, max_edges=3)] == [
        [10, 10], [10], [50], [1, 1, 1], [1]]


def test_the_plan_keeps_the_most_recent_within_the_budget_with_their_ancestors():
    engine = EngineThread(make_store(), {FP: LLAMA})
    chat_store(engine)
    listing = engine.run(lambda: list_edges(engine.store, [FP]))
    everything = plan_export(listing, on_disk=set(), max_bytes=1 << 30)
    assert len(everything.live) == len(listing[FP]) == len(everything.new)
    root_edge = next(e for e in everything.new if e.parent is None)
    half = plan_export(listing, on_disk={root_edge.ident}, max_bytes=engine.run(lambda: engine.store.num_bytes) // 2)
    assert root_edge.ident in half.live and root_edge.ident not in {e.ident for e in half.new}
    by_id = {e.ident: e for e in everything.new}
    assert all(by_id[i].parent is None or by_id[i].parent in half.live for i in half.live)
    newest = max((e for e in listing[FP] if e.parent_id is not None), key=lambda e: e.last_access)
    assert any(e.stored is newest for e in half.new)  # the last chat turn is kept, the oldest are not
    oldest = min(listing[FP], key=lambda e: e.last_access)
    assert all(e.stored is not oldest for e in half.new)
