#!/usr/bin/env python
"""What one decode step costs alone and in mlx-lm's BatchGenerator, step by step.

    python bench/probes/batch_probe.py MODEL_DIR [--context 1000] [--steps 48]

prefixd decodes a sequence that runs alone on its own cache (the solo path)
and several at once in mlx-lm's BatchGenerator. On the H200, four sessions
decoded only 1.8x faster in aggregate than one, and two *slower* than one.
This probe times, in process, with no daemon: solo steps (generate_step's
pipelining), then batches of 1, 2 and 4 rows inserted with prefilled caches
of slightly different depths, every step timed (median, p90, the first few),
so a cost that grows with each new cache length shows as a flat high median
rather than a first-step spike.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from batch_step_probe import summary  # noqa: E402  (this script's folder is first on sys.path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    rng = __import__("random").Random(0)
    vocab = len(tokenizer.vocab)

    def prompt(extra: int) -> list[int]:
        return [rng.randrange(min(100, vocab // 2), min(30000, vocab)) for _ in range(args.context + extra)]

    def prefilled(tokens: list[int]) -> list:
        cache = make_prompt_cache(model)
        model(mx.array(tokens[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    print(f"device {mx.default_device()}, mlx {mx.__version__}, context ~{args.context}, {args.steps} steps")
    for run in range(2):  # the first run also pays for shapes met the first time
        print(f"run {run}")
        tokens = prompt(0)
        cache = prefilled(tokens)
        times, last = [], time.perf_counter()
        for n, _ in zip(range(args.steps), generate_step(mx.array(tokens[-1:]), model, prompt_cache=cache)):
            now = time.perf_counter()
            times.append((now - last) * 1000)
            last = now
        summary("solo (generate_step)", times[1:], 1)
        for rows in (1, 2, 4):
            prompts = [prompt(7 * i) for i in range(rows)]
            caches = [prefilled(p) for p in prompts]
            generator = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
            generator.insert([p[-1:] for p in prompts], max_tokens=[args.steps + 4] * rows, caches=caches)
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                _, responses = generator.next()
                times.append((time.perf_counter() - started) * 1000)
            summary("BatchGenerator", times[2:], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
