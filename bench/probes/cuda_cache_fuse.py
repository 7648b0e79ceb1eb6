#!/usr/bin/env python
"""MLX's CUDA cache-thrashing fuse, and whether prefixd survives it (a GPU probe).

    python bench/probes/cuda_cache_fuse.py MODEL_DIR [--prompts 16] [--cache-size 4]

MLX's CUDA backend keeps cuDNN attention graphs in an LRU cache keyed by exact
shapes and, unless MLX_ENABLE_CACHE_THRASHING_CHECK=0, raises "Cache thrashing
is happening" on every miss once a process has missed more than twice the
capacity (daemon/models/mlx_runtime_env.py says why a daemon meets that).
The default capacity is 256, so a real daemon trips it after about 512
distinct cold-prompt shapes; this probe shrinks the cache
(MLX_CUDA_SDPA_CACHE_SIZE) so a few prompts show the same thing:

1. in-process mlx-lm: cold prefills of distinct lengths, with MLX's default
   check and with it off: how many passes raised, and the first error;
2. the daemon (--attention fused, so every cold prompt takes cuDNN): distinct
   cold prompts with the daemon's own default (check off) and with the
   operator forcing the check on: how many requests failed, and whether the
   engine still answered afterwards.
On a CPU (no cuDNN) both parts show no failures and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for harness

from harness import Daemon, connect, timed_generate  # noqa: E402

THRASH_ENV = "MLX_ENABLE_CACHE_THRASHING_CHECK"

IN_PROCESS = r"""
import json, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
model, _ = load(sys.argv[1])
failures, first_error = 0, None
for n in range(int(sys.argv[2])):
    length = 300 + 37 * n  # a new (query, key) shape every time
    try:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[100 + (i * 7) % 5000 for i in range(length)]]), cache=cache))
    except Exception as exc:  # what MLX raises out of an evaluation
        failures += 1
        first_error = first_error or str(exc)[:200]
print(json.dumps({"device": str(mx.default_device()), "passes": int(sys.argv[2]), "failures": failures,
                  "first_error": first_error}))
"""


def in_process(model: str, prompts: int, cache_size: int, check: str | None) -> dict:
    env = {**os.environ, "MLX_CUDA_SDPA_CACHE_SIZE": str(cache_size)}
    env.pop(THRASH_ENV, None)
    if check is not None:
        env[THRASH_ENV] = check
    done = subprocess.run([sys.executable, "-c", IN_PROCESS, model, str(prompts)], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"exit": done.returncode, "stderr": done.stderr[-600:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def through_daemon(model: str, prompts: int, cache_size: int, check: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="prefixd-fuse-") as workdir:
        daemon = Daemon(Path(model), Path(workdir), ["--attention", "fused", "--shadow-rate", "0"])
        daemon.env["MLX_CUDA_SDPA_CACHE_SIZE"] = str(cache_size)
        daemon.env.pop(THRASH_ENV, None)
        if check is not None:
            daemon.env[THRASH_ENV] = check
        failures, first_error, answered_after = 0, None, None
        with daemon, connect(daemon.socket_path, timeout=120) as conn:
            for n in range(prompts):
                tokens = [100 + (i * 11 + n) % 5000 for i in range(300 + 37 * n)]
                try:
                    timed_generate(conn, tokens=tokens, max_tokens=2, cache={"use": False, "store": False})
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    failures += 1
                    first_error = first_error or f"{type(exc).__name__}: {exc}"[:200]
            try:
                timed_generate(conn, tokens=[100, 200, 300, 400], max_tokens=2)
                answered_after = True
            except Exception as exc:  # noqa: BLE001
                answered_after = f"{type(exc).__name__}: {exc}"[:200]
        return {"requests": prompts, "failures": failures, "first_error": first_error,
                "a later request answered": answered_after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--cache-size", type=int, default=4, help="MLX_CUDA_SDPA_CACHE_SIZE for the probe (MLX: 256)")
    args = parser.parse_args()
    print(f"MLX_CUDA_SDPA_CACHE_SIZE={args.cache_size}: the fuse trips after {2 * args.cache_size} misses")
    print("\n1. in-process mlx-lm, cold prefills of distinct lengths")
    for label, check in (("MLX's default (check on)", None), ("check off", "0")):
        print(f"   {label:28s} {json.dumps(in_process(args.model, args.prompts, args.cache_size, check))}")
    print("\n2. prefixd serve --attention fused, distinct cold prompts")
    for label, check in (("prefixd's default (off)", None), ("operator forces it on", "1")):
        print(f"   {label:28s} {json.dumps(through_daemon(args.model, args.prompts, args.cache_size, check))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
