"""What the disk cache costs the engine thread, and how soon a restarted store serves one prompt: figures printed.

    .venv/bin/python -m tests.support.measure_disk_cache [--sessions 200] [--turns 20] [--prefetch]

A store of ``sessions`` chats of ``turns`` turns (one edge per turn, 64
tokens each, on 10 shared 256-token system prompts; fake KV of 1 KiB per
token) on a stand-in engine thread (tests/support/engine_thread.py), then:

* a full save (every edge new, as at the first shutdown), then saves after
  one new turn in each of 10 chats (the periodic case): the time spent on the
  engine thread (inside engine.call: what stalls decoding), the first call
  (this prefixd: listing the edges; before: the whole export), the longest
  single call, and the wall time;
* with ``--prefetch`` (this prefixd only): a restart, then one chat's last
  prompt asked for at once: how long ``Persistence.prefetch`` takes to have
  it in the store, against the whole background load.

Uses only Persistence(engine, settings), start(), loaded, save() and stop()
for the saves, so the same script measures an older checkout too. Not a
test: nothing fails; figures vary with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import structlog

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.kv.layout import CacheLayout
from prefixd.daemon.kv.segments import KVSegment
from prefixd.daemon.persist.persistence import DiskCacheSettings, Persistence
from tests.support.engine_thread import EngineThread

FP = "0123456789abcdef"
LAYOUT = CacheLayout(attention_layers=(0, 1, 2, 3), state_layers=(), other_layers=())
SYSTEM_TOKENS = 256
TURN_TOKENS = 64
NUM_SYSTEMS = 10


def kv(num_tokens: int) -> KVSegment:
    """4 layers x (keys, values) x 2 heads x 32 dims in float16: 1 KiB per token."""
    shape = (1, 2, num_tokens, 32)
    keys = [mx.random.normal(shape).astype(mx.float16) for _ in LAYOUT.attention_layers]
    values = [mx.random.normal(shape).astype(mx.float16) for _ in LAYOUT.attention_layers]
    mx.eval(keys, values)
    return KVSegment(keys, values, num_tokens)


def chat_tokens(session: int, turns: int) -> list[int]:
    system = [10 + (session % NUM_SYSTEMS) * 1000 + j for j in range(SYSTEM_TOKENS)]
    base = 20_000 + session * 2_000
    return system + [base + j for j in range(turns * TURN_TOKENS)]


def store_turn(store: PrefixStore, session: int, turn: int) -> None:
    """Store a chat up to the end of ``turn`` (the first turn brings its system prompt when it is new)."""
    tokens = chat_tokens(session, turn + 1)
    start = len(tokens) - TURN_TOKENS if turn else 0
    if turn == 0 and session >= NUM_SYSTEMS:
        start = SYSTEM_TOKENS  # the system prompt is stored already
    store.insert(FP, tokens, start, kv(len(tokens) - start), {len(tokens): ("answer-end", None)})


def build_store(engine: EngineThread, sessions: int, turns: int) -> None:
    def fill() -> None:
        for session in range(sessions):
            for turn in range(turns):
                store_turn(engine.store, session, turn)
    engine.run(fill)


async def timed_save(persistence: Persistence, engine: EngineThread) -> dict:
    engine.call_seconds.clear()
    started = time.perf_counter()
    await persistence.save()
    wall = time.perf_counter() - started
    calls = list(engine.call_seconds)
    return {"engine_ms": 1000 * sum(calls), "longest_call_ms": 1000 * max(calls, default=0.0),
            "first_call_ms": 1000 * calls[0] if calls else 0.0, "calls": len(calls), "wall_ms": 1000 * wall}


def show(label: str, figures: dict) -> None:
    print(f"{label:<34} engine thread {figures['engine_ms']:8.1f} ms in {figures['calls']:3d} calls "
          f"(first {figures['first_call_ms']:6.1f}, longest {figures['longest_call_ms']:6.1f} ms), "
          f"wall {figures['wall_ms']:7.0f} ms")


async def measure_saves(root: Path, sessions: int, turns: int) -> EngineThread:
    engine = EngineThread(PrefixStore(max_bytes=8 << 30, max_nodes=1 << 20, max_pinned_bytes=1 << 30), {FP: LAYOUT})
    build_store(engine, sessions, turns)
    stats = engine.run(lambda: engine.store.stats().total)
    print(f"store: {stats.num_nodes} edges, {stats.num_bytes / 2**20:.0f} MiB")
    persistence = Persistence(engine, DiskCacheSettings(root, 16 << 30, 3600.0))
    await persistence.start()
    await persistence.loaded.wait()
    show("full save (every edge new)", await timed_save(persistence, engine))
    periodic = []
    for round_ in range(3):
        engine.run(lambda: [store_turn(engine.store, session, turns + round_) for session in range(10)])
        periodic.append(await timed_save(persistence, engine))
    median = {key: statistics.median(f[key] for f in periodic) for key in periodic[0]}
    show("periodic save (10 new edges), median", median)
    await persistence.stop()
    return engine


async def measure_prefetch(root: Path, sessions: int, turns: int) -> None:
    engine = EngineThread(PrefixStore(max_bytes=8 << 30, max_nodes=1 << 20, max_pinned_bytes=1 << 30), {FP: LAYOUT})
    persistence = Persistence(engine, DiskCacheSettings(root, 16 << 30, 3600.0))
    prompt = chat_tokens(sessions - 1, turns + 3) + [7]  # the last chat: the deepest entries, scanned last
    started = time.perf_counter()
    await persistence.start()
    await persistence.prefetch(FP, prompt)
    prefetched = time.perf_counter() - started

    def reused() -> int:
        match = engine.store.match(FP, prompt)
        engine.store.release(match.lease)
        return match.length

    length = engine.run(reused)
    await persistence.loaded.wait()
    loaded = time.perf_counter() - started
    print(f"restart: prompt of {len(prompt)} tokens stored ({length} reusable) after {1000 * prefetched:.0f} ms "
          f"with prefetch; the whole load took {1000 * loaded:.0f} ms ({persistence.counts['imported']} entries)")
    await persistence.stop()
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--prefetch", action="store_true", help="also measure a restart with prefetch")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # figures only
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "kv"
        engine = asyncio.run(measure_saves(root, args.sessions, args.turns))
        engine.close()
        if args.prefetch:
            asyncio.run(measure_prefetch(root, args.sessions, args.turns))


if __name__ == "__main__":
    main()
