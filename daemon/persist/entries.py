"""Prefix-store edges to disk entries and back. Engine thread only: every function makes MLX calls.

``export_entries`` walks the store's edges and encodes those worth keeping
that are not on disk yet; ``import_entries`` puts verified entries back into
the store, parents first, as ``DiskKVSegment``s, so a reply can say its
prefix came from disk. The files themselves are cache_dir.py's and format.py's.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator

import mlx.core as mx

from ..cache import PrefixStore, StoredEdge
from ..kv.layout import CacheLayout
from ..kv.segments import KVSegment, StateSnapshot
from .format import EntryHeader, encode_entry, entry_id, token_bytes, token_digest

_HEADER_OVERHEAD = 1024  # per file, for the budget: magic, JSON, safetensors header


class DiskKVSegment(KVSegment):
    """Attention KV that an earlier run of the daemon computed and saved."""

    __slots__ = ()
    source = "disk"

    def split(self, n: int) -> tuple[DiskKVSegment, DiskKVSegment]:
        head, tail = super().split(n)
        return DiskKVSegment(head.keys, head.values, head.num_tokens), DiskKVSegment(tail.keys, tail.values, tail.num_tokens)


# -- export ------------------------------------------------------------------------------------------


@dataclass
class _Edge:
    fingerprint: str
    stored: StoredEdge
    ident: str
    parent: str | None  # None: hangs off the root
    start_sha: str


@dataclass
class ExportBatch:
    live: set[str]  # ids of every entry that should be on disk now
    encoded: list[tuple[str, str, bytes]]  # (id, fingerprint, file bytes) of entries not on disk yet
    complete: bool  # False: more new entries remain; call again


def export_entries(store: PrefixStore, fingerprints: Collection[str], on_disk: Collection[str], max_bytes: int,
                   max_batch_bytes: int, mlx_version: str) -> ExportBatch:
    """Choose the edges to keep within ``max_bytes`` and encode up to ``max_batch_bytes`` of the new ones.

    An edge is useful only with all its ancestors, so the choice runs from the
    most recently used (ancestors are touched whenever a descendant is) and
    skips an edge whose parent was not chosen.
    """
    edges = [edge for fingerprint in fingerprints for edge in _walk(store, fingerprint)]
    edges.sort(key=lambda e: (-e.stored.last_access, e.stored.depth))
    live: set[str] = set()
    total = 0
    for edge in edges:
        size = edge.stored.nbytes + _HEADER_OVERHEAD
        if (edge.parent is None or edge.parent in live) and total + size <= max_bytes:
            live.add(edge.ident)
            total += size
    encoded, batch_bytes, complete = [], 0, True
    for edge in edges:
        if edge.ident not in live or edge.ident in on_disk:
            continue
        if batch_bytes >= max_batch_bytes:
            complete = False
            break
        data = _encode(edge, mlx_version)
        encoded.append((edge.ident, edge.fingerprint, data))
        batch_bytes += len(data)
    return ExportBatch(live, encoded, complete)


def _walk(store: PrefixStore, fingerprint: str) -> Iterator[_Edge]:
    """The namespace's edges with their entry ids (the store hands out parents first)."""
    digests: dict[int, Any] = {}  # edge_id -> running digest of the tokens up to the edge's end
    idents: dict[int, str] = {}
    for stored in store.edges(fingerprint):
        start_digest = digests[stored.parent_id] if stored.parent_id is not None else token_digest(())
        digest = start_digest.copy()
        digest.update(token_bytes(stored.key))
        ident = entry_id(fingerprint, digest.hexdigest(), stored.start_depth, stored.kind, stored.snapshot is not None)
        digests[stored.edge_id], idents[stored.edge_id] = digest, ident
        parent = idents[stored.parent_id] if stored.parent_id is not None else None
        yield _Edge(fingerprint, stored, ident, parent, start_digest.hexdigest())


