#!/usr/bin/env python
"""Does a hybrid model's short convolution cost a build per new tail length on CUDA, and would shifts avoid it?

    python bench/probes/conv_shape_probe.py MODEL_DIR [--context 1000] [--json OUT]     (an LFM2-family model)

On the H200 (bench/results/gpu/2026-12-04-c, run 5, lfm2-quick) a chat turn's
tail of 32 tokens took 29.9 ms when a tail of that length had run before and
262.6-278.5 ms when its length was new, about ten times what a new length
costs the attention-only model. LFM2's ShortConv layers run ``nn.Conv1d``
(depthwise, kernel ``conv_L_cache``), which MLX's CUDA backend hands to cuDNN;
the suspect is a cuDNN plan built per new input length. A depthwise
convolution of a 3-wide kernel is also three shifted multiply-adds
(elementwise kernels, nothing built per shape).

On a warm cache of ``--context`` tokens (a copy of one prefilled cache per
pass), for tails of new lengths: the first pass and a repeat with MLX's
convolution, then, at other new lengths, with the shifted form (the daemon's,
daemon/models/short_conv.py); the largest logit difference between the two
forms on the same tail; and decode steps of 1 and 4 rows with each form
(twice each, alternating), since a decode step's convolution has a fixed
shape and the shifted form is more kernels.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from prefixd.daemon.models.blas import preload_blas

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from prefixd.daemon.models.short_conv import ShiftedDepthwiseConv  # noqa: E402 (the daemon's form on CUDA)


def short_convs(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "ShortConv"]


def timed_tail(model, ready: list, tokens: list[int]) -> tuple[float, mx.array]:
    cache = copy.deepcopy(ready)
    mx.eval([c.state for c in cache])
    started = time.perf_counter()
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    mx.eval(logits, [c.state for c in cache])
    return (time.perf_counter() - started) * 1000, logits


def timed_decode(model, context: list[int], rows: int, token: int, steps: int) -> list[float]:
    """Greedy decode steps of ``rows`` sequences on ``context``, each step evaluated before the next."""
    cache = make_prompt_cache(model)
    model(mx.array([context] * rows), cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[token]] * rows)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)[:, None]
        mx.eval(y)
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--json")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    convs = short_convs(model)
    if not convs:
        print(f"{args.model}: no ShortConv layers (an LFM2-family model is needed)")
        return 2
    stock = [c.conv for c in convs]
    shifted = [ShiftedDepthwiseConv(c.conv) for c in convs]

    def use(forms) -> None:
        for layer, form in zip(convs, forms):
            layer.conv = form

    rng = __import__("random").Random(0)
    tokens = [rng.randrange(100, min(30000, len(tokenizer.vocab))) for _ in range(args.context + 400)]
    ready = make_prompt_cache(model)
    model(mx.array(tokens[: args.context])[None], cache=ready)
    mx.eval([c.state for c in ready])
    timed_tail(model, ready, tokens[args.context : args.context + 20])  # the first tail pass of the process
    tail = tokens[args.context :]
    out: dict = {"device": str(mx.default_device()), "mlx": mx.__version__, "context": args.context, "rows": []}
    print(f"device {mx.default_device()}, mlx {mx.__version__}, {len(convs)} ShortConv layers, context {args.context}")
    print("tail   form      first ms  repeat ms")
    for form_name, forms, lengths in (("conv1d", stock, (23, 37, 51, 66, 83)), ("shifted", shifted, (24, 38, 52, 67, 84))):
        use(forms)
        for n in lengths:
            first, _ = timed_tail(model, ready, tail[:n])
            repeat = statistics.median(timed_tail(model, ready, tail[:n])[0] for _ in range(3))
            out["rows"].append({"form": form_name, "tail": n, "first_ms": first, "repeat_ms": repeat})
            print(f"{n:4d}   {form_name:8s} {first:9.1f} {repeat:10.1f}")
    diffs = []
    for n in (23, 52):
        use(stock)
        _, a = timed_tail(model, ready, tail[:n])
        use(shifted)
        _, b = timed_tail(model, ready, tail[:n])
        diff = float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))
        same = int(mx.argmax(a)) == int(mx.argmax(b))
        diffs.append({"tail": n, "max_abs_diff": diff, "same_argmax": same})
        print(f"tail {n}: largest logit difference conv1d vs shifted {diff:.4g}, same argmax {same}")
    print("decode steps (greedy, on the warm cache), ms per step: rows  form  median  (first 3 steps)")
    out["decode"] = []
    for rows in (1, 4):
        for form_name, forms in (("conv1d", stock), ("shifted", shifted), ("conv1d", stock), ("shifted", shifted)):
            use(forms)
            times = timed_decode(model, tokens[: args.context], rows, tokens[args.context], steps=48)
            out["decode"].append({"rows": rows, "form": form_name, "step_ms": times})
            print(f"   {rows}  {form_name:8s} {statistics.median(times[3:]):6.2f}  ("
                  + " ".join(f"{t:.1f}" for t in times[:3]) + ")")
    use(stock)
    out["differences"] = diffs
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
