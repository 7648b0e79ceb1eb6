#!/usr/bin/env python
"""Where the shared workload's round-1 followers lose seconds: the daemon's own decode batch, step by step.

    python bench/probes/decode_batch_probe.py MODEL_DIR [--prefix 1986] [--rows 8] [--answer 12] [--json OUT]

In every full bench/compare.py run on the H200 (bench/results/gpu/2026-12-04-c),
round 1 of the shared workload went like this: the leader prefilled the
1,986-token system prompt and decoded 12 tokens in 0.57 s; the seven
followers, each a short tail on the leader's stored prompt, got their first
token at 230-400 ms and then needed 4.0 s for their next 11 tokens, most of
it after the leader had left the batch. In round 2 (eight hits joining
together, finishing together) a step cost 25-30 ms.

This drives the daemon's own pieces in process (the loader with its
attention routing, the warm-up, the fork, BatchDecoder with its solo path)
through the scenarios, timing every decode step with the number of rows:

* round1: the leader decodes alone, a follower's tail is prefilled and joins
  after each step (as the scheduler interleaves short tails), the leader
  leaves when its answer is done, the followers decode to their end;
* round1-stay: the same, but the leader's answer is four times longer, so no
  row leaves the batch while the followers decode;
* round2: all rows join before the first step and finish together;
* round1 again: whether it is a first-time cost of the process.

After each step where the batch changed, the first layer's batch cache is
described (buffer length, filled length, left padding), since a row leaving
mlx-lm's BatchKVCache filters and may shift every other row.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402

from prefixd.daemon.engine.batch_decoder import BatchDecoder, sample_first  # noqa: E402
from prefixd.daemon.engine.prefill import make_sequence  # noqa: E402
from prefixd.daemon.engine.jobs import GenerateJob  # noqa: E402
from prefixd.daemon.engine import warm_up  # noqa: E402
from prefixd.daemon.kv.fork import capture_segment, capture_snapshot, evaluate_fork, fork_cache  # noqa: E402
from prefixd.daemon.models.loaded_model import load_model  # noqa: E402
from prefixd.protocol.methods import parse_generate  # noqa: E402

CHUNK = 2048


def ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


class Stored:
    """One prefilled prefix, captured as the store would hold it."""

    def __init__(self, loaded, tokens: list[int]):
        self.loaded, self.tokens = loaded, tokens
        cache = fork_cache(loaded.model, loaded.layout, [], None, 0)
        self.segments = []
        for start in range(0, len(tokens), CHUNK):
            end = min(start + CHUNK, len(tokens))
            loaded.model(mx.array(tokens[start:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            self.segments.append(capture_segment(cache, loaded.layout, start, end))
        self.snapshot = capture_snapshot(cache, loaded.layout)

    def sequence_with_tail(self, tail: list[int], max_tokens: int):
        """A fork of the prefix with ``tail`` prefilled; the sequence and its first token."""
        loaded = self.loaded
        params = parse_generate({"prompt": "probe", "max_tokens": max_tokens, "temperature": 0.0, "stream": False})
        seq = make_sequence(GenerateJob("probe", None, params, emit=lambda kind, payload: None), loaded)
        seq.cache = fork_cache(loaded.model, loaded.layout, self.segments, self.snapshot, len(self.tokens))
        evaluate_fork(seq.cache)
        logits = loaded.model(mx.array(tail)[None], cache=seq.cache)[:, -1, :]
        first = sample_first(seq, logits)
        seq.generated.append(first)
        return seq, first


def batch_cache_state(decoder: BatchDecoder) -> str:
    batch = getattr(decoder._generator, "_generation_batch", None)
    caches = getattr(batch, "prompt_cache", None) or []
    first = caches[0] if caches else None
    if first is None or getattr(first, "keys", None) is None:
        return "-"
    padding = first.left_padding.tolist() if hasattr(first, "left_padding") else "?"
    return f"buffer {first.keys.shape[2]} filled {getattr(first, '_idx', '?')} left padding {padding}"


def run_scenario(name: str, stored: Stored, rows: int, answer: int, rng: random.Random) -> dict:
    decoder = BatchDecoder(stored.loaded.model, stored.loaded.eos_token_ids)
    tails = [[rng.randrange(100, 30000) for _ in range(8 + rng.randrange(8))] for _ in range(rows)]
    steps, joins = [], []

    def join(index: int) -> None:
        started = time.perf_counter()
        length = answer * 4 if (index == 0 and name == "round1-stay") else answer
        seq, first = stored.sequence_with_tail(tails[index], length)
        decoder.add(seq, [first], length - 1)
        joins.append(ms_since(started))

    if name == "round2":
        for index in range(rows):
            join(index)
    else:
        join(0)
    pending = list(range(1, rows)) if name != "round2" else []
    states, last_state = [], None
    while len(decoder) or pending:
        before = len(decoder)
        started = time.perf_counter()
        events = decoder.step()
        for event in events:
            event.seq.generated.append(event.token)
        steps.append({"rows": before, "ms": ms_since(started)})
        state = batch_cache_state(decoder)
        if state.split(" filled")[0] != (last_state or "").split(" filled")[0] or before != len(decoder):
            states.append(f"after step {len(steps)} ({len(decoder)} rows): {state}")
        last_state = state
        if pending:
            join(pending.pop(0))
    print(f"\n{name}: joins (fork + tail + first token) ms: " + " ".join(f"{t:.0f}" for t in joins))
    print("   step ms (rows): " + " ".join(f"{s['ms']:.0f}({s['rows']})" for s in steps))
    total = sum(s["ms"] for s in steps)
    print(f"   {len(steps)} steps, {total:.0f} ms, median {statistics.median(s['ms'] for s in steps):.1f} ms")
    for line in states:
        print(f"   {line}")
    return {"scenario": name, "join_ms": joins, "steps": steps, "total_ms": total, "batch_cache": states}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prefix", type=int, default=1986)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--answer", type=int, default=12)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--scenarios", default="round1,round1-stay,round2,round1")
    parser.add_argument("--json")
    args = parser.parse_args()
    loaded = load_model(args.model, attention=args.attention)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, attention {loaded.attention}")
    if not args.no_warm_up:
        print(f"warm-up {warm_up.run_all(warm_up.warm_up_steps(loaded)):.2f} s")
    rng = random.Random(3)
    stored = Stored(loaded, [rng.randrange(100, 30000) for _ in range(args.prefix)])
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "attention": loaded.attention,
           "scenarios": [run_scenario(name, stored, args.rows, args.answer, rng)
                         for name in args.scenarios.split(",")]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
