"""The start-up import of the disk cache: everything in the background, one prompt's entries first on demand.

Runs on the event loop. The daemon serves while this runs, so a prompt whose
prefix is on disk but not imported yet would prefill cold; ``prefetch`` imports
the entries along that prompt out of order and returns once they are in the
store. Both paths share one ``ImportState`` (engine thread only), so nothing is
imported twice whichever gets to an entry first, and counts stay exact. Files
are read and verified on worker threads; MLX work is entries.py's, through
``engine.call``, in bounded batches.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Sequence

import structlog

from .cache_dir import DiskCache, ScanResult
from .disk_index import DiskIndex
from .entries import ImportState, import_entries
from .format import BadEntry, EntryHeader, read_payload

log = structlog.get_logger("prefixd.disk_cache")

BATCH_BYTES = 8 << 20  # per engine call (mx.load, eval, insert): tens of ms, so decoding goes on between batches


class StartupLoad:
    """Scan, then import every entry in scan order (parents first); ``prefetch`` jumps the queue."""

    def __init__(self, engine: Any, disk: DiskCache, fingerprints: set[str], counts: dict[str, int]):
        self.engine = engine
        self.disk = disk
        self.fingerprints = fingerprints
        self.counts = counts  # shared with Persistence: imported, skipped, orphans, failed
        self.over = asyncio.Event()  # set however the load ends: done, failed or cancelled
        self.complete = False  # it went through every entry: files not imported are not wanted
        self._scanned = asyncio.Event()
        self._index: DiskIndex | None = None
        self._layouts: dict[str, Any] = {}
        self._state = ImportState()  # the engine thread's: only import_entries touches it
        self._settled: set[Path] = set()  # this side's record: imported or given up on, by either path
        self._read_ahead: dict[Path, tuple[EntryHeader, bytes]] = {}  # the load's next batch: a prefetch reuses it
        self._prefetches: set[asyncio.Task] = set()  # held: a shielded import outlives a cancelled request
        self._budget_full = False

    async def run(self) -> None:
        """The background load; never raises (but for cancellation): the daemon serves either way."""
        started = time.monotonic()
        try:
            self._layouts = {entry.fingerprint: entry.layout for entry in self.engine.catalog.values()}
            scan, self._index = await asyncio.to_thread(self._scan)
            self._scanned.set()
            self.counts["skipped"] += scan.num_skipped
            await self._import_in_order(scan.headers)
            self.complete = True
        except Exception as exc:
            log.error("disk_cache_load_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
        finally:
            self.finish()
            self._read_ahead.clear()
        log.info(
            "disk_cache_loaded",
            dir=str(self.disk.root),
            imported=self.counts["imported"],
            skipped=self.counts["skipped"],
            orphans=self.counts["orphans"],
            failed=self.counts["failed"],
            load_s=round(time.monotonic() - started, 3),
        )

    def finish(self) -> None:
        """Mark the load over (also when it never ran): prefetches return at once from now on."""
        self._scanned.set()
        self.over.set()

    def _scan(self) -> tuple[ScanResult, DiskIndex]:
        scan = self.disk.scan(self.fingerprints)
        return scan, DiskIndex(scan.headers)

    async def _import_in_order(self, headers: list[EntryHeader]) -> None:
        batch_bytes = 0
        for header in headers:
            if self._budget_full:
                return  # the memory budget is full (maybe found by a prefetch): the rest stays on disk
            if header.path in self._settled:
                continue  # a prefetch got there first
            payload = await self._read(header)
            if payload is None:
                continue
            self._read_ahead[header.path] = (header, payload)
            batch_bytes += len(payload)
            if batch_bytes >= BATCH_BYTES:
                await self._import_read_ahead()
                batch_bytes = 0
        if self._read_ahead and not self._budget_full:
            await self._import_read_ahead()

    async def _import_read_ahead(self) -> None:
        await self._import(list(self._read_ahead.values()), background=True)
        self._read_ahead.clear()

    async def prefetch(self, fingerprint: str, tokens: Sequence[int]) -> None:
        """While the load runs, import the entries along this prompt first; return once they are stored.

        Returns at once when the load is over. Never raises into the caller
        (but for cancellation): a bad file is logged and skipped like in the
        load, and anything else is logged once. The import goes on if the
        request is cancelled meanwhile, so that the counts stay exact.
        """
        if self.over.is_set():
            return
        started = time.monotonic()
        try:
            await self._scanned.wait()  # the index needs the whole scan: what is on disk is known only then
            layout = self._layouts.get(fingerprint)
            if self.over.is_set() or self._index is None or layout is None:
                return
            scanned = time.monotonic()
            along = await asyncio.to_thread(self._index.along, fingerprint, tokens, not layout.is_hybrid)
            wanted = [header for header in along if header.path not in self._settled]
            if wanted:
                task = asyncio.ensure_future(self._import_chain(wanted))
                self._prefetches.add(task)
                task.add_done_callback(self._prefetches.discard)
                await asyncio.shield(task)
            log.debug(
                "disk_cache_prefetched",
                prompt_tokens=len(tokens),
                entries=len(along),
                wanted=len(wanted),
                wait_scan_s=round(scanned - started, 3),
                prefetch_s=round(time.monotonic() - started, 3),
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("disk_cache_prefetch_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)

    async def _import_chain(self, headers: list[EntryHeader]) -> None:
        """Read and import these entries (parents first) in bounded batches, in order."""
        batch: list[tuple[EntryHeader, bytes]] = []
        batch_bytes = 0
        for header in headers:
            read = self._read_ahead.get(header.path)
            payload = read[1] if read is not None else await self._read(header)
            if payload is None:
                continue  # its descendants come out as orphans, which the background load counts
            batch.append((header, payload))
            batch_bytes += len(payload)
            if batch_bytes >= BATCH_BYTES:
                if await self._import(batch, background=False):
                    return
                batch, batch_bytes = [], 0
        if batch:
            await self._import(batch, background=False)

    async def _read(self, header: EntryHeader) -> bytes | None:
        """The verified payload, or None: a bad file is reported and counted once, whoever reads it."""
        try:
            return await asyncio.to_thread(read_payload, header)
        except (BadEntry, OSError) as exc:
            self._give_up(header.path, str(exc), "skipped")
            return None

    def _give_up(self, path: Path, reason: str, count: str) -> None:
        if path in self._settled:
            return
        self._settled.add(path)
        self.counts[count] += 1
        if count == "skipped":
            self.disk.report_bad(path, reason)

    async def _import(self, batch: list[tuple[EntryHeader, bytes]], background: bool) -> bool:
        """One engine call; True when the memory budget is full. Errors are logged as one line per batch.

        Orphans are counted only by the background load: an entry that is an
        orphan for a prefetch (its parent's file was bad) reaches the load too.
        """
        try:
            result = await self.engine.call(
                lambda: import_entries(self.engine.store, self._layouts, batch, self._state)
            )
        except Exception as exc:  # the engine itself failed this call: the next batch may still go in
            log.warning(
                "disk_cache_import_failed",
                entries=len(batch),
                error=f"{type(exc).__name__}: {exc}",
                first_file=str(batch[0][0].path),
            )
            return False
        self._settled.update(result.imported)
        self.counts["imported"] += result.num_imported
        if background:
            self.counts["orphans"] += result.num_orphans
        for path, reason in result.bad:
            self._give_up(path, reason, "skipped")
        for path, error in result.failed:
            self._give_up(path, error, "failed")
        if result.failed:
            path, error = result.failed[0]
            log.warning(
                "disk_cache_import_failed",
                entries=len(batch),
                failed=len(result.failed),
                error=error,
                first_file=str(path),
            )
        if result.budget_full:
            self._budget_full = True
        return result.budget_full
