#!/usr/bin/env python
"""A decode batch's attention over left-padded rows: MLX's masked attention against prefixd's kernel.

    python bench/probes/padded_decode_probe.py MODEL_DIR [--context 1000] [--call-contexts 1000,8000,32000] [--steps 40]
        [--parts call,batch,exact]

daemon/models/padded_decode_attention.py runs a decode step over mlx-lm's
left-padded batch cache as one CUDA kernel, where MLX falls back to unfused
operations because of the padding mask. In process, without the daemon, the
model's linear layers in the daemon's CUDA form (row_linear.py):

* part ``call``: one attention call of a decode step (heads and head size of
  the model, 1, 4 and 8 rows about ``--call-contexts`` keys deep, different
  padding), MLX with the mask against the kernel: the daemon's choice of key
  ranges (splits_for), one range (8 and 16 warps) and other range counts;
  median ms of 50 and the largest difference of any form from MLX;
* part ``batch``: a decode step of mlx-lm's BatchGenerator (prefixd's batch)
  of 1, 2, 4 and 8 rows at different depths, ``--attention matmul`` against
  ``kernel`` (the daemon's routing, tail_attention.py), ``kernel-u4`` (its
  key ranges, 4 keys a warp at a time) and ``kernel-1`` (one range per row,
  one key at a time: the kernel before key ranges), alternating, two runs;
* part ``solo``: one sequence decoding alone on its own cache (the daemon's
  solo path) at ``--solo-depths``, MLX's attention against the kernel, with
  how often their greedy tokens agree;
* part ``exact``: 4 rows at different depths decoded together, greedy, 16
  steps, each form: the largest logit difference from each row decoded alone.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402

from batch_step_probe import prefilled_cache, random_prompts  # noqa: E402  (this script's folder is first on sys.path)
from row_linear_probe import line, set_form  # noqa: E402

from prefixd.daemon.models import padded_decode_attention, tail_attention  # noqa: E402

ROW_COUNTS = (1, 2, 4, 8)
BATCH_FORMS = ("matmul", "kernel", "kernel-u4", "kernel-1")
DAEMON_MAX_SPLITS = padded_decode_attention.MAX_SPLITS
DAEMON_SOLO_MIN_KEYS = padded_decode_attention.SOLO_MIN_KEYS
DAEMON_KEYS_PER_STEP = padded_decode_attention.KEYS_PER_STEP


def attention_shape(model) -> tuple[int, int, int]:
    """(query heads, key-value heads, head size) of the model's first attention layer."""
    attn = next(m for m in model.modules() if hasattr(m, "n_kv_heads") and hasattr(m, "n_heads"))
    head_dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
    return attn.n_heads, attn.n_kv_heads, head_dim


def part_call(model, context: int) -> None:
    heads, kv_heads, head_dim = attention_shape(model)
    print(
        f"call: one decode-step attention, {heads} heads / {kv_heads} kv heads / head size {head_dim}, bfloat16,"
        f" about {context} keys; median ms of 50"
    )
    for rows in (1, 4, 8):
        length = context + 7 * (rows - 1)
        shape = (rows, kv_heads, length + 200, head_dim)  # a batch cache's buffer is longer than its filled part
        keys = mx.random.normal(shape, key=mx.random.key(1)).astype(mx.bfloat16)[:, :, :length, :]
        values = mx.random.normal(shape, key=mx.random.key(2)).astype(mx.bfloat16)[:, :, :length, :]
        queries = mx.random.normal((rows, heads, 1, head_dim), key=mx.random.key(3)).astype(mx.bfloat16)
        pads = mx.array([7 * (rows - 1 - i) for i in range(rows)])
        scale = head_dim**-0.5
        mx.eval(keys, values, queries)
        timings = {}
        outputs = {}
        auto = padded_decode_attention.splits_for(length, rows, kv_heads)
        forms = [
            ("mlx masked", padded_decode_attention.reference),
            *([("mlx, no mask (alone)", unmasked)] if rows == 1 else []),
            (f"kernel ({auto} ranges, the daemon's)", padded_decode_attention.attention),
            ("1 range", functools.partial(padded_decode_attention.attention, splits=1)),
            ("1 range, 16 warps", functools.partial(padded_decode_attention.attention, splits=1, warps=16)),
        ]
        if padded_decode_attention.KEYS_PER_STEP != 1:  # the kernel before key ranges, where "1 range" is not it
            forms.append(
                (
                    "1 range, 1 key a step (before key ranges)",
                    functools.partial(padded_decode_attention.attention, splits=1, keys_per_step=1),
                )
            )
        forms += [
            (f"{auto} ranges, {u} key(s) a step", functools.partial(padded_decode_attention.attention, keys_per_step=u))
            for u in (1, 2, 4, 8)
            if u != padded_decode_attention.KEYS_PER_STEP
        ]
        forms += [
            (f"{n} ranges", functools.partial(padded_decode_attention.attention, splits=n))
            for n in (2, 4, 8, 16, 32, 64)
            if n != auto and n * 64 <= length
        ]
        for name, fn in forms:
            outputs[name] = fn(queries, keys, values, pads, scale)
            mx.eval(outputs[name])
            samples = []
            for _ in range(50):
                started = time.perf_counter()
                mx.eval(fn(queries, keys, values, pads, scale))
                samples.append((time.perf_counter() - started) * 1000)
            timings[name] = statistics.median(samples)
        wanted = outputs["mlx masked"].astype(mx.float32)
        worst = max(mx.max(mx.abs(out.astype(mx.float32) - wanted)).item() for out in outputs.values())
        figures = ", ".join(f"{name} {ms:.3f}" for name, ms in timings.items())
        print(f"  rows {rows}: {figures}; largest difference from MLX {worst:.4g}", flush=True)


