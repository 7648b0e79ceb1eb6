"""The disk cache's directory: ``<cache_dir>/<model fingerprint>/<entry id>.kv``.

Saving only writes entries not yet on disk (write, fsync, rename) and deletes
the ones no longer wanted afterwards, so a ``kill -9`` mid-save leaves the
previous files readable. One daemon at a time holds the directory (a lock
file). Pure I/O: no MLX here (entries.py converts on the engine thread), so
this runs on worker threads. A bad file is logged once and skipped. The file
format is format.py's. A model served at another --kv-bits has another
fingerprint (``<digest>-q8``, ``-q4``, or the bare digest at full precision),
so its entries live in another folder: kept for a switch back, never loaded
into this setting's store, and logged at start (disk_cache_other_kv_bits).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from .format import SUFFIX, BadEntry, EntryHeader, read_header

log = structlog.get_logger("prefixd.disk_cache")
RESPONSES_FOLDER = "responses"  # the HTTP front's stored Responses-API conversations (front/response_store.py)
NOT_MODEL_FOLDERS = frozenset({RESPONSES_FOLDER})  # beside the models' folders, never dropped for their room
KV_BITS_SUFFIXES = ("", "-q8", "-q4")  # a fingerprint's --kv-bits suffix (models/loaded_model.kv_bits_suffix)


def default_cache_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "prefixd" / "kv"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixd" / "kv"


@dataclass
class ScanResult:
    headers: list[EntryHeader]  # usable, parents before children
    num_skipped: int


class DiskCache:
    """The cache directory: scan, read, write, prune; one daemon at a time (a lock file)."""

    def __init__(self, root: Path, max_bytes: int, mlx_version: str):
        self.root = root
        self.max_bytes = max_bytes
        self.mlx_version = mlx_version
        self.on_disk: dict[str, Path] = {}  # entry id -> file, for the loaded models' entries
        self._lock_handle: Any = None
        self._reported: set[Path] = set()

    def open(self) -> bool:
        """Create the directory and take its lock; False (logged) if another daemon holds it."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle = open(self.root / ".lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            log.warning(
                "disk_cache_busy", dir=str(self.root), action="another prefixd uses this cache dir: not persisting"
            )
            return False
        self._lock_handle = handle
        return True

    def close(self) -> None:
        if self._lock_handle is not None:
            self._lock_handle.close()
            self._lock_handle = None

    def scan(self, fingerprints: set[str]) -> ScanResult:
        """Headers of the usable entries of these models; bad files are logged once and skipped."""
        headers, num_skipped = [], 0
        for fingerprint in sorted(fingerprints):
            self._note_other_kv_bits(fingerprint, fingerprints)
            folder = self.root / fingerprint
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name.startswith(".tmp-"):
                    path.unlink(missing_ok=True)  # a save that was killed midway
                    continue
                if path.suffix != SUFFIX:
                    continue
                try:
                    header = read_header(path)
                    self._check_identity(header, fingerprint)
                except (BadEntry, OSError) as exc:
                    self.report_bad(path, str(exc))
                    num_skipped += 1
                    continue
                headers.append(header)
                self.on_disk[path.stem] = path
        headers.sort(key=lambda h: (h.fingerprint, h.start, h.depth))
        return ScanResult(headers, num_skipped)

    def _note_other_kv_bits(self, fingerprint: str, fingerprints: set[str]) -> None:
        """Log the folders of this model's entries at another --kv-bits: they are not this run's cache."""
        digest, _, suffix = fingerprint.partition("-")
        for other_suffix in KV_BITS_SUFFIXES:
            other = digest + other_suffix
            if other_suffix != (suffix and "-" + suffix) and other not in fingerprints and (self.root / other).is_dir():
                log.info(
                    "disk_cache_other_kv_bits",
                    dir=str(self.root / other),
                    written_at=other_suffix.lstrip("-") or "full precision",
                    this_run=suffix or "full precision",
                    action="kept, not loaded: its entries are another --kv-bits setting's",
                )

    def _check_identity(self, header: EntryHeader, fingerprint: str) -> None:
        if header.fingerprint != fingerprint:
            raise BadEntry(f"written for model {header.fingerprint}, filed under {fingerprint}")
        if header.mlx != self.mlx_version:
            raise BadEntry(f"written by mlx {header.mlx}, this is mlx {self.mlx_version}")

    def report_bad(self, path: Path, reason: str) -> None:
        if path not in self._reported:
            self._reported.add(path)
            log.warning("disk_cache_entry_skipped", file=str(path), reason=reason)

    def write(self, entries: list[tuple[str, str, bytes]]) -> int:
        """Write encoded entries (id, fingerprint, bytes), each atomically; return the bytes written."""
        folders, written = set(), 0
        for ident, fingerprint, data in entries:
            folder = self.root / fingerprint
            folder.mkdir(exist_ok=True, mode=0o700)
            tmp, path = folder / f".tmp-{ident}", folder / f"{ident}{SUFFIX}"
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            self.on_disk[ident] = path
            folders.add(folder)
            written += len(data)
        for folder in folders:  # make the renames themselves durable
            _fsync_dir(folder)
        return written

    def prune(self, live: set[str]) -> int:
        """Delete the loaded models' entries not in ``live``, and the bad files reported; return how many."""
        stale = [ident for ident in self.on_disk if ident not in live]
        for ident in stale:
            self.on_disk.pop(ident).unlink(missing_ok=True)
        for path in self._reported:
            path.unlink(missing_ok=True)
        self._reported.clear()
        return len(stale)

    def room_for_loaded_models(self, fingerprints: set[str]) -> int:
        """Bytes the loaded models' entries may use: the budget minus other models' folders.

        Other models' folders stay (the user may switch back) until the budget
        needs their room; then the least recently written go first.
        """
        folders = []
        for folder in self.root.iterdir() if self.root.is_dir() else ():
            if folder.is_dir() and folder.name not in fingerprints and folder.name not in NOT_MODEL_FOLDERS:
                files = [f.stat() for f in folder.iterdir() if f.is_file()]
                folders.append((max((f.st_mtime for f in files), default=0.0), sum(f.st_size for f in files), folder))
        foreign = sum(size for _, size, _ in folders)
        for _, size, folder in sorted(folders):
            if foreign <= self.max_bytes // 2:
                break
            shutil.rmtree(folder, ignore_errors=True)
            log.info("disk_cache_dropped_model", dir=str(folder), bytes=size)
            foreign -= size
        return max(0, self.max_bytes - foreign)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
