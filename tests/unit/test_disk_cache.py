"""The prefix cache on disk: round trips, incremental saves, budgets, and bad files (no model needed)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest
from structlog.testing import capture_logs

from prefixd.daemon.persist.cache_dir import DiskCache
from prefixd.daemon.persist.disk_index import DiskIndex
from prefixd.daemon.persist.format import MAGIC, BadEntry, encode_entry, read_header, read_payload
from prefixd.daemon.persist.entries import DiskKVSegment, ImportState, import_entries, list_edges, serialize_arrays
from prefixd.daemon.persist.export_plan import encode_entries, plan_export
from prefixd.daemon.kv.layout import CacheLayout
from prefixd.daemon.kv.segments import KVSegment, StateSnapshot, segments_source
from prefixd.daemon.cache import PrefixStore

FP = "f00dfacef00dface"
MLX = "0.0-test"
LLAMA = CacheLayout(attention_layers=(0, 1), state_layers=(), other_layers=())
HYBRID = CacheLayout(attention_layers=(1,), state_layers=(0, 2), other_layers=())


def segment(tokens, layers: int = 2) -> KVSegment:
    """KV whose values encode the token ids, so a wrong reassembly shows."""
    base = mx.array(list(tokens), dtype=mx.float32).reshape(1, 1, -1, 1)
    keys = [mx.broadcast_to(base + layer, (1, 2, len(tokens), 4)) * 1.0 for layer in range(layers)]
    values = [k * 2.0 for k in keys]
    mx.eval(keys, values)
    return KVSegment(keys, values, len(tokens))


def snapshot(tag: float) -> StateSnapshot:
    return StateSnapshot([[mx.full((1, 3), tag), None], [mx.full((2, 2), tag + 1), mx.full((1,), tag + 2)]])


def make_store(max_bytes: int = 1 << 30) -> PrefixStore:
    return PrefixStore(max_bytes=max_bytes, max_nodes=10_000, max_pinned_bytes=max_bytes // 4)


SYSTEM = list(range(1, 41))
CHAT_A = SYSTEM + list(range(100, 130))
CHAT_B = SYSTEM[:25] + list(range(200, 220))  # splits the system prompt's edge


@dataclass
class Saved:
    live: set[str]
    encoded: list[tuple[str, str, bytes]]


def save(store: PrefixStore, disk: DiskCache, max_bytes: int = 1 << 30) -> Saved:
    """What Persistence.save does, on one thread: list, plan, serialize, frame, write."""
    plan = plan_export(list_edges(store, [FP]), set(disk.on_disk), max_bytes)
    encoded = encode_entries(plan.new, serialize_arrays([edge.stored for edge in plan.new]), MLX)
    disk.write(encoded)
    return Saved(plan.live, encoded)


def load(disk: DiskCache, store: PrefixStore, layout=LLAMA):
    scan = disk.scan({FP})
    entries = []
    for header in scan.headers:
        try:
            entries.append((header, read_payload(header)))
        except BadEntry as exc:
            disk.report_bad(header.path, str(exc))
    return scan, import_entries(store, {FP: layout}, entries, ImportState())


@pytest.fixture
def disk(tmp_path) -> DiskCache:
    cache = DiskCache(tmp_path / "kv", max_bytes=1 << 30, mlx_version=MLX)
    assert cache.open()
    yield cache
    cache.close()


def kv_of(match) -> mx.array:
    return mx.concatenate([s.keys[1] for s in match.segments], axis=2)


def test_a_restart_finds_the_same_prefixes_bit_for_bit(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {40: ("message", None), 70: ("prompt-end", None)})
    store.insert(FP, CHAT_B, 25, segment(CHAT_B[25:]), {})
    before = {tuple(t): kv_of(store.match(FP, t, max_length=len(t))) for t in (CHAT_A, CHAT_B)}
    batch = save(store, disk)
    assert len(batch.encoded) == 4 and batch.live == set(disk.on_disk)

    restarted = make_store()
    scan, result = load(DiskCache(disk.root, 1 << 30, MLX), restarted)
    assert result.num_imported == 4 and result.num_orphans == 0 and not result.bad
    restarted.check_integrity()
    for tokens, kv in before.items():
        match = restarted.match(FP, tokens, max_length=len(tokens))
        assert match.length == len(tokens)
        assert mx.array_equal(kv_of(match), kv).item()
        assert segments_source(match.segments) == "disk"
    assert restarted.match(FP, CHAT_A).checkpoint_kind in ("prompt-end", "prefix")
    assert restarted.match(FP, CHAT_A[:41], max_length=40).checkpoint_kind == "message"
    fresh = make_store()
    fresh.insert(FP, CHAT_A, 0, segment(CHAT_A), {})
    assert segments_source(fresh.match(FP, CHAT_A).segments) == "memory"


def test_hybrid_snapshots_come_back(disk):
    store = make_store()
    tokens = list(range(1, 33))
    store.insert(FP, tokens, 0, segment(tokens, layers=1), {16: ("chunk", snapshot(1.0)), 32: ("prompt-end", snapshot(5.0))})
    save(store, disk)
    restarted = make_store()
    _, result = load(disk, restarted, layout=HYBRID)
    assert result.num_imported == 2
    match = restarted.match(FP, tokens + [99], requires_snapshot=True)
    assert match.length == 32 and match.checkpoint_kind == "prompt-end"
    states = match.snapshot.states
    assert states[0][1] is None and mx.array_equal(states[1][1], mx.full((1,), 7.0)).item()
    assert restarted.match(FP, tokens[:20], requires_snapshot=True).length == 16


def test_saves_write_only_what_changed_and_prune_what_left(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {40: ("message", None)})
    first = save(store, disk)
    assert len(first.encoded) == 2
    assert save(store, disk).encoded == []  # nothing new
    store.insert(FP, CHAT_B, 25, segment(CHAT_B[25:]), {})  # splits the first edge at 25
    second = save(store, disk)
    # New: the two halves of the split edge and the new branch; the chat's tail is unchanged.
    assert len(second.encoded) == 3
    tail_id = next(i for i in first.live if i in second.live)
    assert disk.prune(second.live) == 1  # the edge that was split
    assert set(disk.on_disk) == second.live and tail_id in disk.on_disk
    assert len(list((disk.root / FP).glob("*.kv"))) == 4


def test_the_disk_budget_keeps_the_most_recent_prefixes_with_their_ancestors(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {40: ("message", None)})
    one_edge = next(iter(store._namespaces[FP].root.children.values())).nbytes
    batch = save(store, disk, max_bytes=one_edge + 2048)
    assert len(batch.live) == 1  # the root-side edge: the chat's tail is useless without it
    restarted = make_store()
    load(disk, restarted)
    assert restarted.match(FP, CHAT_A).length == 40


def test_import_never_evicts_what_is_in_memory(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {40: ("message", None)})
    save(store, disk)
    small = make_store(max_bytes=segment(CHAT_A).nbytes // 2)
    mine = list(range(500, 510))
    small.insert(FP, mine, 0, segment(mine), {})
    _, result = load(disk, small)
    assert result.budget_full and result.num_imported == 0
    assert small.match(FP, mine + [1]).length == len(mine)


def corrupt_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite_header(path: Path, change) -> None:
    """Edit a file's JSON header in place (a valid header, but not the one that was written)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    header = json.loads(data[start:start + length])
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + data[start + length:])


