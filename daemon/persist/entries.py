"""Prefix-store edges to disk entries and back: the part that must run on the engine thread.

Only what has to be here is here, because the engine thread is also the one
that decodes: ``list_edges`` (the store is the engine thread's), ``serialize_arrays``
(MLX arrays to safetensors bytes) and ``import_entries`` (bytes back into MLX
arrays and the store, as ``DiskKVSegment``s, so a reply can say its prefix came
from disk). Entry ids, digests, what to keep, checksums and framing are
export_plan.py's, on worker threads; the files are cache_dir.py's and format.py's.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

import mlx.core as mx

from ..cache import PrefixStore, StoredEdge
from ..kv.layout import CacheLayout
from ..kv.segments import KVSegment, StateSnapshot
from .format import EntryHeader, token_digest


class DiskKVSegment(KVSegment):
    """Attention KV that an earlier run of the daemon computed and saved."""

    __slots__ = ()
    source = "disk"

    def split(self, n: int) -> tuple[DiskKVSegment, DiskKVSegment]:
        head, tail = super().split(n)
        return DiskKVSegment(head.keys, head.values, head.num_tokens, head.bits), DiskKVSegment(
            tail.keys, tail.values, tail.num_tokens, tail.bits
        )


# -- export ------------------------------------------------------------------------------------------


def list_edges(store: PrefixStore, fingerprints: Collection[str]) -> dict[str, list[StoredEdge]]:
    """Every edge of these models' trees, parents first, as plain data.

    One walk in one call, so the listing is one consistent tree: a walk
    spread over several calls could see an edge split between them. The
    payloads are references to the store's own immutable objects (a split
    copies, see KVSegment.split), so they stay valid after the call.
    """
    return {fingerprint: list(store.edges(fingerprint)) for fingerprint in fingerprints}


def serialize_arrays(edges: list[StoredEdge]) -> list[bytes]:
    """Each edge's arrays as one safetensors blob: k{i}, v{i} per attention layer, s{layer}.{j} per state.

    A --kv-bits segment's layers are packed: k{i} holds the codes, k{i}.scales
    and k{i}.biases the rest (v{i} likewise). The header that goes with it
    (which states are present, the bits) is export_plan's, from the same edge.
    """
    blobs = []
    for edge in edges:
        arrays = {}
        for index, (keys, values) in enumerate(zip(edge.segment.keys, edge.segment.values)):
            arrays.update(_layer_arrays(f"k{index}", keys))
            arrays.update(_layer_arrays(f"v{index}", values))
        if edge.snapshot is not None:
            for layer, states in enumerate(edge.snapshot.states):
                arrays.update({f"s{layer}.{j}": state for j, state in enumerate(states) if state is not None})
        buffer = io.BytesIO()
        mx.save_safetensors(buffer, arrays)
        blobs.append(buffer.getvalue())
    return blobs


_PACKED_NAMES = ("", ".scales", ".biases")  # a packed layer's arrays, in mx.quantize's order


def _layer_arrays(name: str, layer: Any) -> dict[str, mx.array]:
    if isinstance(layer, tuple):
        return {name + suffix: array for suffix, array in zip(_PACKED_NAMES, layer)}
    return {name: layer}


# -- import ------------------------------------------------------------------------------------------


class _NamedBytes(io.BytesIO):
    name = "entry.safetensors"  # mx.load picks the format by the name


@dataclass
class ImportState:
    """What the imports of one start-up load have done so far; every import call of that load shares it.

    Read and written on the engine thread only, inside import_entries: the
    background load and prefetches call it in any order, and since these calls
    run one after another there, an entry is never imported twice.
    """

    known: dict[tuple[str, int, str], tuple[int, ...]] = field(default_factory=dict)  # node -> its tokens
    tried: set[Path] = field(default_factory=set)  # entries imported, found bad or failed: not tried again


@dataclass
class ImportResult:
    num_imported: int = 0
    num_orphans: int = 0  # their parent was not imported (skipped, missing or over budget)
    budget_full: bool = False
    imported: list[Path] = field(default_factory=list)
    bad: list[tuple[Any, str]] = field(default_factory=list)  # (path, reason): the file is unusable
    failed: list[tuple[Any, str]] = field(default_factory=list)  # (path, error): importing it raised


def import_entries(
    store: PrefixStore, layouts: dict[str, CacheLayout], entries: list[tuple[EntryHeader, bytes]], state: ImportState
) -> ImportResult:
    """Insert verified entries (parents first) into the store without evicting anything.

    ``layouts`` maps a loaded model's fingerprint to its CacheLayout. An entry
    whose parent is not in ``state.known`` yet is an orphan; one already in
    ``state.tried`` is passed over without a word. An entry that raises is
    recorded in ``failed`` and the batch goes on: one unexpected entry must
    not cost the rest of the cache.
    """
    result = ImportResult()
    known = state.known
    for header, payload in entries:
        if header.path in state.tried:
            continue
        fingerprint = header.fingerprint
        known.setdefault((fingerprint, 0, token_digest(()).hexdigest()), ())
        prefix = known.get((fingerprint, header.start, header.start_sha))
        if prefix is None or fingerprint not in layouts:
            result.num_orphans += 1
            continue
        if store.free_bytes < header.nbytes:
            result.budget_full = True  # the memory budget is full: the rest stays on disk
            break
        state.tried.add(header.path)
        try:
            segment, snapshot = _decode(header, payload, layouts[fingerprint])
        except ValueError as exc:
            result.bad.append((header.path, str(exc)))
            continue
        except Exception as exc:
            result.failed.append((header.path, f"{type(exc).__name__}: {exc}"))
            continue
        try:  # the store may refuse what the file holds (say, a checkpoint kind a newer prefixd wrote)
            tokens = prefix + tuple(header.key)
            checkpoints = {header.depth: (header.kind, snapshot)} if header.kind else {}
            store.insert(fingerprint, tokens, header.start, segment, checkpoints)
            known[(fingerprint, header.depth, token_digest(tokens).hexdigest())] = tokens
        except Exception as exc:
            result.failed.append((header.path, f"{type(exc).__name__}: {exc}"))
            continue
        result.num_imported += 1
        result.imported.append(header.path)
    return result


def _decode(header: EntryHeader, payload: bytes, layout: CacheLayout) -> tuple[DiskKVSegment, StateSnapshot | None]:
    try:
        arrays = mx.load(_NamedBytes(payload))
        mx.eval(arrays)
    except Exception as exc:  # mlx raises RuntimeError/ValueError on a bad safetensors blob
        raise ValueError(f"unreadable payload ({exc})") from None
    if header.kv_bits != layout.kv_bits:  # the fingerprint differs too (-q8): only a file moved by hand gets here
        raise ValueError(
            f"written at --kv-bits {header.kv_bits or 'off'}, this model runs at --kv-bits {layout.kv_bits or 'off'}"
        )
    num_layers = len(layout.attention_layers)
    suffixes = _PACKED_NAMES if layout.kv_bits else ("",)
    keys = [tuple(arrays.get(f"k{i}{suffix}") for suffix in suffixes) for i in range(num_layers)]
    values = [tuple(arrays.get(f"v{i}{suffix}") for suffix in suffixes) for i in range(num_layers)]
    if any(a is None or a.ndim != 4 or a.shape[2] != len(header.key) for layer in keys + values for a in layer):
        raise ValueError(f"attention arrays do not fit this model ({num_layers} layers, {len(header.key)} tokens)")
    if not layout.kv_bits:
        keys, values = [layer[0] for layer in keys], [layer[0] for layer in values]
    snapshot = None
    if header.snapshot is not None:
        if len(header.snapshot) != len(layout.state_layers):
            raise ValueError(f"state snapshot has {len(header.snapshot)} layers, the model {len(layout.state_layers)}")
        states = [
            [arrays.get(f"s{layer}.{j}") if present else None for j, present in enumerate(flags)]
            for layer, flags in enumerate(header.snapshot)
        ]
        if any(
            state is None and present
            for layer, flags in zip(states, header.snapshot)
            for state, present in zip(layer, flags)
        ):
            raise ValueError("state snapshot arrays are missing")
        snapshot = StateSnapshot(states)
    segment = DiskKVSegment(keys, values, len(header.key), layout.kv_bits)
    if segment.nbytes + (snapshot.nbytes if snapshot else 0) != header.nbytes:
        raise ValueError("array sizes disagree with the header")
    return segment, snapshot
