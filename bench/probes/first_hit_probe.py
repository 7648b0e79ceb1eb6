#!/usr/bin/env python
"""What an exact cache hit costs the first time at a new depth, against its repeats.

    python bench/probes/first_hit_probe.py MODEL_DIR [--lengths 1500,3000,2200,3900] [--daemon-args "..."] [--json OUT]

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
   repeats (client TTFT and the daemon's own prefill timing);
3. in process, mlx-lm's BatchGenerator as the daemon's decode batch drives it
   (forks of one stored 600-token prefix, one input token each, greedy): the
   first three steps of a batch of B rows, B = 2, 3, 4, 8, then the same sizes
   again; multi-second first steps of a new batch were seen on the H200 in
   round 1 of compare.py's shared workload (decode 2.7-4.5 s for 12 tokens);
4. the same with rows of different depths (600 + 7i tokens), so that the batch
   is left-padded and every decode step attends through an array mask at a
   key length it has not met before: in compare.py's full shared workload only
   the seven sessions that joined the leader's batch decoded slowly (3.3-4.5 s
   for 12 tokens against the leader's 0.55 s), in every run of 2026-12-04-c.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from prefixd.daemon.kv.fork import capture_segment, evaluate_fork, fork_cache  # noqa: E402
from prefixd.daemon.kv.layout import make_cache_layout  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for harness
from harness import Daemon, connect, timed_generate  # noqa: E402

CHUNK = 2048


def ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def in_process(model_dir: str, lengths: list[int], vocab_low: int = 100, vocab_high: int = 30000,
               segment_tokens: int = CHUNK) -> list[dict]:
    print(f"1. in process, the daemon's fork of {segment_tokens}-token segments (ms): hit = fork + last token + argmax,"
          " one lazy eval")
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
        for start in range(0, length - 1, segment_tokens):  # stored as the daemon stores (CUDA: every 4 chunks)
            segments.append(capture_segment(cache, layout, start, min(start + segment_tokens, length - 1)))
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


def batch_first_steps(model_dir: str, sizes: list[int], rounds: int = 2, ragged: bool = False,
                      num_steps: int = 3) -> list[dict]:
    if ragged:
        print(f"\n4. the same, rows at depths 600 + 7i (a left-padded batch, an array mask), first {num_steps} steps")
    else:
        print("\n3. in process, mlx-lm's BatchGenerator on forks of one 600-token prefix (ms per step, first three steps)")
    model, _ = load(model_dir)
    layout = make_cache_layout(model)
    rng = random.Random(2)
    prefix = [rng.randrange(100, 30000) for _ in range(600 + 7 * max(sizes))]
    cache = make_prompt_cache(model)
    model(mx.array(prefix)[None], cache=cache)
    mx.eval([c.state for c in cache])
    segment = capture_segment(cache, layout, 0, len(prefix))
    rows = []
    for round_index in range(rounds):
        for size in sizes:
            generator = BatchGenerator(model, sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
                                       completion_batch_size=64, prefill_batch_size=64)
            forks = []
            for row in range(size):
                depth = 600 + (7 * row if ragged else 0)
                head, _ = segment.split(depth)
                fork = fork_cache(model, layout, [head], None, depth)
                evaluate_fork(fork)
                forks.append(fork)
            generator.insert([[rng.randrange(100, 30000)] for _ in range(size)], max_tokens=[num_steps + 2] * size,
                             caches=forks)
            steps = []
            for _ in range(num_steps):
                started = time.perf_counter()
                generator.next()
                steps.append(ms_since(started))
            generator.close() if hasattr(generator, "close") else None
            rows.append({"round": round_index, "rows": size, "ragged": ragged, "steps_ms": steps})
            print(f"   round {round_index}, {size} rows: " + " ".join(f"{t:7.1f}" for t in steps))
    del model
    return rows


def through_daemon(model_dir: str, lengths: list[int], extra_args: list[str], logs: str | None,
                   chat: bool = False) -> list[dict]:
    form = "one chat message" if chat else "a raw prompt"
    print(f"\n2. the daemon over its socket ({' '.join(extra_args) or 'defaults'}), {form}: cold, then 3 exact repeats")
    rng = random.Random(1)
    words = "river stone cloud garden lamp window copper violet harbor meadow pencil orbit".split()
    rows = []
    with tempfile.TemporaryDirectory() as workdir, Daemon(Path(model_dir), Path(workdir), extra_args) as daemon:
        started = time.perf_counter()
        with connect(daemon.socket_path) as conn:
            for length in lengths:
                text = " ".join(rng.choice(words) for _ in range(length))
                prompt = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
                replies = [timed_generate(conn, **prompt, max_tokens=4, temperature=0) for _ in range(4)]
                row = {"words": length, "prompt_tokens": replies[0]["cache"]["prompt_tokens"],
                       "hits": [r["cache"]["hit"] for r in replies],
                       "client_ttft_ms": [r["client_ttft_ms"] for r in replies],
                       "client_total_ms": [r["client_total_ms"] for r in replies],  # 4 tokens: after the first, 3 steps
                       "prefill_ms": [r["timings"].get("prefill_ms") for r in replies],
                       "timings": [r["timings"] for r in replies]}
                rows.append(row)
                print(f"   {row['prompt_tokens']:5d} tokens: client TTFT "
                      + " ".join(f"{t:6.1f}" for t in row["client_ttft_ms"])
                      + "   daemon prefill " + " ".join(f"{t:6.1f}" for t in row["prefill_ms"])
                      + "   " + ",".join(row["hits"]))
                print("          4 tokens in (client) " + " ".join(f"{t:6.1f}" for t in row["client_total_ms"]))
                last = row["timings"][-1]
                print("          last repeat: " + ", ".join(f"{key} {last[key]:.1f}" for key in
                      ("queue_ms", "encode_ms", "lookup_ms", "prefill_ms") if key in last))
        print(f"   ({time.perf_counter() - started:.1f} s of requests)")
        if logs:
            Path(logs).mkdir(parents=True, exist_ok=True)
            daemon.stop()
            name = "-".join(extra_args).strip("-").replace(" ", "") or "defaults"
            shutil.copy(daemon.log_path, Path(logs) / f"daemon-{name}.log")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--lengths", default="1500,3000,2200,3900")
    parser.add_argument("--daemon-args", action="append", default=[],
                        help="run part 2 once per value (e.g. '' and '--no-warmup'); default: once with defaults")
    parser.add_argument("--parts", default="1,2")
    parser.add_argument("--segment-tokens", type=int, default=CHUNK, help="part 1: the stored segments' length")
    parser.add_argument("--chat", action="store_true", help="part 2: send each prompt as one user message")
    parser.add_argument("--batch-sizes", default="2,3,4,8")
    parser.add_argument("--daemon-logs", help="copy each daemon's log into this folder")
    parser.add_argument("--json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    parts = {int(p) for p in args.parts.split(",")}
    out: dict = {"device": str(mx.default_device()), "mlx": mx.__version__}
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    if 1 in parts:
        out["in_process"] = in_process(args.model, lengths, segment_tokens=args.segment_tokens)
    if 2 in parts:
        out["daemon"] = {extra: through_daemon(args.model, lengths, shlex.split(extra), args.daemon_logs, args.chat)
                         for extra in (args.daemon_args or [""])}
    if 3 in parts:
        out["batch"] = batch_first_steps(args.model, [int(n) for n in args.batch_sizes.split(",")])
    if 4 in parts:
        out["ragged_batch"] = batch_first_steps(args.model, [8], ragged=True, num_steps=12)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
