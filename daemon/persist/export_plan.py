"""What a save writes: entry ids, the choice within the disk budget, and the framed files.

Everything here is plain Python over the store's edges as ``entries.list_edges``
hands them out (no MLX, no store calls), so it runs on worker threads and the
engine thread keeps decoding meanwhile. The engine thread's part of a save is
only that listing and ``entries.serialize_arrays`` for each batch of new edges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterator

from ..cache import StoredEdge
from .format import EntryHeader, encode_entry, entry_id, token_bytes, token_digest

HEADER_OVERHEAD = 1024  # per file, for the budget: magic, JSON, safetensors header
MAX_BATCH_EDGES = 64  # per engine call, beside the bytes: each edge costs ~0.2 ms of mx.save_safetensors


@dataclass
class PlannedEdge:
    fingerprint: str
    stored: StoredEdge
    ident: str
    parent: str | None  # None: hangs off the root
    start_sha: str  # digest of the tokens before the edge


@dataclass
class ExportPlan:
    live: set[str]  # ids of every entry that should be on disk now
    new: list[PlannedEdge]  # the live edges not on disk yet, most recently used first

    def batches(self, max_bytes: int, max_edges: int = MAX_BATCH_EDGES) -> Iterator[list[PlannedEdge]]:
        """The new edges in groups of at most ``max_bytes`` (one edge may exceed it) and ``max_edges``."""
        batch, size = [], 0
        for edge in self.new:
            if batch and (size + edge.stored.nbytes > max_bytes or len(batch) >= max_edges):
                yield batch
                batch, size = [], 0
            batch.append(edge)
            size += edge.stored.nbytes
        if batch:
            yield batch


def plan_export(listing: dict[str, list[StoredEdge]], on_disk: Collection[str], max_bytes: int) -> ExportPlan:
    """Choose the edges to keep within ``max_bytes``; the new ones among them are to be written.

    An edge is useful only with all its ancestors, so the choice runs from the
    most recently used (ancestors are touched whenever a descendant is) and
    skips an edge whose parent was not chosen.
    """
    edges = [edge for fingerprint, stored in listing.items() for edge in _with_ids(fingerprint, stored)]
    edges.sort(key=lambda e: (-e.stored.last_access, e.stored.depth))
    live: set[str] = set()
    total = 0
    for edge in edges:
        size = edge.stored.nbytes + HEADER_OVERHEAD
        if (edge.parent is None or edge.parent in live) and total + size <= max_bytes:
            live.add(edge.ident)
            total += size
    return ExportPlan(live, [edge for edge in edges if edge.ident in live and edge.ident not in on_disk])


def _with_ids(fingerprint: str, edges: list[StoredEdge]) -> Iterator[PlannedEdge]:
    """The namespace's edges with their entry ids (the listing has parents first)."""
    digests: dict[int, Any] = {}  # edge_id -> running digest of the tokens up to the edge's end
    idents: dict[int, str] = {}
    root_digest = token_digest(())
    for stored in edges:
        start_digest = digests[stored.parent_id] if stored.parent_id is not None else root_digest
        digest = start_digest.copy()
        digest.update(token_bytes(stored.key))
        ident = entry_id(fingerprint, digest.hexdigest(), stored.start_depth, stored.kind, stored.snapshot is not None)
        digests[stored.edge_id], idents[stored.edge_id] = digest, ident
        parent = idents[stored.parent_id] if stored.parent_id is not None else None
        yield PlannedEdge(fingerprint, stored, ident, parent, start_digest.hexdigest())


def snapshot_flags(edge: StoredEdge) -> list[list[bool]] | None:
    """Per state layer, which arrays the snapshot holds (the header's ``snapshot``)."""
    if edge.snapshot is None:
        return None
    return [[state is not None for state in states] for states in edge.snapshot.states]


def encode_entries(edges: list[PlannedEdge], payloads: list[bytes], mlx_version: str) -> list[tuple[str, str, bytes]]:
    """Frame each serialized edge as a file (header, checksum, payload): (id, fingerprint, file bytes)."""
    encoded = []
    for edge, payload in zip(edges, payloads, strict=True):
        node = edge.stored
        header = EntryHeader(
            fingerprint=edge.fingerprint,
            mlx=mlx_version,
            start=node.start_depth,
            start_sha=edge.start_sha,
            key=list(node.key),
            kind=node.kind,
            snapshot=snapshot_flags(node),
            nbytes=node.nbytes,
            kv_bits=node.segment.bits,
        )
        encoded.append((edge.ident, edge.fingerprint, encode_entry(header, payload)))
    return encoded