def change_a_token(path: Path) -> None:
    rewrite_header(path, lambda header: header["key"].__setitem__(0, header["key"][0] + 1))


def restamp_mlx(path: Path) -> None:
    rewrite_header(path, lambda header: header.update(mlx="9.9-xxx"))


def restamp_format(path: Path) -> None:
    rewrite_header(path, lambda header: header.update(format=99))


@pytest.mark.parametrize("damage, reason", [
    (corrupt_payload, "checksum mismatch"),
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "checksum mismatch"),
    (lambda p: p.write_bytes(p.read_bytes()[:9]), "bad magic or truncated"),
    (lambda p: p.write_bytes(b"hello"), "bad magic or truncated"),
    (change_a_token, "checksum mismatch"),
    (restamp_mlx, "written by mlx 9.9-xxx"),
    (restamp_format, "format version 99"),
])
def test_a_bad_file_is_a_miss_and_one_log_line(disk, damage, reason):
    store = make_store()
    tokens = list(range(1, 21))
    store.insert(FP, tokens, 0, segment(tokens), {})
    (ident,) = save(store, disk).live
    damage(disk.on_disk[ident])
    restarted = make_store()
    with capture_logs() as logs:
        _, result = load(DiskCache(disk.root, 1 << 30, MLX), restarted)
    assert result.num_imported == 0
    assert restarted.match(FP, tokens).length == 0
    skipped = [entry for entry in logs if entry["event"] == "disk_cache_entry_skipped"]
    assert len(skipped) == 1 and reason in skipped[0]["reason"], logs


def test_files_of_another_model_or_a_killed_save_are_not_read(disk):
    store = make_store()
    tokens = list(range(1, 21))
    store.insert(FP, tokens, 0, segment(tokens), {})
    (ident,) = save(store, disk).live
    other = disk.root / "0123456789abcdef"
    other.mkdir()
    disk.on_disk[ident].rename(other / f"{ident}.kv")  # filed under another model
    (disk.root / FP / ".tmp-deadbeef").write_bytes(b"half a file")  # a save killed midway
    reader = DiskCache(disk.root, 1 << 30, MLX)
    with capture_logs() as logs:
        assert reader.scan({FP}).headers == []
        assert reader.scan({"0123456789abcdef"}).headers == []
        reader.scan({"0123456789abcdef"})
    assert not (disk.root / FP / ".tmp-deadbeef").exists()
    assert [e["reason"] for e in logs if e["event"] == "disk_cache_entry_skipped"] == [
        f"written for model {FP}, filed under 0123456789abcdef"]


