#!/usr/bin/env python
"""What a few rows through the model's linear layers cost as one matmul and as one matrix-vector product per row.

    python bench/probes/row_linear_probe.py MODEL_DIR [--context 1000] [--steps 40] [--parts shapes,steps,batch,exact]

daemon/models/row_linear.py asks for a decode batch's linear layers in the
form ``W @ x_i`` (MLX's batched gemv on CUDA) instead of ``x @ W.T`` (cuBLASLt
for two rows or more). This probe, in process and without the daemon:

* part ``shapes``: each distinct weight shape of the model, all its layers'
  weights of that shape one after another in one evaluation, for 1, 2, 4 and
  8 rows in both forms (median ms of 30); and whether each row of the rows form
  equals, bit for bit, what that row gives alone.
* part ``steps``: one decode step of 1, 2, 4 and 8 equal rows on one KVCache
  (no mask), pipelined like mlx-lm's generate_step, the model in each form,
  alternating, two runs.
* part ``batch``: the same through mlx-lm's BatchGenerator (prefixd's decode
  batch), rows at different depths.
* part ``exact``: 4 rows decoded together, greedy, 16 steps: the largest logit
  difference from each row decoded alone, per form.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from batch_step_probe import pipelined_steps, prefilled_cache, random_prompts  # noqa: E402  (this script's folder is first on sys.path)

from prefixd.daemon.models import row_linear  # noqa: E402

ROW_COUNTS = (1, 2, 4, 8)


def set_form(model, form: str) -> None:
    """The model's linear layers in ``form``: matmul (MLX's own), or rows as the daemon installs it (row_linear.py)."""
    if form == "rows":
        row_linear.install(model, "rows")
        return
    plain = {row_linear.RowwiseLinear: nn.Linear, row_linear.RowwiseEmbedding: nn.Embedding}
    for module in model.modules():
        if type(module) in plain:
            module.__class__ = plain[type(module)]


def timed(fn, repeats: int = 30) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def part_shapes(model) -> None:
    by_shape: dict[tuple[int, ...], list[mx.array]] = {}
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and not hasattr(module, "bits"):
            by_shape.setdefault(tuple(module.weight.shape), []).append(module.weight)
    print("shapes: all weights of one shape in one evaluation, median ms of 30 (matmul / rows); rows == alone bit for bit")
    for shape, weights in sorted(by_shape.items()):
        nbytes = weights[0].nbytes
        line = [f"  {len(weights):>3} x {shape[0]}x{shape[1]} ({nbytes / 2**20:.1f} MiB)"]
        for rows in ROW_COUNTS:
            x = mx.random.normal((rows, 1, shape[1])).astype(weights[0].dtype)
            mx.eval(x)
            matmul = timed(lambda: [x @ w.T for w in weights])
            rowwise = timed(lambda: [row_linear.rows_times_weight(x, w) for w in weights]) if rows > 1 else matmul
            same = ""
            if rows > 1:
                together = row_linear.rows_times_weight(x, weights[0])
                alone = mx.concatenate([x[i : i + 1] @ weights[0].T for i in range(rows)])
                same = " =" if mx.array_equal(together, alone).item() else " !="
            line.append(f"{rows}: {matmul:6.3f}/{rowwise:6.3f}{same}")
        print("  ".join(line), flush=True)


def line(name: str, rows: int, step_ms: list[float]) -> None:
    median = statistics.median(step_ms)
    print(f"  {name:<14} rows {rows}: step median {median:6.2f} ms -> {rows * 1000 / median:7.1f} tok/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--parts", default="shapes,steps,batch,exact")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model, tokenizer = load(args.model)
    prompt = random_prompts(tokenizer)

    def prefilled(tokens: list[list[int]]) -> list:
        return prefilled_cache(model, tokens)

    print(f"device {mx.default_device()}, mlx {mx.__version__}, context ~{args.context}, {args.steps} steps", flush=True)
    if "shapes" in parts:
        part_shapes(model)
    if "steps" in parts:
        for run in range(2):
            print(f"steps, run {run}: one KVCache of equal rows, no mask")
            for rows in ROW_COUNTS:
                same = prompt(args.context)
                for form in ("matmul", "rows") if run == 0 else ("rows", "matmul"):
                    set_form(model, form)
                    cache = prefilled([same] * rows)
                    line(form, rows, pipelined_steps(model, cache, mx.array([same[-1]] * rows), args.steps)[2:])
    if "batch" in parts:
        for run in range(2):
            print(f"batch, run {run}: mlx-lm BatchGenerator, rows {args.context}-{args.context + 49} tokens deep")
            for rows in ROW_COUNTS:
                prompts = [prompt(args.context + 7 * i) for i in range(rows)]
                for form in ("matmul", "rows") if run == 0 else ("rows", "matmul"):
                    set_form(model, form)
                    singles = [prefilled([p[:-1]]) for p in prompts]
                    generator = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
                    generator.insert([p[-1:] for p in prompts], max_tokens=[args.steps + 4] * rows, caches=singles)
                    times = []
                    for _ in range(args.steps):
                        started = time.perf_counter()
                        generator.next()
                        times.append((time.perf_counter() - started) * 1000)
                    line(form, rows, times[2:])
    if "exact" in parts:
        print("exact: 4 rows decoded together vs each alone, greedy, 16 steps; largest |logit difference|")
        prompts = [prompt(200) for _ in range(4)]
        for form in ("matmul", "rows"):
            set_form(model, form)
            alone = []
            for p in prompts:
                cache = prefilled([p[:-1]])
                y, rows_logits = mx.array([p[-1]]), []
                for _ in range(16):
                    logits = model(y[:, None], cache=cache)[:, -1, :].astype(mx.float32)
                    rows_logits.append(logits[0])
                    y = mx.argmax(logits, axis=-1)
                alone.append(mx.stack(rows_logits))
            singles = [prefilled([p[:-1]]) for p in prompts]  # each prompt alone, so only the decode steps differ
            cache = make_prompt_cache(model)
            for layer, single_layers in zip(cache, zip(*singles)):
                layer.keys = mx.concatenate([c.keys[..., : c.offset, :] for c in single_layers])
                layer.values = mx.concatenate([c.values[..., : c.offset, :] for c in single_layers])
                layer.offset = single_layers[0].offset
            y, together = mx.array([p[-1] for p in prompts]), []
            for _ in range(16):
                logits = model(y[:, None], cache=cache)[:, -1, :].astype(mx.float32)
                together.append(logits)
                # each row follows its own greedy path alone, so the inputs stay the same as alone
                y = mx.array([int(mx.argmax(alone[i][len(together) - 1]).item()) for i in range(4)])
            together = mx.stack(together, axis=1)
            worst = max(mx.max(mx.abs(together[i] - alone[i])).item() for i in range(4))
            print(f"  {form:<7} largest difference {worst:.6g}", flush=True)
    set_form(model, "matmul")
    return 0


if __name__ == "__main__":
    sys.exit(main())
