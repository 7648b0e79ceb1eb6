"""When the prefix cache goes to disk and comes back: in the background at start, periodically, at shutdown.

Runs on the event loop. File work, hashing and framing go to worker threads
(cache_dir.py, format.py, export_plan.py, no MLX); the store is touched only on
the engine thread, through ``engine.call`` (entries.py), in short calls. Start-up
does not wait: the daemon serves at once, entries join the store as they are
read and verified (startup_load.py), and ``prefetch`` brings a prompt's own
entries in first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Sequence

import structlog

from ..engine.engine import Engine
from .cache_dir import DiskCache
from .entries import list_edges, serialize_arrays
from .export_plan import encode_entries, plan_export
from .startup_load import StartupLoad

log = structlog.get_logger("prefixd.disk_cache")

# Per serialization call on the engine thread: about 10 ms of mx.save_safetensors on a laptop
# core (many small edges cost per edge, hence export_plan.MAX_BATCH_EDGES too).
SAVE_BATCH_BYTES = 8 << 20


@dataclass(frozen=True)
class DiskCacheSettings:
    directory: Path
    max_bytes: int
    save_interval_seconds: float


class Persistence:
    def __init__(self, engine: Engine, settings: DiskCacheSettings):
        self.engine = engine
        self.settings = settings
        self.mlx_version = version("mlx")
        self.disk = DiskCache(settings.directory, settings.max_bytes, self.mlx_version)
        self.counts = {"imported": 0, "skipped": 0, "orphans": 0, "failed": 0, "written": 0, "pruned": 0}
        self._fingerprints: set[str] = set()
        self._load = StartupLoad(engine, self.disk, self._fingerprints, self.counts)
        self.loaded = self._load.over  # the start-up import is over (done, failed, or there was none)
        self._tasks: list[asyncio.Task] = []
        self._save_lock = asyncio.Lock()
        self._enabled = False

    async def start(self) -> None:
        """Take the cache dir and begin loading it; returns at once."""
        try:
            self._enabled = await asyncio.to_thread(self.disk.open)
            if self._enabled:
                # Every configured model's, loaded now or on demand later: their entries are saved and kept alike.
                self._fingerprints.update(entry.fingerprint for entry in self.engine.catalog.values())
                self._tasks = [asyncio.create_task(self._load.run()), asyncio.create_task(self._save_periodically())]
        finally:
            if not self._tasks:
                self._load.finish()  # nothing to load: a prefetch must not wait for it

    async def prefetch(self, fingerprint: str, tokens: Sequence[int]) -> None:
        """Before a request is queued: while the start-up load runs, import this prompt's entries first.

        Returns once they are in the store, at once when the load is over (or
        the disk cache is off); never raises for a bad file (startup_load.py).
        """
        await self._load.prefetch(fingerprint, tokens)

    async def stop(self) -> None:
        """Stop loading, write what changed, release the dir. Call while the engine still runs."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._load.finish()
        if self._enabled:
            try:
                await self.save()
            finally:
                self.disk.close()

    async def _save_periodically(self) -> None:
        await self.loaded.wait()  # set however the load ended, so saving goes on after a failed load
        while True:
            await asyncio.sleep(self.settings.save_interval_seconds)
            try:
                await self.save()
            except Exception as exc:  # a full disk (or anything else) must not take the daemon down
                log.warning("disk_cache_save_failed", error=f"{type(exc).__name__}: {exc}")

    async def save(self) -> None:
        """Write the entries not on disk yet; once loading went through, delete the ones no longer kept.

        The engine thread does two short kinds of calls: one listing of the
        store's edges, and one serialization per batch of new edges (at most
        SAVE_BATCH_BYTES each). Ids, the choice, checksums and writes run on workers.
        """
        async with self._save_lock:
            started, written = time.monotonic(), 0
            room = await asyncio.to_thread(self.disk.room_for_loaded_models, self._fingerprints)
            fingerprints = sorted(self._fingerprints)
            listing = await self.engine.call(lambda: list_edges(self.engine.store, fingerprints))
            plan = await asyncio.to_thread(plan_export, listing, set(self.disk.on_disk), room)
            del listing  # hold on to new edges' payloads only, not every edge's
            for batch in plan.batches(SAVE_BATCH_BYTES):
                payloads = await self.engine.call(lambda batch=batch: serialize_arrays([e.stored for e in batch]))
                encoded = await asyncio.to_thread(encode_entries, batch, payloads, self.mlx_version)
                del payloads
                await asyncio.to_thread(self.disk.write, encoded)
                written += len(encoded)
            plan.new.clear()
            pruned = 0
            if self._load.complete:  # before that, files not yet imported would look unwanted
                pruned = await asyncio.to_thread(self.disk.prune, plan.live)
            self.counts["written"] += written
            self.counts["pruned"] += pruned
            if written or pruned:
                log.info(
                    "disk_cache_saved",
                    written=written,
                    pruned=pruned,
                    kept=len(plan.live),
                    save_s=round(time.monotonic() - started, 3),
                )
