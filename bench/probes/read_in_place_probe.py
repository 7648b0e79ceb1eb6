#!/usr/bin/env python
"""What a decode step costs when rows read their stored prompts in place (prefill.read_prompt_in_place).

    .venv/bin/python bench/probes/read_in_place_probe.py [MODEL_DIR] [--rows 1,4] [--tokens 1100] [--chunk 512]

Each row is a prompt of its own (cold, as a daemon sees new tenants), prefilled
in passes of ``--chunk`` tokens and stored as those pieces. Then the rows
decode together in mlx-lm's batch, as the daemon's batch holds them:

* ``own copy``: each row keeps its own contiguous cache (before the change);
* ``in place``: each row reads its stored pieces and keeps only the positions
  after them (kv.fork.read_stored_prefix_in_place). Rows of distinct prompts
  read distinct pieces, so attention runs per row (models/prefix_attention.py).

Printed: the median time of a decode step (every layer, all rows) over
``--steps`` steps after a warm-up, both forms alternating, and the KV bytes
the rows' caches hold of their own. Figures of one run, compared within it.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402

from prefixd.daemon.kv.fork import capture_segment, live_cache, read_stored_prefix_in_place  # noqa: E402
from prefixd.daemon.kv.shared_prefix_cache import SharedPrefixKVCache, batch_rows  # noqa: E402
from prefixd.daemon.models.loaded_model import load_model  # noqa: E402

DEFAULT_MODEL = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"


def prefilled_row(loaded, tokens: list[int], chunk: int) -> tuple[list, list]:
    """A row's live cache after its prompt, and the prompt's stored pieces (one per pass)."""
    cache = live_cache(loaded.model, loaded.layout)
    segments = []
    for start in range(0, len(tokens), chunk):
        end = min(start + chunk, len(tokens))
        loaded.model(mx.array(tokens[start:end])[None], cache=cache)
        mx.eval([layer.state for layer in cache])
        segments.append(capture_segment(cache, loaded.layout, start, end))
    return cache, segments


def as_batch(caches: list[list]) -> list:
    rows = [batch_rows(cache, True) for cache in caches]
    return [rows[0][i].merge([row[i] for row in rows]) for i in range(len(rows[0]))]


def own_bytes(caches: list[list]) -> int:
    total = 0
    for cache in caches:
        for layer in cache:
            if isinstance(layer, SharedPrefixKVCache):
                total += layer.nbytes
            elif getattr(layer, "keys", None) is not None:
                total += layer.keys.nbytes + layer.values.nbytes
    return total


def step_ms(loaded, batch: list, num_rows: int, steps: int) -> list[float]:
    times = []
    token = mx.array([[5]] * num_rows)
    for _ in range(steps):
        started = time.perf_counter()
        logits = loaded.model(token, cache=batch)
        mx.eval(logits)
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--tokens", type=int, default=1100)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(str(args.model_dir), dtype="float32", fork="share")
    if not loaded.layout.shares_forks:
        print(f"{loaded.name} does not share forks ({loaded.fork})")
        return 1
    vocab = loaded.model.args.vocab_size if hasattr(loaded.model, "args") else 49152
    print(f"{loaded.name}: {args.tokens}-token prompts of their own per row, pieces of {args.chunk}; "
          f"median decode step over {args.steps} steps x {args.rounds} rounds, ms")
    print(f"{'rows':>4} {'own copy':>9} {'in place':>9} {'ratio':>6} {'own KV MiB: copy':>17} {'in place':>9}")
    for num_rows in [int(n) for n in args.rows.split(",")]:
        rng = random.Random(num_rows)
        rows = [prefilled_row(loaded, [rng.randrange(10, vocab) for _ in range(args.tokens)], args.chunk)
                for _ in range(num_rows)]
        copies = [copy.deepcopy(cache) for cache, _ in rows]
        in_place = []
        for cache, segments in rows:
            cache = copy.deepcopy(cache)
            assert read_stored_prefix_in_place(cache, loaded.layout, segments, args.tokens) > 0
            in_place.append(cache)
        own_copy_bytes, in_place_bytes = own_bytes(copies), own_bytes(in_place)
        timings: dict[str, list[float]] = {"copy": [], "place": []}
        for _ in range(args.rounds):  # alternate, so both see the same machine
            for name, caches in (("copy", copies), ("place", in_place)):
                batch = as_batch([copy.deepcopy(cache) for cache in caches])
                step_ms(loaded, batch, num_rows, 3)  # warm-up: first shapes
                timings[name] += step_ms(loaded, batch, num_rows, args.steps)
        copy_ms, place_ms = statistics.median(timings["copy"]), statistics.median(timings["place"])
        print(f"{num_rows:>4} {copy_ms:>9.1f} {place_ms:>9.1f} {place_ms / copy_ms:>6.2f} "
              f"{own_copy_bytes / 2**20:>17.1f} {in_place_bytes / 2**20:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
