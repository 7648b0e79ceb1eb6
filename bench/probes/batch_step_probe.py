#!/usr/bin/env python
"""Where a batched decode step's time goes, and what several short tails on one prefix cost.

    python bench/probes/batch_step_probe.py MODEL_DIR [--context 1000] [--steps 40] [--parts steps,sdpa,tails]

On the H200 four sessions decoded only 1.9-2.2x faster in aggregate than one
(issue 13 asks 3x), and eight sessions sending short questions on one cached
2k-token prompt waited ~300 ms for a ~10-token tail each. This probe, in
process and without the daemon, separates the suspects:

* part ``steps``: one decode step for 1, 2, 4 and 8 rows, pipelined like
  generate_step (the next step is queued before the current token is read),
  with (a) ``plain``: one KVCache of B equal rows, no mask; (b) ``padded``:
  the rows at different depths in mlx-lm's left-padded BatchKVCache, so every
  attention call gets an array mask; (c) ``rowwise``: the same padded cache,
  attention computed row by row on each row's own keys without a mask;
  (d) mlx-lm's BatchGenerator, which prefixd's batch uses.
* part ``sdpa``: one attention call of a decode step (4 rows, 1,000 keys):
  no mask, an array mask, row by row.
* part ``tails``: seven 8-14-token tails on one cached 2,000-token prefix,
  three rounds of new lengths: one pass per tail (fork, forward, argmax) one
  after another, against mlx-lm's BatchGenerator taking all seven at once
  (what prefixd hands it today).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models import base  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

_rowwise = {"on": False}


def rowwise_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """A decode step's attention one row at a time over the row's own keys (no mask)."""
    pads = getattr(cache, "host_left_padding", None)
    if not _rowwise["on"] or pads is None or queries.shape[2] != 1 or sinks is not None:
        return base.scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    rows = [mx.fast.scaled_dot_product_attention(queries[i:i + 1], keys[i:i + 1, :, pad:], values[i:i + 1, :, pad:],
                                                 scale=scale)
            for i, pad in enumerate(pads)]
    return mx.concatenate(rows, axis=0)


def install_rowwise(model) -> None:
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = rowwise_attention


def summary(name: str, step_ms: list[float], rows: int) -> None:
    ordered = sorted(step_ms)
    median = statistics.median(step_ms)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    first = " ".join(f"{x:.1f}" for x in step_ms[:3])
    print(f"  {name:<16} rows {rows}: step median {median:6.2f} ms  p90 {p90:6.2f}  first {first}"
          f"  -> {rows * 1000 / median:7.1f} tok/s", flush=True)


def pipelined_steps(model, cache, first: mx.array, steps: int) -> list[float]:
    """generate_step's loop for B rows, greedy: queue step n+1, then read step n."""
    def forward(y):
        logits = model(y[:, None], cache=cache)[:, -1, :]
        nxt = mx.argmax(logits, axis=-1)
        mx.async_eval(nxt)
        return nxt

    y = forward(first)
    times, last = [], time.perf_counter()
    for _ in range(steps):
        nxt = forward(y)
        y.tolist()
        y = nxt
        now = time.perf_counter()
        times.append((now - last) * 1000)
        last = now
    y.tolist()
    return times


