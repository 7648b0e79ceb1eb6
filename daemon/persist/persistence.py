"""When the prefix cache goes to disk and comes back: in the background at start, periodically, at shutdown.

Runs on the event loop. File work goes to worker threads (cache_dir.py and
format.py, no MLX); the store is touched only on the engine thread, through
``engine.call`` (entries.py). Start-up does not wait: the daemon serves at once and
entries join the store as they are read and verified.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
import structlog

from ..engine.engine import Engine
from .cache_dir import DiskCache
from .entries import export_entries, import_entries
from .format import BadEntry, read_payload

log = structlog.get_logger("prefixd.disk_cache")

BATCH_BYTES = 32 << 20  # per engine call: keeps the engine responsive between batches


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
        self.loaded = asyncio.Event()  # the start-up import is over
        self.counts = {"imported": 0, "skipped": 0, "orphans": 0, "written": 0, "pruned": 0}
        self._tasks: list[asyncio.Task] = []
        self._save_lock = asyncio.Lock()
        self._fingerprints: set[str] = set()
        self._enabled = False

    async def start(self) -> None:
        """Take the cache dir and begin loading it; returns at once."""
        self._enabled = await asyncio.to_thread(self.disk.open)
        if not self._enabled:
            return
        self._fingerprints = {model.fingerprint for model in self.engine.models.values()}
        self._tasks = [asyncio.create_task(self._load()), asyncio.create_task(self._save_periodically())]

    async def stop(self) -> None:
        """Stop loading, write what changed, release the dir. Call while the engine still runs."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._enabled:
            try:
                await self.save()
            finally:
                self.disk.close()

    async def _load(self) -> None:
        started = time.monotonic()
        scan = await asyncio.to_thread(self.disk.scan, self._fingerprints)
        self.counts["skipped"] += scan.num_skipped
        layouts = {model.fingerprint: model.layout for model in self.engine.models.values()}
        known: dict = {}
        batch: list = []
        batch_bytes = 0
        for header in scan.headers:
            try:
                payload = await asyncio.to_thread(read_payload, header)
            except (BadEntry, OSError) as exc:
                self.disk.report_bad(header.path, str(exc))
                self.counts["skipped"] += 1
                continue
            batch.append((header, payload))
            batch_bytes += len(payload)
            if batch_bytes >= BATCH_BYTES:
                budget_full = await self._import(layouts, batch, known)
                batch, batch_bytes = [], 0
                if budget_full:
                    break  # the memory budget is full: the rest stays on disk
        else:
            if batch:
                await self._import(layouts, batch, known)
        self.loaded.set()
        log.info("disk_cache_loaded", dir=str(self.settings.directory), imported=self.counts["imported"],
                 skipped=self.counts["skipped"], orphans=self.counts["orphans"], load_s=round(time.monotonic() - started, 3))

    async def _import(self, layouts: dict, batch: list, known: dict) -> bool:
        result = await self.engine.call(lambda: import_entries(self.engine.store, layouts, batch, known))
        for path, reason in result.bad:
            self.disk.report_bad(path, reason)
        self.counts["imported"] += result.num_imported
        self.counts["orphans"] += result.num_orphans
        self.counts["skipped"] += len(result.bad)
        return result.budget_full

    async def _save_periodically(self) -> None:
        await self.loaded.wait()
        while True:
            await asyncio.sleep(self.settings.save_interval_seconds)
            try:
                await self.save()
            except OSError as exc:  # a full disk must not take the daemon down
                log.warning("disk_cache_save_failed", error=str(exc))

    async def save(self) -> None:
        """Write the entries not on disk yet; once loading is over, delete the ones no longer kept."""
        async with self._save_lock:
            started, written = time.monotonic(), 0
            room = await asyncio.to_thread(self.disk.room_for_loaded_models, self._fingerprints)
            while True:
                on_disk = set(self.disk.on_disk)
                batch = await self.engine.call(lambda: export_entries(
                    self.engine.store, self._fingerprints, on_disk, room, BATCH_BYTES, self.mlx_version))
                written += len(batch.encoded)
                await asyncio.to_thread(self.disk.write, batch.encoded)
                if batch.complete:
                    break
            pruned = 0
            if self.loaded.is_set():  # before that, files not yet imported would look unwanted
                pruned = await asyncio.to_thread(self.disk.prune, batch.live)
            self.counts["written"] += written
            self.counts["pruned"] += pruned
            if written or pruned:
                log.info("disk_cache_saved", written=written, pruned=pruned, kept=len(batch.live),
                         save_s=round(time.monotonic() - started, 3))
