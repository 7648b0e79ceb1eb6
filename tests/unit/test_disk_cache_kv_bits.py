"""The disk cache of a ``--kv-bits`` model: it stores what the store holds, and one setting never loads another's."""

from __future__ import annotations

import json

import mlx.core as mx
from structlog.testing import capture_logs

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.kv.layout import CacheLayout
from prefixd.daemon.kv.quantized_kv import KvQuantization
from prefixd.daemon.kv.segments import KVSegment, segments_source
from prefixd.daemon.persist.cache_dir import DiskCache
from prefixd.daemon.persist.entries import ImportState, import_entries, list_edges, serialize_arrays
from prefixd.daemon.persist.export_plan import encode_entries, plan_export
from prefixd.daemon.persist.format import MAGIC, read_payload

MLX = "0.0-test"
DIGEST = "f00dfacef00dface"
Q8 = CacheLayout(attention_layers=(0, 1), state_layers=(), other_layers=(), kv_bits=8)
FULL = CacheLayout(attention_layers=(0, 1), state_layers=(), other_layers=())
TOKENS = list(range(1, 49))


def packed_segment(tokens: list[int], bits: int = 8) -> KVSegment:
    """Two layers of packed KV (head_dim 64) whose values follow the token ids."""
    quant = KvQuantization(bits)
    base = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1) * mx.linspace(-1, 1, 64)
    layers = [mx.broadcast_to(base + layer, (1, 2, len(tokens), 64)) * 1.0 for layer in range(2)]
    keys = [quant.quantize(layer) for layer in layers]
    values = [quant.quantize(layer * -0.5) for layer in layers]
    mx.eval(keys, values)
    return KVSegment(keys, values, len(tokens), bits)


def full_segment(tokens: list[int]) -> KVSegment:
    base = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1) * mx.ones((64,))
    keys = [mx.broadcast_to(base + layer, (1, 2, len(tokens), 64)) * 1.0 for layer in range(2)]
    mx.eval(keys)
    return KVSegment(keys, [k * 2.0 for k in keys], len(tokens))


def make_store() -> PrefixStore:
    return PrefixStore(max_bytes=1 << 30, max_nodes=10_000, max_pinned_bytes=1 << 28)


def save(store: PrefixStore, fingerprint: str, root) -> list[tuple[str, str, bytes]]:
    disk = DiskCache(root, 1 << 30, MLX)
    plan = plan_export(list_edges(store, [fingerprint]), set(), 1 << 30)
    encoded = encode_entries(plan.new, serialize_arrays([edge.stored for edge in plan.new]), MLX)
    disk.write(encoded)
    return encoded


def load(root, fingerprint: str, layout: CacheLayout):
    disk = DiskCache(root, 1 << 30, MLX)
    scan = disk.scan({fingerprint})
    store = make_store()
    result = import_entries(store, {fingerprint: layout}, [(h, read_payload(h)) for h in scan.headers], ImportState())
    return store, result


def flat(segments) -> list[mx.array]:
    return [array for s in segments for layer in s.keys + s.values for array in layer]


def test_packed_segments_come_back_bit_for_bit_and_count_their_packed_bytes(tmp_path):
    fingerprint = DIGEST + "-q8"
    store = make_store()
    store.insert(fingerprint, TOKENS, 0, packed_segment(TOKENS), {48: ("prompt-end", None)})
    before = store.match(fingerprint, TOKENS, max_length=48)
    save(store, fingerprint, tmp_path)

    restarted, result = load(tmp_path, fingerprint, Q8)
    assert result.num_imported == 1 and not result.bad
    match = restarted.match(fingerprint, TOKENS, max_length=48)
    assert match.length == 48 and segments_source(match.segments) == "disk"
    assert all(s.bits == 8 for s in match.segments)
    assert all(mx.array_equal(a, b).item() for a, b in zip(flat(match.segments), flat(before.segments)))
    # codes: 64 bytes per head and token at 8 bits; one float32 scale and bias per group of 64
    assert restarted.stats().total.num_bytes == 2 * 2 * 2 * 48 * (64 + 8)
    head, tail = match.segments[0].split(20)  # a disk segment split stays packed, from disk
    assert (head.bits, tail.bits, head.source) == (8, 8, "disk")


def test_an_entry_of_another_kv_bits_is_skipped_with_a_line_that_says_so(tmp_path):
    store = make_store()
    store.insert(DIGEST, TOKENS, 0, packed_segment(TOKENS), {})
    save(store, DIGEST, tmp_path)  # packed KV filed under the full-precision fingerprint: a file moved by hand
    with capture_logs():
        restarted, result = load(tmp_path, DIGEST, FULL)
    assert result.num_imported == 0
    assert [reason for _, reason in result.bad] == ["written at --kv-bits 8, this model runs at --kv-bits off"]
    assert restarted.match(DIGEST, TOKENS).length == 0


def test_another_settings_folder_is_logged_at_start_and_never_read(tmp_path):
    store = make_store()
    store.insert(DIGEST + "-q8", TOKENS, 0, packed_segment(TOKENS), {})
    save(store, DIGEST + "-q8", tmp_path)
    with capture_logs() as logs:
        restarted, result = load(tmp_path, DIGEST + "-q4", CacheLayout((0, 1), (), (), kv_bits=4))
    assert result.num_imported == 0 and restarted.match(DIGEST + "-q4", TOKENS).length == 0
    (line,) = [entry for entry in logs if entry["event"] == "disk_cache_other_kv_bits"]
    assert (line["written_at"], line["this_run"]) == ("q8", "q4") and line["dir"].endswith(DIGEST + "-q8")
    assert (tmp_path / (DIGEST + "-q8")).is_dir()  # kept for a switch back


def test_a_full_precision_entry_has_the_header_it_always_had(tmp_path):
    store = make_store()
    store.insert(DIGEST, TOKENS, 0, full_segment(TOKENS), {})
    ((_, _, data),) = save(store, DIGEST, tmp_path)
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + length])
    assert "kv_bits" not in header
    restarted, result = load(tmp_path, DIGEST, FULL)
    assert result.num_imported == 1 and restarted.match(DIGEST, TOKENS).length == 47
