#!/usr/bin/env python
"""What an exact cache hit costs the first time at a new depth, against its repeats.

    python bench/first_hit_probe.py MODEL_DIR [--lengths 1500,3000,2200,3900] [--daemon-args "..."] [--json OUT]

On the H200 the repeat workload's first exact hit took 25 ms of prefill where
its repeats took 7-10 ms (bench/compare.py, run E of 2026-12-04-b), and with
three repeats that first one sets the p50. This probe says whether that cost
comes once per process (kernels compiled, graphs built for the hit's path:
a warm-up at load removes it) or once per new depth (it would not).

1. in process, with the daemon's own fork (daemon/kv/fork.py): a cold prefill
   of each length in 2,048-token chunks, each chunk captured as a stored
   segment, then four exact hits (fork + the last token + argmax), timed as
   one lazy evaluation as the engine runs them, then the fork alone and the
   forward alone;
2. the real daemon over its socket: each length cold, then three exact
   repeats (client TTFT and the daemon's own prefill timing).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from prefixd.daemon.kv.fork import capture_segment, fork_cache  # noqa: E402
from prefixd.daemon.kv.layout import make_cache_layout  # noqa: E402
from harness import Daemon, connect, timed_generate  # noqa: E402 (bench/ is the script's own folder)

CHUNK = 2048


def ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def in_process(model_dir: str, lengths: list[int], vocab_low: int = 100, vocab_high: int = 30000) -> list[dict]:
    print("1. in process, the daemon's fork (ms): hit = fork + last token + argmax, one lazy eval")
    model, _ = load(model_dir)
    layout = make_cache_layout(model)
    rng = random.Random(0)
    rows = []
    for length in lengths:
        tokens = [rng.randrange(vocab_low, vocab_high) for _ in range(length)]
        cache, segments = make_prompt_cache(model), []
        for start in range(0, length - 1, CHUNK):
            end = min(start + CHUNK, length - 1)
            model(mx.array(tokens[start:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            segments.append(capture_segment(cache, layout, start, end))
        hits = []
        for _ in range(4):
            started = time.perf_counter()
            fork = fork_cache(model, layout, segments, None, length - 1)
            logits = model(mx.array(tokens[-1:])[None], cache=fork)[0, -1]
            mx.eval(mx.argmax(logits))
            hits.append(ms_since(started))
        split = []
        for _ in range(3):
            started = time.perf_counter()
            fork = fork_cache(model, layout, segments, None, length - 1)
            mx.eval([c.state for c in fork])
            fork_ms = ms_since(started)
            started = time.perf_counter()
            mx.eval(mx.argmax(model(mx.array(tokens[-1:])[None], cache=fork)[0, -1]))
            split.append((fork_ms, ms_since(started)))
        row = {"length": length, "segments": len(segments), "hits_ms": hits,
               "fork_then_forward_ms": split}
        rows.append(row)
        print(f"   {length:5d} tokens, {len(segments)} segments: hits " + " ".join(f"{h:6.1f}" for h in hits)
              + "   fork / forward " + "  ".join(f"{f:.1f}/{w:.1f}" for f, w in split))
    del model
    return rows


def through_daemon(model_dir: str, lengths: list[int], extra_args: list[str]) -> list[dict]:
    print(f"\n2. the daemon over its socket ({' '.join(extra_args) or 'defaults'}): cold, then 3 exact repeats")
    rng = random.Random(1)
    words = "river stone cloud garden lamp window copper violet harbor meadow pencil orbit".split()
    rows = []
    with tempfile.TemporaryDirectory() as workdir, Daemon(Path(model_dir), Path(workdir), extra_args) as daemon:
        started = time.perf_counter()
        with connect(daemon.socket_path) as conn:
            for length in lengths:
                text = " ".join(rng.choice(words) for _ in range(length))
                replies = [timed_generate(conn, prompt=text, max_tokens=4, temperature=0) for _ in range(4)]
                row = {"words": length, "prompt_tokens": replies[0]["cache"]["prompt_tokens"],
                       "hits": [r["cache"]["hit"] for r in replies],
                       "client_ttft_ms": [r["client_ttft_ms"] for r in replies],
                       "prefill_ms": [r["timings"].get("prefill_ms") for r in replies]}
                rows.append(row)
                print(f"   {row['prompt_tokens']:5d} tokens: client TTFT "
                      + " ".join(f"{t:6.1f}" for t in row["client_ttft_ms"])
                      + "   daemon prefill " + " ".join(f"{t:6.1f}" for t in row["prefill_ms"])
                      + "   " + ",".join(row["hits"]))
        print(f"   ({time.perf_counter() - started:.1f} s of requests)")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--lengths", default="1500,3000,2200,3900")
    parser.add_argument("--daemon-args", action="append", default=[],
                        help="run part 2 once per value (e.g. '' and '--no-warmup'); default: once with defaults")
    parser.add_argument("--parts", default="1,2")
    parser.add_argument("--json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    parts = {int(p) for p in args.parts.split(",")}
    out: dict = {"device": str(mx.default_device()), "mlx": mx.__version__}
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    if 1 in parts:
        out["in_process"] = in_process(args.model, lengths)
    if 2 in parts:
        out["daemon"] = {extra: through_daemon(args.model, lengths, shlex.split(extra))
                         for extra in (args.daemon_args or [""])}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