def random_prompts(tokenizer, seed: int = 0) -> Callable[[int], list[int]]:
    """n -> n ordinary token ids, drawn from one seeded generator."""
    rng = random.Random(seed)
    vocab = len(tokenizer.vocab)
    return lambda n: [rng.randrange(min(100, vocab // 2), min(30000, vocab)) for _ in range(n)]


def prefilled_cache(model, tokens: list[list[int]]) -> list:
    """A fresh cache holding these equal-length rows, evaluated."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--parts", default="steps,sdpa,tails")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model, tokenizer = load(args.model)
    install_rowwise(model)
    prompt = random_prompts(tokenizer)

    def prefilled(tokens: list[list[int]]) -> list:
        return prefilled_cache(model, tokens)

    print(f"device {mx.default_device()}, mlx {mx.__version__}, context ~{args.context}, {args.steps} steps", flush=True)
    if "steps" in parts:
        for run in range(2):  # run 0 also pays for shapes met the first time
            print(f"steps, run {run}")
            tokens = prompt(args.context)
            cache = prefilled([tokens[:-1]])
            times = []
            last = time.perf_counter()
            for _, _ in zip(range(args.steps), generate_step(mx.array(tokens[-1:]), model, prompt_cache=cache)):
                now = time.perf_counter()
                times.append((now - last) * 1000)
                last = now
            summary("solo", times[2:], 1)
            for rows in (1, 2, 4, 8):
                same = prompt(args.context)
                cache = prefilled([same] * rows)
                summary("plain", pipelined_steps(model, cache, mx.array([same[-1]] * rows), args.steps)[2:], rows)
                prompts = [prompt(args.context + 7 * i) for i in range(rows)]
                for variant in ("padded", "rowwise"):
                    singles = [prefilled([p[:-1]]) for p in prompts]
                    batch = [BatchKVCache.merge([c[layer] for c in singles]) for layer in range(len(singles[0]))]
                    longest = max(len(p) for p in prompts)
                    for layer in batch:
                        layer.host_left_padding = [longest - len(p) for p in prompts]
                    _rowwise["on"] = variant == "rowwise"
                    first = mx.array([p[-1] for p in prompts])
                    summary(variant, pipelined_steps(model, batch, first, args.steps)[2:], rows)
                    _rowwise["on"] = False
                singles = [prefilled([p[:-1]]) for p in prompts]
                generator = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
                generator.insert([p[-1:] for p in prompts], max_tokens=[args.steps + 4] * rows, caches=singles)
                times = []
                for _ in range(args.steps):
                    started = time.perf_counter()
                    generator.next()
                    times.append((time.perf_counter() - started) * 1000)
                summary("BatchGenerator", times[2:], rows)
    if "sdpa" in parts:
        print("sdpa, one decode-step attention call, 4 rows x 16 heads (8 kv) x 128, 1,000 keys, bf16, median of 200")
        q = mx.random.normal((4, 16, 1, 128)).astype(mx.bfloat16)
        k = mx.random.normal((4, 8, 1000, 128)).astype(mx.bfloat16)
        v = mx.random.normal((4, 8, 1000, 128)).astype(mx.bfloat16)
        pads = [0, 7, 14, 21]
        mask = mx.array(pads)[:, None, None, None] <= mx.arange(1000)[None, None, None]
        mx.eval(q, k, v, mask)
        cases = {
            "no mask": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088),
            "bool mask": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask),
            "row by row": lambda: mx.concatenate([mx.fast.scaled_dot_product_attention(
                q[i:i + 1], k[i:i + 1, :, p:], v[i:i + 1, :, p:], scale=0.088) for i, p in enumerate(pads)]),
        }
        for name, fn in cases.items():
            times = []
            for _ in range(200):
                started = time.perf_counter()
                mx.eval(fn())
                times.append((time.perf_counter() - started) * 1000)
            print(f"  {name:<12} {statistics.median(times):7.3f} ms (first {times[0]:.2f})", flush=True)
    if "tails" in parts:
        prefix = prompt(2000)
        base_cache = prefilled([prefix])

        def fork() -> list:
            forked = make_prompt_cache(model)
            for dst, src in zip(forked, base_cache):
                dst.keys = mx.concatenate([src.keys[..., :2000, :], mx.zeros_like(src.keys[..., :256, :])], axis=2)
                dst.values = mx.concatenate([src.values[..., :2000, :], mx.zeros_like(src.values[..., :256, :])], axis=2)
                dst.offset = 2000
            return forked

        print("tails: 7 tails of 8-14 tokens on one cached 2,000-token prefix (all seven to their first token)")
        for run in range(3):
            tails = [prompt(8 + (i + 3 * run) % 7) for i in range(7)]
            started = time.perf_counter()
            for tail in tails:
                cache = fork()
                logits = model(mx.array([tail]), cache=cache)[:, -1, :]
                mx.argmax(logits, axis=-1).item()
            one_by_one = (time.perf_counter() - started) * 1000
            started = time.perf_counter()
            generator = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
            generator.insert(tails, max_tokens=[4] * 7, caches=[fork() for _ in tails])
            seen = set()
            while len(seen) < 7:
                _, responses = generator.next()
                seen.update(r.uid for r in responses)
            batched = (time.perf_counter() - started) * 1000
            print(f"  round {run}: one pass each {one_by_one:7.1f} ms   BatchGenerator {batched:7.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
