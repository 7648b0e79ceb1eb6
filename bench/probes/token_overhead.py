#!/usr/bin/env python
"""The daemon's own cost per decoded token: its decode rate against in-process mlx-lm's, same model and prompt.

    python bench/probes/token_overhead.py MODEL_DIR [MODEL_DIR ...] [--tokens 200] [--rounds 3]

For each model: greedy answers of ``--tokens`` tokens to one prompt, the
daemon's (over its socket, its own decode timing: second token to last) and
mlx-lm's ``stream_generate`` in this process, alternating, ``--rounds`` each.
The difference of the per-token times is what the daemon adds per token that
the device's work does not hide (its Python per step, detokenizing, stop
checks, handing events to the front). A model whose step is short shows it in
its ratio; a model whose step is long hides it (issue 13: on the H200 lfm2's
step is 2.3 ms in process, and its decode ran at 0.65-0.88x in-process).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for harness

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from harness import Daemon, connect, timed_generate  # noqa: E402

PROMPT = "Write a long story about a river, a stone and a lamp. Take your time and describe every detail."


def in_process_rate(model, tokenizer, tokens: int) -> float:
    """Tokens per second from the second token to the last, as the daemon counts."""
    first_at = last_at = None
    count = 0
    for response in stream_generate(model, tokenizer, PROMPT, max_tokens=tokens, sampler=make_sampler(0.0)):
        now = time.perf_counter()
        count += 1
        if first_at is None:
            first_at = now
        last_at = now
    return (count - 1) / (last_at - first_at) if count > 1 and last_at > first_at else 0.0


def daemon_rate(conn, tokens: int) -> float:
    """Tokens per second at the client, from the first streamed token to the end of the reply."""
    reply = timed_generate(conn, prompt=PROMPT, max_tokens=tokens, temperature=0, cache={"use": False, "store": False})
    seconds = (reply["client_total_ms"] - reply["client_ttft_ms"]) / 1000
    return (reply["usage"]["completion_tokens"] - 1) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"device {mx.default_device()}, mlx {mx.__version__}, {args.tokens} tokens, {args.rounds} rounds")
    print("model                      in-process tok/s  daemon tok/s  ratio  per token: in-process ms  daemon ms  added ms")
    for model_dir in args.models:
        model, tokenizer = load(model_dir)
        in_process_rate(model, tokenizer, 8)  # first-call setup
        ours, theirs = [], []
        with tempfile.TemporaryDirectory() as workdir, Daemon(Path(model_dir), Path(workdir)) as daemon:
            with connect(daemon.socket_path) as conn:
                daemon_rate(conn, 8)
                for _ in range(args.rounds):
                    ours.append(daemon_rate(conn, args.tokens))
                    theirs.append(in_process_rate(model, tokenizer, args.tokens))
        a, b = statistics.median(theirs), statistics.median(ours)
        print(f"{Path(model_dir).name:26s} {a:16.1f} {b:13.1f} {b / a:6.2f}  {1000 / a:24.2f} {1000 / b:10.2f} "
              f"{1000 / b - 1000 / a:9.2f}")
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
