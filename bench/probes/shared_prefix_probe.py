#!/usr/bin/env python
"""What a fork without a copy would cost attention: stored pieces read in place against today's copy.

    python bench/probes/shared_prefix_probe.py MODEL_DIR [--depths 1024,4096,16384] [--queries 1,16] [--json OUT]

Issue 32 asks that a cache hit make a table of the stored segments instead of
copying them into a fresh cache (kv/fork.py copies today). Without a kernel
of its own, attention then reads the pieces with plain ops: one score matmul
per piece, one softmax over the joined scores, one weighted sum per piece.
This probe times, for the model's own attention shape (heads, KV heads, head
dimension, dtype from MODEL_DIR's config.json; no weights are read) and all
of its layers in one evaluation, as a forward pass would run them:

* ``fused``: MLX's fused attention on one contiguous cache (what runs after today's fork);
* ``pieces``: the plain-ops form over the stored pieces plus the sequence's own
  tail of 40 tokens, for pieces of the prefill chunk's size, for many small
  pieces (a long chat's messages and answers), and for one joined piece;
* ``fork copy``: today's fork of the same pieces (their concatenation plus
  256 tokens of headroom), evaluated alone.

A query length of 1 is a decode step or an exact hit's last token; 16 a short
tail. Figures are medians in ms per forward pass (every layer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO.parent))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402

TAIL_TOKENS = 40
HEADROOM_TOKENS = 256


def attention_shape(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    return {
        "layers": config["num_hidden_layers"],
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "dtype": "float32" if mx.default_device() == mx.cpu else config.get("torch_dtype", "bfloat16"),
    }


def pieces_attention(queries, pieces_k, pieces_v, tail_k, tail_v, scale: float) -> mx.array:
    """softmax over every piece's scores at once, then one weighted sum per piece (grouped-query heads)."""
    batch, heads, num_queries, head_dim = queries.shape
    kv_heads = tail_k.shape[1]
    repeats = heads // kv_heads
    grouped = (queries * scale).reshape(batch, kv_heads, repeats, num_queries, head_dim)
    keys = [mx.expand_dims(k, 2) for k in [*pieces_k, tail_k]]
    values = [mx.expand_dims(v, 2) for v in [*pieces_v, tail_v]]
    scores = [grouped @ k.swapaxes(-1, -2) for k in keys]
    if num_queries > 1:  # causal within the tail; every piece lies before every query
        positions = mx.arange(tail_k.shape[2] - num_queries, tail_k.shape[2])
        scores[-1] = mx.where(positions[:, None] >= mx.arange(tail_k.shape[2])[None], scores[-1], -mx.inf)
    weights = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1, precise=True).astype(queries.dtype)
    out, start = None, 0
    for v in values:
        part = weights[..., start : start + v.shape[-2]] @ v
        out = part if out is None else out + part
        start += v.shape[-2]
    return out.reshape(batch, heads, num_queries, head_dim)


def median_ms(run, repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measure(shape: dict, depth: int, num_pieces: int, num_queries: int, repeats: int) -> dict:
    dtype = getattr(mx, shape["dtype"])
    kv, dim, layers = shape["kv_heads"], shape["head_dim"], shape["layers"]
    scale = dim**-0.5
    sizes = [depth // num_pieces] * num_pieces
    sizes[-1] += depth - sum(sizes)

    def normal(*dims):
        return mx.random.normal(dims).astype(dtype)

    # One set of pieces per layer, as the store holds them.
    pieces_k = [[normal(1, kv, n, dim) for n in sizes] for _ in range(layers)]
    pieces_v = [[normal(1, kv, n, dim) for n in sizes] for _ in range(layers)]
    tail_k = [normal(1, kv, TAIL_TOKENS, dim) for _ in range(layers)]
    tail_v = [normal(1, kv, TAIL_TOKENS, dim) for _ in range(layers)]
    joined_k = [mx.concatenate([*p, t], axis=2) for p, t in zip(pieces_k, tail_k)]
    joined_v = [mx.concatenate([*p, t], axis=2) for p, t in zip(pieces_v, tail_v)]
    queries = [normal(1, shape["heads"], num_queries, dim) for _ in range(layers)]
    mx.eval(pieces_k, pieces_v, tail_k, tail_v, joined_k, joined_v, queries)
    mask = "causal" if num_queries > 1 else None

    def fused():
        mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) for q, k, v in zip(queries, joined_k, joined_v)])

    def pieces():
        mx.eval([pieces_attention(q, pk, pv, tk, tv, scale) for q, pk, pv, tk, tv in zip(queries, pieces_k, pieces_v, tail_k, tail_v)])

    def fork_copy():
        headroom = mx.zeros((1, kv, HEADROOM_TOKENS, dim), dtype)
        mx.eval([mx.concatenate([*p, headroom], axis=2) for p in pieces_k + pieces_v])

    # The two forms agree (a check that the plain form is the same attention).
    q, pk, pv, tk, tv, k, v = queries[0], pieces_k[0], pieces_v[0], tail_k[0], tail_v[0], joined_k[0], joined_v[0]
    reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32)
    difference = mx.abs(pieces_attention(q, pk, pv, tk, tv, scale).astype(mx.float32) - reference).max().item()
    row = {
        "depth": depth,
        "pieces": num_pieces,
        "queries": num_queries,
        "fused_ms": median_ms(fused, repeats),
        "pieces_ms": median_ms(pieces, repeats),
        "fork_copy_ms": median_ms(fork_copy, repeats) if num_queries == 1 else None,
        "max_abs_difference": difference,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--depths", default="1024,4096,16384")
    parser.add_argument("--queries", default="1,16")
    parser.add_argument("--chunk", type=int, default=None, help="stored piece size (default: 512 on a CPU, 2048 on a GPU)")
    parser.add_argument("--small-pieces", type=int, default=36, help="how many pieces a long chat's path has")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shape = attention_shape(args.model_dir)
    chunk = args.chunk or (512 if mx.default_device() == mx.cpu else 2048)
    print(f"device {mx.default_device()}, mlx {mx.__version__}; attention shape {shape}; tail {TAIL_TOKENS} tokens")
    print("ms per forward pass (all layers): fused on a contiguous cache | plain ops over the pieces | today's fork copy")
    print(f"{'depth':>6} {'pieces':>6} {'queries':>7} {'fused':>8} {'pieces':>8} {'ratio':>6} {'fork copy':>9} {'max diff':>9}")
    rows = []
    for depth in [int(d) for d in args.depths.split(",")]:
        for num_queries in [int(q) for q in args.queries.split(",")]:
            for num_pieces in sorted({1, max(1, depth // chunk), args.small_pieces}):
                row = measure(shape, depth, num_pieces, num_queries, args.repeats)
                rows.append(row)
                mx.clear_cache()
                copy = "" if row["fork_copy_ms"] is None else f"{row['fork_copy_ms']:.2f}"
                print(
                    f"{depth:>6} {num_pieces:>6} {num_queries:>7} {row['fused_ms']:>8.2f} {row['pieces_ms']:>8.2f} "
                    f"{row['pieces_ms'] / row['fused_ms']:>6.2f} {copy:>9} {row['max_abs_difference']:>9.1e}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "device": str(mx.default_device()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