def test_an_orphan_is_skipped(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {40: ("message", None)})
    save(store, disk)
    root_edge = min(disk.scan({FP}).headers, key=lambda h: h.start)
    root_edge.path.unlink()
    restarted = make_store()
    _, result = load(DiskCache(disk.root, 1 << 30, MLX), restarted)
    assert result.num_imported == 0 and result.num_orphans == 1


def test_one_daemon_per_cache_dir(disk):
    second = DiskCache(disk.root, 1 << 30, MLX)
    assert second.open() is False
    disk.close()
    assert second.open() is True
    second.close()


def test_split_disk_segments_stay_disk_segments():
    tokens = list(range(10))
    base = segment(tokens)
    disk_segment = DiskKVSegment(base.keys, base.values, base.num_tokens)
    head, tail = disk_segment.split(4)
    assert isinstance(head, DiskKVSegment) and isinstance(tail, DiskKVSegment)
    assert head.nbytes + tail.nbytes == disk_segment.nbytes


def test_a_header_with_fields_of_the_wrong_type_is_a_bad_entry(disk):
    store = make_store()
    tokens = list(range(1, 21))
    store.insert(FP, tokens, 0, segment(tokens), {})
    (ident,) = save(store, disk).live
    path = disk.on_disk[ident]
    header = read_header(path)
    payload = read_payload(header)
    header.key = [1, -2, 3]  # no u32 token id; the checksum is recomputed, so only the check can tell
    path.write_bytes(encode_entry(header, payload))
    with capture_logs() as logs:
        assert DiskCache(disk.root, 1 << 30, MLX).scan({FP}).headers == []
    assert [e["reason"] for e in logs if e["event"] == "disk_cache_entry_skipped"] == ["header fields of the wrong type"]


def test_an_entry_is_imported_once_whichever_batch_brings_it(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {40: ("message", None)})
    save(store, disk)
    headers = disk.scan({FP}).headers
    entries = [(header, read_payload(header)) for header in headers]
    restarted, state = make_store(), ImportState()
    first = import_entries(restarted, {FP: LLAMA}, entries, state)  # say, a prefetch
    again = import_entries(restarted, {FP: LLAMA}, entries, state)  # the background load's batch
    assert first.num_imported == 2 and first.imported == [h.path for h in headers]
    assert again.num_imported == 0 and again.num_orphans == 0 and not again.bad
    assert restarted.stats().total.num_nodes == 2


def headers_of(disk: DiskCache) -> dict[tuple[int, int], object]:
    return {(h.start, h.depth): h for h in disk.scan({FP}).headers}


def test_the_index_walks_a_prompt_down_the_entries_it_starts_with(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {40: ("message", None), 70: ("prompt-end", None)})
    store.insert(FP, CHAT_B, 25, segment(CHAT_B[25:]), {})
    save(store, disk)
    by_span = headers_of(disk)
    index = DiskIndex(by_span.values())
    spans = lambda found: [(h.start, h.depth) for h in found]  # noqa: E731
    assert spans(index.along(FP, CHAT_A + [5, 6], partial_edges=True)) == [(0, 25), (25, 40), (40, 70)]
    assert spans(index.along(FP, CHAT_B, partial_edges=True)) == [(0, 25), (25, 45)]
    # A prompt that leaves an edge midway: attention models can use its head, hybrid ones cannot.
    left_midway = CHAT_A[:55] + [999]
    assert spans(index.along(FP, left_midway, partial_edges=True)) == [(0, 25), (25, 40), (40, 70)]
    assert spans(index.along(FP, left_midway, partial_edges=False)) == []  # no snapshot anywhere
    assert index.along(FP, [999] + CHAT_A, partial_edges=True) == []
    assert index.along("another-model", CHAT_A, partial_edges=True) == []


def test_the_index_follows_a_stale_unsplit_file_beside_its_split_halves(disk):
    store = make_store()
    store.insert(FP, CHAT_A, 0, segment(CHAT_A), {70: ("prompt-end", None)})
    save(store, disk)  # one edge, 0..70
    store.insert(FP, CHAT_B, 25, segment(CHAT_B[25:]), {})
    save(store, disk)  # its halves 0..25, 25..70 and the branch; the old file stays (no prune: a kill -9)
    index = DiskIndex(headers_of(disk).values())
    found = [(h.start, h.depth) for h in index.along(FP, CHAT_A + [1], partial_edges=True)]
    assert sorted(found) == [(0, 25), (0, 70), (25, 70)]


def test_for_a_hybrid_model_the_walk_ends_at_the_last_snapshot(disk):
    store = make_store()
    tokens = list(range(1, 49))
    store.insert(FP, tokens, 0, segment(tokens, layers=1), {16: ("chunk", snapshot(1.0)), 32: ("chunk", None),
                                                               48: ("prompt-end", None)})
    save(store, disk)
    index = DiskIndex(headers_of(disk).values())
    assert [(h.start, h.depth) for h in index.along(FP, tokens + [1], partial_edges=False)] == [(0, 16)]
    assert len(index.along(FP, tokens + [1], partial_edges=True)) == 3
