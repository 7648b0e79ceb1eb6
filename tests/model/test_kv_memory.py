"""A stored snapshot of one decode row owns its own memory: it does not keep the whole batch alive.

mlx-lm extracts a row's conv/SSM state as a view of the batch's array; a lazy
copy of a view holds the batch until it is evaluated. Measured with MLX's own
allocator, no model needed.
"""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from prefixd.daemon.kv.fork import capture_snapshot
from prefixd.daemon.kv.layout import CacheLayout


def test_a_row_snapshot_holds_only_its_row():
    batch = ArraysCache(2)
    batch.cache = [mx.ones((16, 64, 1024)), mx.ones((16, 64, 1024))]  # 16 rows, 4 MiB a row over both arrays
    mx.eval(batch.cache)
    row = batch.extract(3)  # what BatchGenerator hands back for one finished sequence
    layout = CacheLayout(attention_layers=(), state_layers=(0,), other_layers=())
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    snapshot = capture_snapshot([row], layout)
    del batch, row
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before + 2 * 16 * 64 * 1024 * 4  # the batch was counted in `before`
    assert snapshot.nbytes == 2 * 64 * 1024 * 4
    assert held <= snapshot.nbytes * 1.1, f"the snapshot keeps {held} bytes alive for {snapshot.nbytes}"
