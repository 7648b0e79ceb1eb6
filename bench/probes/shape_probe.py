#!/usr/bin/env python
"""What a forward pass at a length MLX has not run before costs, and whether padding to a few lengths avoids it.

    python bench/probes/shape_probe.py MODEL_DIR [--context 3000] [--json OUT]

On a GPU, chat and editor tails always have new lengths, and the first pass at
a new length was seen to cost 60-130 ms more than a repeat (issue 13). This
probe separates what that cost depends on, on a warm cache of ``--context``
tokens (a fork of one prefilled cache, as prefixd makes it):

1. tails of new lengths: first pass vs an immediate repeat of the same length;
2. the same tail length at another cache depth: is the cost per tail length, or
   per (depth, length)?
3. tails padded up to a multiple of 64 (padding after the real tokens, then the
   cache trimmed back): first pass at a padded length already seen, and the
   largest difference of the real tokens' last logits against the unpadded pass;
4. one decode step at new cache depths (first vs repeat);
5. tails of new lengths with an explicit boolean mask instead of mlx-lm's
   "causal" (which takes MLX's fused attention for a multi-token pass): does
   the first-pass cost belong to that kernel?
6. tails of new lengths at new depths through prefixd's matmul form of
   attention (daemon/models/tail_attention.py, the daemon's default on CUDA):
   first pass, repeat, and the largest logit difference against MLX's fused
   attention (on CUDA, MLX builds a cuDNN graph per new (query, key) shape);
7. what a first pass still costs in the matmul form: the same tail length at
   new depths, new tail lengths at one depth, tails padded to a multiple of 64
   at new depths (run it with MLX_USE_CUDA_GRAPHS=0 too: is it graph capture?).
``--parts 6,7`` runs only those parts. Prints a table per part; timings are medians where repeated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

BUCKET = 64


def fork(model, base: list) -> list:
    """A cache holding the base's KV, one copy, as prefixd's fork makes it."""
    cache = make_prompt_cache(model)
    for layer, stored in zip(cache, base):
        keys, values, offset = stored
        layer.keys, layer.values, layer.offset = mx.array(keys), mx.array(values), offset
    return cache


def timed_pass(model, base, tokens: list[int], pad_to: int | None = None) -> tuple[float, mx.array]:
    cache = fork(model, base)
    mx.eval([c.keys for c in cache])
    inputs = tokens + [0] * ((pad_to or len(tokens)) - len(tokens))
    started = time.perf_counter()
    logits = model(mx.array(inputs)[None], cache=cache)[0, len(tokens) - 1]
    if pad_to:
        for c in cache:
            c.trim(pad_to - len(tokens))
    mx.eval(logits, [c.keys for c in cache])
    return (time.perf_counter() - started) * 1000, logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--json")
    parser.add_argument("--parts", default="1,2,3,4,5,6,7", help="which parts to run, e.g. 6,7")
    args = parser.parse_args()
    parts = {int(part) for part in args.parts.split(",")}
    model, tokenizer = load(args.model)
    vocab = len(tokenizer.vocab)
    rng = __import__("random").Random(0)
    tokens = [rng.randrange(min(100, vocab // 2), min(vocab, 30000)) for _ in range(args.context + 600)]

    def prefill(n: int) -> list:
        cache = make_prompt_cache(model)
        model(mx.array(tokens[:n])[None], cache=cache)
        mx.eval([c.state for c in cache])
        return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset) for c in cache]

    prefill(args.context)  # the first pass at this length is not what is measured
    base = prefill(args.context)
    base_other = prefill(args.context + 37)
    out: dict = {"device": str(mx.default_device()), "context": args.context, "mlx": mx.__version__}
    tail = tokens[args.context + 40:]

    print(f"device {mx.default_device()}, mlx {mx.__version__}, context {args.context} tokens")
    if 1 in parts:
        part_new_lengths(model, base, tail, out)
    if 2 in parts:
        part_other_depth(model, base_other, tail, out)
    if 3 in parts:
        part_padded(model, base, tail, out)
    if 4 in parts:
        part_decode_depths(model, prefill, tail, args.context, out)
    if 5 in parts:
        part_array_mask(model, base, tail, out)
    if 6 in parts:
        part_matmul_form(model, prefill, tail, args.context, out)
    if 7 in parts:
        part_matmul_residual(model, prefill, tail, args.context, out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def part_new_lengths(model, base, tail, out) -> None:
    print("\n1. tails of new lengths (ms): first pass, repeat")
    rows = []
    for n in (37, 38, 61, 83, 97, 130, 201, 333):
        first, _ = timed_pass(model, base, tail[:n])
        repeat = statistics.median(timed_pass(model, base, tail[:n])[0] for _ in range(3))
        rows.append({"tail": n, "first_ms": first, "repeat_ms": repeat})
        print(f"   tail {n:4d}: first {first:8.1f}  repeat {repeat:7.1f}")
    out["new_lengths"] = rows


def part_other_depth(model, base_other, tail, out) -> None:
    print("\n2. the same tail lengths at another depth (context + 37): first pass")
    rows = []
    for n in (37, 61, 97):
        first, _ = timed_pass(model, base_other, tail[:n])
        rows.append({"tail": n, "first_ms": first})
        print(f"   tail {n:4d}: first {first:8.1f}")
    out["other_depth"] = rows


def part_padded(model, base, tail, out) -> None:
    print(f"\n3. tails padded to a multiple of {BUCKET} (ms, first pass of a new real length) and logit difference")
    rows = []
    for n in (40, 45, 50, 70, 90, 110, 150, 170):  # new real lengths, padded lengths 64/128/192
        padded = -(-n // BUCKET) * BUCKET
        first, logits_padded = timed_pass(model, base, tail[:n], pad_to=padded)
        _, logits_plain = timed_pass(model, base, tail[:n])
        diff = float(mx.max(mx.abs(logits_padded.astype(mx.float32) - logits_plain.astype(mx.float32))))
        scale = float(mx.max(mx.abs(logits_plain.astype(mx.float32))))
        same_argmax = int(mx.argmax(logits_padded)) == int(mx.argmax(logits_plain))
        rows.append({"tail": n, "padded": padded, "first_ms": first, "max_abs_diff": diff, "scale": scale,
                     "same_argmax": same_argmax})
        print(f"   tail {n:4d} -> {padded:4d}: first {first:8.1f}  max |diff| {diff:.4g} of {scale:.3g}  same argmax {same_argmax}")
    out["padded"] = rows


def part_decode_depths(model, prefill, tail, context, out) -> None:
    print("\n4. one decode step at new cache depths (ms): first, repeat")
    rows = []
    for extra in (1, 2, 3, 50, 300):
        depth_base = prefill(context + extra)
        first, _ = timed_pass(model, depth_base, tail[:1])
        repeat = statistics.median(timed_pass(model, depth_base, tail[:1])[0] for _ in range(3))
        rows.append({"depth": context + extra, "first_ms": first, "repeat_ms": repeat})
        print(f"   depth {context + extra:5d}: first {first:7.1f}  repeat {repeat:7.1f}")
    out["decode_depths"] = rows


def part_array_mask(model, base, tail, out) -> None:
    print("\n5. tails of new lengths with an explicit array mask (ms): first, repeat")
    from mlx_lm.models import cache as cache_module

    original = cache_module.KVCache.make_mask
    cache_module.KVCache.make_mask = lambda self, *a, **k: original(self, *a, **{**k, "return_array": True})
    rows = []
    try:
        for n in (41, 67, 99, 141, 229):
            first, logits_masked = timed_pass(model, base, tail[:n])
            repeat = statistics.median(timed_pass(model, base, tail[:n])[0] for _ in range(3))
            cache_module.KVCache.make_mask = original
            _, logits_causal = timed_pass(model, base, tail[:n])
            cache_module.KVCache.make_mask = lambda self, *a, **k: original(self, *a, **{**k, "return_array": True})
            diff = float(mx.max(mx.abs(logits_masked.astype(mx.float32) - logits_causal.astype(mx.float32))))
            rows.append({"tail": n, "first_ms": first, "repeat_ms": repeat, "max_abs_diff_vs_causal": diff})
            print(f"   tail {n:4d}: first {first:8.1f}  repeat {repeat:7.1f}  max |diff| vs causal {diff:.4g}")
    finally:
        cache_module.KVCache.make_mask = original
    out["array_mask"] = rows


def part_matmul_form(model, prefill, tail, context, out) -> None:
    print("\n6. tails of new lengths at new depths, matmul form of attention (ms): first, repeat, fused first")
    from prefixd.daemon.models import tail_attention

    rows = []
    for n, extra in ((43, 5), (71, 9), (103, 13), (157, 21), (251, 29)):
        depth_base = prefill(context + extra)
        tail_attention.install(model, "matmul")
        first, logits_matmul = timed_pass(model, depth_base, tail[:n])
        repeat = statistics.median(timed_pass(model, depth_base, tail[:n])[0] for _ in range(3))
        tail_attention.install(model, "fused")
        fused_first, logits_fused = timed_pass(model, depth_base, tail[:n])
        diff = float(mx.max(mx.abs(logits_matmul.astype(mx.float32) - logits_fused.astype(mx.float32))))
        same_argmax = int(mx.argmax(logits_matmul)) == int(mx.argmax(logits_fused))
        rows.append({"tail": n, "depth": context + extra, "first_ms": first, "repeat_ms": repeat,
                     "fused_first_ms": fused_first, "max_abs_diff_vs_fused": diff, "same_argmax": same_argmax})
        print(f"   tail {n:4d} at {context + extra:5d}: first {first:7.1f}  repeat {repeat:7.1f}  "
              f"fused first {fused_first:7.1f}  max |diff| {diff:.4g}  same argmax {same_argmax}")
    out["matmul_form"] = rows


def part_matmul_residual(model, prefill, tail, context, out) -> None:
    import os

    from prefixd.daemon.models import tail_attention

    graphs = os.environ.get("MLX_USE_CUDA_GRAPHS", "1 (default)")
    print(f"\n7. what a first pass still costs in the matmul form (ms; MLX_USE_CUDA_GRAPHS={graphs})")
    tail_attention.install(model, "matmul")
    rows = []

    def row(kind: str, n: int, depth_base, depth: int, pad_to: int | None = None) -> None:
        first, _ = timed_pass(model, depth_base, tail[:n], pad_to=pad_to)
        repeat = statistics.median(timed_pass(model, depth_base, tail[:n], pad_to=pad_to)[0] for _ in range(3))
        rows.append({"kind": kind, "tail": n, "padded": pad_to, "depth": depth, "first_ms": first, "repeat_ms": repeat})
        padded = f" -> {pad_to}" if pad_to else ""
        print(f"   {kind:24s} tail {n:4d}{padded:8s} at {depth:5d}: first {first:7.1f}  repeat {repeat:7.1f}")

    seen = prefill(context + 101)
    row("warm-up (new length)", 60, seen, context + 101)
    for extra in (103, 107, 109):
        row("seen length, new depth", 60, prefill(context + extra), context + extra)
    for n in (61, 77, 95):
        row("new length, seen depth", n, seen, context + 101)
    for n, extra in ((50, 113), (55, 127), (58, 131)):
        row("padded to 64, new depth", n, prefill(context + extra), context + extra, pad_to=BUCKET)
    tail_attention.install(model, "fused")
    out["matmul_residual"] = {"cuda_graphs": graphs, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
