"""The start-up load and prefetch, through Persistence on a stand-in engine thread (no model, fake KV).

The load imports in scan order (root edges first, shortest first); a gate on
reading the filler entries holds it there, so a test can ask for a prompt
whose entries the load has not reached yet.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import pytest
from structlog.testing import capture_logs

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.kv.layout import CacheLayout
from prefixd.daemon.kv.segments import KVSegment, segments_source
from prefixd.daemon.persist import startup_load
from prefixd.daemon.persist.cache_dir import DiskCache
from prefixd.daemon.persist.format import encode_entry, read_header, read_payload
from prefixd.daemon.persist.persistence import DiskCacheSettings, Persistence
from tests.support.engine_thread import EngineThread

FP = "f00dfacef00dface"
MLX = version("mlx")  # what Persistence stamps its files with
LLAMA = CacheLayout(attention_layers=(0, 1), state_layers=(), other_layers=())
SYSTEM = list(range(1, 41))
CHAT = SYSTEM + list(range(100, 130))  # two entries: [0, 40) and [40, 70)
PROMPT = CHAT + [7, 8, 9]
NUM_FILLERS = 12
TIMEOUT = 10.0


def kv(tokens) -> KVSegment:
    """KV whose values encode the token ids (made on the engine thread)."""
    base = mx.array(list(tokens), dtype=mx.float32).reshape(1, 1, -1, 1)
    keys = [mx.broadcast_to(base + layer, (1, 2, len(tokens), 4)) * 1.0 for layer in range(2)]
    values = [k * 2.0 for k in keys]
    mx.eval(keys, values)
    return KVSegment(keys, values, len(tokens))


def fillers(length: int) -> list[list[int]]:
    """Root edges of other prompts; ``length`` decides where the scan order puts them."""
    return [[1000 + 100 * i + j for j in range(length)] for i in range(NUM_FILLERS)]


def make_store() -> PrefixStore:
    return PrefixStore(max_bytes=1 << 30, max_nodes=10_000, max_pinned_bytes=1 << 28)


def settings(root: Path, save_interval: float = 3600.0) -> DiskCacheSettings:
    return DiskCacheSettings(root, 1 << 30, save_interval)


def write_disk_store(root: Path, filler_length: int) -> None:
    """A first run: the chat and the fillers, saved by Persistence itself."""
    engine = EngineThread(make_store(), {FP: LLAMA})

    def fill() -> None:
        engine.store.insert(FP, CHAT, 0, kv(CHAT), {40: ("message", None), 70: ("prompt-end", None)})
        for tokens in fillers(filler_length):
            engine.store.insert(FP, tokens, 0, kv(tokens), {len(tokens): ("prompt-end", None)})

    async def first_run() -> None:
        engine.run(fill)
        persistence = Persistence(engine, settings(root))
        await persistence.start()
        await asyncio.wait_for(persistence.loaded.wait(), TIMEOUT)
        await persistence.stop()

    asyncio.run(first_run())
    engine.close()


class ReadGate:
    """Counts payload reads per file and holds the reads of filler files until opened."""

    def __init__(self, monkeypatch):
        self.reads: Counter[Path] = Counter()
        self.open = threading.Event()
        self.a_filler_waits = threading.Event()
        monkeypatch.setattr(startup_load, "read_payload", self._read)

    def _read(self, header):
        self.reads[header.path] += 1
        if header.key[0] >= 1000:
            self.a_filler_waits.set()
            assert self.open.wait(TIMEOUT), "the gate was never opened"
        return read_payload(header)


def stored_length(engine: EngineThread, tokens: list[int]) -> tuple[int, str]:
    def look():
        match = engine.store.match(FP, tokens)
        engine.store.release(match.lease)
        return match.length, segments_source(match.segments)
    return engine.run(look)


def num_nodes(engine: EngineThread) -> int:
    return engine.run(lambda: engine.store.stats().total.num_nodes)


async def wait_until(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, TIMEOUT)


def test_prefetch_imports_the_prompts_entries_before_the_load_reaches_them(tmp_path, monkeypatch):
    write_disk_store(tmp_path / "kv", filler_length=10)  # scanned before the chat's 40-token root edge
    gate = ReadGate(monkeypatch)
    engine = EngineThread(make_store(), {FP: LLAMA})

    async def restart() -> None:
        persistence = Persistence(engine, settings(tmp_path / "kv"))
        await persistence.start()
        await wait_until(gate.a_filler_waits)  # the load is stuck at the first filler
        await asyncio.wait_for(persistence.prefetch(FP, PROMPT), TIMEOUT)
        assert stored_length(engine, PROMPT) == (70, "disk")
        assert not persistence.loaded.is_set()
        gate.open.set()
        await asyncio.wait_for(persistence.loaded.wait(), TIMEOUT)
        assert persistence.counts["imported"] == NUM_FILLERS + 2  # the chat's two entries counted once
        await persistence.stop()

    with capture_logs() as logs:
        asyncio.run(restart())
    assert set(gate.reads.values()) == {1}  # no file read twice
    assert num_nodes(engine) == NUM_FILLERS + 2
    engine.run(engine.store.check_integrity)
    (loaded,) = [e for e in logs if e["event"] == "disk_cache_loaded"]
    assert loaded["imported"] == NUM_FILLERS + 2 and loaded["orphans"] == 0 and loaded["skipped"] == 0


def test_prefetch_reuses_what_the_load_has_read_and_nothing_is_imported_twice(tmp_path, monkeypatch):
    # Fillers of 50 tokens sort between the chat's root edge (0..40) and its second entry (40..70):
    # the load has read the root edge into its batch, not imported it, when the prompt arrives.
    write_disk_store(tmp_path / "kv", filler_length=50)
    monkeypatch.setattr(startup_load, "BATCH_BYTES", 1 << 30)  # the load's batch waits for all of them
    gate = ReadGate(monkeypatch)
    engine = EngineThread(make_store(), {FP: LLAMA})

    async def restart() -> None:
        persistence = Persistence(engine, settings(tmp_path / "kv"))
        await persistence.start()
        await wait_until(gate.a_filler_waits)
        await asyncio.wait_for(persistence.prefetch(FP, PROMPT), TIMEOUT)
        assert stored_length(engine, PROMPT) == (70, "disk")
        gate.open.set()
        await asyncio.wait_for(persistence.loaded.wait(), TIMEOUT)
        assert persistence.counts["imported"] == NUM_FILLERS + 2
        await persistence.stop()

    asyncio.run(restart())
    assert set(gate.reads.values()) == {1}
    assert num_nodes(engine) == NUM_FILLERS + 2
    engine.run(engine.store.check_integrity)


def test_prefetch_skips_a_bad_file_with_one_log_line_and_never_raises(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    write_disk_store(root, filler_length=10)
    disk = DiskCache(root, 1 << 30, MLX)
    second_entry = next(h for h in disk.scan({FP}).headers if h.start == 40)
    data = bytearray(second_entry.path.read_bytes())
    data[-5] ^= 0xFF
    second_entry.path.write_bytes(bytes(data))
    gate = ReadGate(monkeypatch)
    engine = EngineThread(make_store(), {FP: LLAMA})

    async def restart() -> None:
        persistence = Persistence(engine, settings(root))
        await persistence.start()
        await wait_until(gate.a_filler_waits)
        await asyncio.wait_for(persistence.prefetch(FP, PROMPT), TIMEOUT)
        assert stored_length(engine, PROMPT) == (40, "disk")  # what the good file holds
        await asyncio.wait_for(persistence.prefetch(FP, PROMPT), TIMEOUT)  # again: not read again
        gate.open.set()
        await asyncio.wait_for(persistence.loaded.wait(), TIMEOUT)
        assert persistence.counts["skipped"] == 1 and persistence.counts["imported"] == NUM_FILLERS + 1
        await persistence.stop()

    with capture_logs() as logs:
        asyncio.run(restart())
    skipped = [e for e in logs if e["event"] == "disk_cache_entry_skipped"]
    assert len(skipped) == 1 and "checksum mismatch" in skipped[0]["reason"]
    assert gate.reads[second_entry.path] == 1


def test_prefetch_returns_at_once_once_the_load_is_over_or_when_there_is_none(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    write_disk_store(root, filler_length=10)
    engine = EngineThread(make_store(), {FP: LLAMA})

    async def after_the_load() -> None:
        persistence = Persistence(engine, settings(root))
        await persistence.start()
        await asyncio.wait_for(persistence.loaded.wait(), TIMEOUT)
        monkeypatch.setattr(startup_load, "read_payload", lambda header: pytest.fail("read after the load"))
        await asyncio.wait_for(persistence.prefetch(FP, PROMPT), 0.5)
        await persistence.stop()

    async def with_the_dir_taken() -> None:
        holder = DiskCache(root, 1 << 30, "unused")
        assert holder.open()
        persistence = Persistence(engine, settings(root))
        await persistence.start()  # another daemon holds the dir: no load at all
        await asyncio.wait_for(persistence.prefetch(FP, PROMPT), 0.5)
        await persistence.stop()
        holder.close()

    asyncio.run(after_the_load())
    asyncio.run(with_the_dir_taken())


def rewrite_kind(path: Path, kind: str) -> None:
    """A well-formed file with a valid checksum whose checkpoint kind this prefixd does not know."""
    header = read_header(path)
    payload = read_payload(header)
    header.kind = kind
    path.write_bytes(encode_entry(header, payload))


def test_an_entry_that_makes_import_raise_costs_that_entry_only(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    write_disk_store(root, filler_length=10)
    headers = DiskCache(root, 1 << 30, MLX).scan({FP}).headers
    odd = next(h for h in headers if h.key[0] == 1000)
    rewrite_kind(odd.path, "from-a-newer-prefixd")  # the store refuses it: ValueError inside import_entries
    monkeypatch.setattr(startup_load, "BATCH_BYTES", 1)  # one entry per batch: the next batch follows
    engine = EngineThread(make_store(), {FP: LLAMA})

    async def restart() -> int:
        persistence = Persistence(engine, settings(root, save_interval=0.05))
        await persistence.start()
        await asyncio.wait_for(persistence.loaded.wait(), TIMEOUT)
        assert persistence.counts["imported"] == NUM_FILLERS + 1 and persistence.counts["failed"] == 1
        while persistence.counts["pruned"] == 0:  # the periodic save runs, and drops the refused file
            await asyncio.sleep(0.02)
        await persistence.stop()
        return persistence.counts["pruned"]

    with capture_logs() as logs:
        assert asyncio.run(asyncio.wait_for(restart(), TIMEOUT)) == 1
    failed = [e for e in logs if e["event"] == "disk_cache_import_failed"]
    assert len(failed) == 1 and "ValueError" in failed[0]["error"] and failed[0]["first_file"] == str(odd.path)
    assert not odd.path.exists()
    assert stored_length(engine, PROMPT) == (70, "disk")


def test_an_engine_call_that_fails_does_not_end_the_load(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    write_disk_store(root, filler_length=10)
    monkeypatch.setattr(startup_load, "BATCH_BYTES", 1)
    engine = EngineThread(make_store(), {FP: LLAMA})
    calls = iter(range(1_000_000))
    engine.refuse = lambda: next(calls) == 0  # the load's first batch: a filler

    async def restart() -> None:
        persistence = Persistence(engine, settings(root, save_interval=0.05))
        await persistence.start()
        await asyncio.wait_for(persistence.loaded.wait(), TIMEOUT)
        assert persistence.counts["imported"] == NUM_FILLERS - 1 + 2
        before = persistence.counts["written"] + persistence.counts["pruned"]
        while persistence.counts["written"] + persistence.counts["pruned"] == before:
            await asyncio.sleep(0.02)  # the periodic save runs
        await persistence.stop()

    with capture_logs() as logs:
        asyncio.run(asyncio.wait_for(restart(), TIMEOUT))
    failed = [e for e in logs if e["event"] == "disk_cache_import_failed"]
    assert len(failed) == 1 and "refused" in failed[0]["error"]
    assert len([e for e in logs if e["event"] == "disk_cache_loaded"]) == 1