def _encode(edge: _Edge, mlx_version: str) -> bytes:
    node = edge.stored
    arrays = {}
    for index, (keys, values) in enumerate(zip(node.segment.keys, node.segment.values)):
        arrays[f"k{index}"], arrays[f"v{index}"] = keys, values
    present = None
    if node.snapshot is not None:
        present = []
        for layer, states in enumerate(node.snapshot.states):
            present.append([state is not None for state in states])
            arrays.update({f"s{layer}.{j}": state for j, state in enumerate(states) if state is not None})
    buffer = io.BytesIO()
    mx.save_safetensors(buffer, arrays)
    header = EntryHeader(fingerprint=edge.fingerprint, mlx=mlx_version, start=node.start_depth, start_sha=edge.start_sha,
                         key=list(node.key), kind=node.kind, snapshot=present, nbytes=node.nbytes)
    return encode_entry(header, buffer.getvalue())


# -- import ------------------------------------------------------------------------------------------


class _NamedBytes(io.BytesIO):
    name = "entry.safetensors"  # mx.load picks the format by the name


@dataclass
class ImportResult:
    num_imported: int = 0
    num_orphans: int = 0  # their parent was not imported (skipped, missing or over budget)
    budget_full: bool = False
    bad: list[tuple[Any, str]] = field(default_factory=list)  # (path, reason)


def import_entries(store: PrefixStore, layouts: dict[str, CacheLayout], entries: list[tuple[EntryHeader, bytes]],
                   known: dict[tuple[str, int, str], tuple[int, ...]]) -> ImportResult:
    """Insert verified entries (parents first) into the store without evicting anything.

    ``layouts`` maps a loaded model's fingerprint to its CacheLayout; ``known``
    maps (fingerprint, depth, digest of the tokens) to the tokens imported so
    far, and grows: pass the same dict to every batch.
    """
    result = ImportResult()
    for header, payload in entries:
        fingerprint = header.fingerprint
        known.setdefault((fingerprint, 0, token_digest(()).hexdigest()), ())
        prefix = known.get((fingerprint, header.start, header.start_sha))
        if prefix is None or fingerprint not in layouts:
            result.num_orphans += 1
            continue
        if store.free_bytes < header.nbytes:
            result.budget_full = True  # the memory budget is full: the rest stays on disk
            break
        try:
            segment, snapshot = _decode(header, payload, layouts[fingerprint])
        except ValueError as exc:
            result.bad.append((header.path, str(exc)))
            continue
        tokens = prefix + tuple(header.key)
        checkpoints = {header.depth: (header.kind, snapshot)} if header.kind else {}
        store.insert(fingerprint, tokens, header.start, segment, checkpoints)
        known[(fingerprint, header.depth, token_digest(tokens).hexdigest())] = tokens
        result.num_imported += 1
    return result


def _decode(header: EntryHeader, payload: bytes, layout: CacheLayout) -> tuple[DiskKVSegment, StateSnapshot | None]:
    try:
        arrays = mx.load(_NamedBytes(payload))
        mx.eval(arrays)
    except Exception as exc:  # mlx raises RuntimeError/ValueError on a bad safetensors blob
        raise ValueError(f"unreadable payload ({exc})") from None
    num_layers = len(layout.attention_layers)
    keys = [arrays.get(f"k{i}") for i in range(num_layers)]
    values = [arrays.get(f"v{i}") for i in range(num_layers)]
    if any(a is None or a.ndim != 4 or a.shape[2] != len(header.key) for a in keys + values):
        raise ValueError(f"attention arrays do not fit this model ({num_layers} layers, {len(header.key)} tokens)")
    snapshot = None
    if header.snapshot is not None:
        if len(header.snapshot) != len(layout.state_layers):
            raise ValueError(f"state snapshot has {len(header.snapshot)} layers, the model {len(layout.state_layers)}")
        states = [[arrays.get(f"s{layer}.{j}") if present else None for j, present in enumerate(flags)]
                  for layer, flags in enumerate(header.snapshot)]
        if any(state is None and present for layer, flags in zip(states, header.snapshot) for state, present in zip(layer, flags)):
            raise ValueError("state snapshot arrays are missing")
        snapshot = StateSnapshot(states)
    segment = DiskKVSegment(keys, values, len(header.key))
    if segment.nbytes + (snapshot.nbytes if snapshot else 0) != header.nbytes:
        raise ValueError("array sizes disagree with the header")
    return segment, snapshot