def unmasked(queries, keys, values, pads, scale):
    """What a sequence decoding alone runs without the kernel: MLX's attention, no mask."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)


def part_solo(model, prompt, depths: list[int], steps: int) -> None:
    """One sequence decoding alone on its own cache (the solo path): MLX's vector kernel against prefixd's."""
    print(
        f"solo: one sequence decoding alone, greedy, {steps} steps; ms per step (median), MLX's attention vs the kernel"
    )
    for depth in depths:
        tokens = prompt(depth)
        results = {}
        for mode in ("matmul", "kernel"):
            set_attention(model, mode)
            padded_decode_attention.SOLO_MIN_KEYS = 0  # every depth, to find where the kernel starts to win
            cache = prefilled_cache(model, [tokens[:-1]])
            y = mx.array([tokens[-1:]])
            times, chosen, first_logits = [], [], None
            before = tail_attention.kernel_steps()
            for _ in range(steps):
                started = time.perf_counter()
                logits = model(y, cache=cache)[:, -1, :]
                y = mx.argmax(logits, axis=-1, keepdims=True)
                mx.eval(y)
                times.append((time.perf_counter() - started) * 1000)
                chosen.append(y.item())
                if first_logits is None:
                    first_logits = logits.astype(mx.float32)
            results[mode] = (statistics.median(times[2:]), chosen, first_logits, tail_attention.kernel_steps() - before)
        padded_decode_attention.SOLO_MIN_KEYS = DAEMON_SOLO_MIN_KEYS
        mlx_ms, mlx_tokens, mlx_logits, _ = results["matmul"]
        kernel_ms, kernel_tokens, kernel_logits, calls = results["kernel"]
        same = sum(a == b for a, b in zip(mlx_tokens, kernel_tokens))
        worst = mx.max(mx.abs(mlx_logits - kernel_logits)).item()
        print(
            f"  {depth:>6} keys: MLX {mlx_ms:6.2f} ms, kernel {kernel_ms:6.2f} ms ({kernel_ms / mlx_ms:.2f}x, {calls} kernel calls);"
            f" same greedy token at {same} of {steps} steps, first step's largest logit difference {worst:.4g}",
            flush=True,
        )


def set_attention(model, mode: str) -> None:
    """``kernel-1``: the kernel as it was before key ranges (one range per row, one key a warp at a time);
    ``kernel-uN``: the daemon's key ranges, N keys a warp at a time."""
    padded_decode_attention.MAX_SPLITS = 1 if mode == "kernel-1" else DAEMON_MAX_SPLITS
    keys_per_step = DAEMON_KEYS_PER_STEP
    if mode == "kernel-1":
        keys_per_step = 1
    elif mode.startswith("kernel-u"):
        keys_per_step = int(mode.removeprefix("kernel-u"))
    padded_decode_attention.KEYS_PER_STEP = keys_per_step
    tail_attention.install(model, "kernel" if mode.startswith("kernel") else mode)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=1000, help="rows' depth in part batch")
    parser.add_argument(
        "--call-contexts", default=None, help="keys per row in part call, comma-separated (default --context)"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--solo-depths", default="1000,2000,4000,8000,16000,32000", help="part solo's cache depths")
    parser.add_argument("--parts", default="call,batch,exact")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model, tokenizer = load(args.model)
    set_form(model, "rows")
    prompt = random_prompts(tokenizer)
    ok, why = padded_decode_attention.agrees()
    print(
        f"device {mx.default_device()}, mlx {mx.__version__}; the kernel {'agrees with MLX' if ok else 'is unavailable: ' + why}"
    )
    if not ok:
        return 1
    if "call" in parts:
        for context in (args.call_contexts or str(args.context)).split(","):
            part_call(model, int(context))
    if "solo" in parts:
        part_solo(model, prompt, [int(d) for d in args.solo_depths.split(",")], args.steps)
    if "batch" in parts:
        for run in range(2):
            print(
                f"batch, run {run}: mlx-lm BatchGenerator, rows {args.context}-{args.context + 49} tokens deep, ms per step"
            )
            for rows in ROW_COUNTS:
                prompts = [prompt(args.context + 7 * i) for i in range(rows)]
                for mode in BATCH_FORMS if run == 0 else BATCH_FORMS[::-1]:
                    set_attention(model, mode)
                    singles = [prefilled_cache(model, [p[:-1]]) for p in prompts]
                    generator = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
                    generator.insert([p[-1:] for p in prompts], max_tokens=[args.steps + 4] * rows, caches=singles)
                    before = tail_attention.kernel_steps()
                    times = []
                    for _ in range(args.steps):
                        started = time.perf_counter()
                        generator.next()
                        times.append((time.perf_counter() - started) * 1000)
                    line(f"{mode} ({tail_attention.kernel_steps() - before} kernel calls)", rows, times[2:])
    if "exact" in parts:
        print(
            "exact: 4 rows at different depths decoded together vs each alone, greedy, 16 steps; largest |logit difference|"
        )
        prompts = [prompt(200 + 37 * i) for i in range(4)]
        for mode in ("matmul", "kernel"):
            set_attention(model, mode)
            alone = []
            for p in prompts:
                cache = prefilled_cache(model, [p[:-1]])
                y, logits_alone = mx.array([p[-1]]), []
                for _ in range(16):
                    logits = model(y[:, None], cache=cache)[:, -1, :].astype(mx.float32)
                    logits_alone.append(logits[0])
                    y = mx.argmax(logits, axis=-1)
                alone.append(mx.stack(logits_alone))
            singles = [prefilled_cache(model, [p[:-1]]) for p in prompts]
            generator = BatchGenerator(model, completion_batch_size=64, prefill_batch_size=64)
            captured = []
            # The batch's logits, step by step: its sampler sees them (log-softmaxed); each row is fed its alone path.
            uids = generator.insert(
                [p[-1:] for p in prompts],
                max_tokens=[17] * 4,
                caches=singles,
                samplers=[lambda lp, i=i: capture(captured, i, lp, alone) for i in range(4)],
            )
            for _ in range(16):
                generator.next()
            worst, compared = 0.0, 0
            for i, steps in enumerate(_by_row(captured, len(uids))):
                reference = alone[i] - mx.logsumexp(alone[i], axis=-1, keepdims=True)
                for step, logprobs in enumerate(steps[:16]):
                    worst = max(worst, mx.max(mx.abs(logprobs - reference[step])).item())
                    compared += 1
            print(f"  {mode:<7} largest log-probability difference {worst:.6g} over {compared} row-steps", flush=True)
    return 0


def capture(captured: list, row: int, logprobs: mx.array, alone: list) -> mx.array:
    """Keep a row's log-probabilities and answer with the token that row chose alone at this step."""
    step = sum(1 for r, _ in captured if r == row)
    captured.append((row, logprobs[0].astype(mx.float32)))
    token = mx.argmax(alone[row][min(step, len(alone[row]) - 1)])
    return token[None]


def _by_row(captured: list, rows: int) -> list[list[mx.array]]:
    out: list[list[mx.array]] = [[] for _ in range(rows)]
    for row, logprobs in captured:
        out[row].append(logprobs)
    return out


if __name__ == "__main__":
    sys.exit(main())
