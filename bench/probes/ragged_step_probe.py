#!/usr/bin/env python
"""A decode batch's step, padded (mlx-lm's BatchGenerator) against ragged (prefixd's own), in process.

    python bench/probes/ragged_step_probe.py MODEL_DIR [--mixes 1000x4,4000+200x3,8000+300x3,2000x8]
        [--steps 12] [--rounds 2] [--dtype float32]

Each mix is a set of rows at given depths (``4000+200x3``: one row 4,000 tokens
deep and three 200 deep). The rows are prefilled once; each round, both
batches get copies of them, in turn: rows join (the first call, timed as
"join"), then ``--steps`` steady steps (the median, and the aggregate tokens
a second); "held" is the memory MLX holds for the batch's KV once the rows
joined (its rows' copies made for the round included: the padded batch
merges them into one buffer, left-padded to the longest row). The model loads through prefixd (load_model), so its attention
routing is the daemon's on this device (on CUDA the padded batch's steps go
to prefixd's padded-decode kernel). Before timing, each mix checks that the
two batches hand out the same greedy tokens.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, StopSequences  # noqa: E402

from prefixd.daemon.engine.batch_decoder import greedy  # noqa: E402
from prefixd.daemon.engine.ragged_batch import RaggedBatch  # noqa: E402
from prefixd.daemon.kv.fork import live_cache  # noqa: E402
from prefixd.daemon.models.loaded_model import load_model  # noqa: E402

PREFILL_CHUNK = 512


def parse_mix(text: str) -> list[int]:
    """``4000+200x3`` -> [4000, 200, 200, 200]."""
    depths = []
    for part in text.split("+"):
        depth, _, count = part.partition("x")
        depths += [int(depth)] * int(count or 1)
    return depths


def prefilled(loaded, depth: int, seed: int) -> list:
    cache = live_cache(loaded.model, loaded.layout)
    vocab = min(20000, loaded.tokenizer.vocab_size) - 100  # ordinary ids of any vocabulary
    tokens = mx.array([[(seed * 7919 + 31 * i) % vocab + 100 for i in range(depth)]])
    for start in range(0, depth, PREFILL_CHUNK):
        loaded.model(tokens[:, start : start + PREFILL_CHUNK], cache=cache)
        mx.eval([layer.state for layer in cache])
    return cache


def make_batch(form: str, model, stream):
    if form == "ragged":
        return RaggedBatch(model, sampler=greedy, stream=stream)
    return BatchGenerator(model, sampler=greedy, completion_batch_size=64, prefill_batch_size=64, stream=stream)


def run(form: str, loaded, rows: list[list], steps: int, stream) -> tuple[float, list[float], list[list[int]], int]:
    gc.collect()
    before = mx.get_active_memory()
    batch = make_batch(form, loaded.model, stream)
    never = StopSequences([[-1]])
    count = len(rows)
    started = time.perf_counter()
    uids = batch.insert(
        [[11]] * count,
        max_tokens=[steps + 8] * count,
        caches=[copy.deepcopy(row) for row in rows],
        samplers=[greedy] * count,
        logits_processors=[[] for _ in rows],
        stop_sequences=[never] * count,
    )
    batch.next()  # the rows join: their joining tokens are fed, nothing is handed out yet
    mx.synchronize()
    join_ms = (time.perf_counter() - started) * 1000
    gc.collect()
    held = mx.get_active_memory() - before
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    step_ms = []
    for _ in range(steps):
        started = time.perf_counter()
        _, responses = batch.next()
        step_ms.append((time.perf_counter() - started) * 1000)
        for response in responses:
            tokens[response.uid].append(int(response.token))
    return join_ms, step_ms, [tokens[uid] for uid in uids], held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--mixes", default="1000x4,4000+200x3,8000+300x3,2000x8")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype, batch_step="padded")
    stream = mx.new_stream(mx.default_device())
    print(f"{Path(args.model).name} on {mx.default_device()}, attention {loaded.attention}, dtype {loaded.dtype}")
    for mix in args.mixes.split(","):
        depths = parse_mix(mix)
        rows = [prefilled(loaded, depth, seed) for seed, depth in enumerate(depths)]
        padded_tokens = run("padded", loaded, rows, 4, stream)[2]
        ragged_tokens = run("ragged", loaded, rows, 4, stream)[2]
        agree = sum(a == b for p, r in zip(padded_tokens, ragged_tokens) for a, b in zip(p, r))
        total = sum(len(p) for p in padded_tokens)
        figures: dict[str, list[tuple[float, float]]] = {"padded": [], "ragged": []}
        held: dict[str, int] = {}
        for _ in range(args.rounds):
            for form in figures:
                join_ms, step_ms, _, held[form] = run(form, loaded, rows, args.steps, stream)
                figures[form].append((join_ms, statistics.median(step_ms[1:])))
        line = [f"{mix:>16} ({len(depths)} rows, greedy tokens agree {agree}/{total}):"]
        for form, runs in figures.items():
            steps = ", ".join(f"{step:.1f}" for _, step in runs)
            joins = ", ".join(f"{join:.0f}" for join, _ in runs)
            best = min(step for _, step in runs)
            line.append(
                f"{form} step {steps} ms (join {joins} ms, {len(depths) * 1000 / best:.0f} tok/s, "
                f"held {held[form] / 2**20:.0f} MiB)"
            )
        ratio = min(s for _, s in figures["ragged"]) / min(s for _, s in figures["padded"])
        line.append(f"ragged/padded {ratio:.2f}")
        print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
