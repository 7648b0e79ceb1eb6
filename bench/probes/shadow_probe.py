#!/usr/bin/env python
"""What the shadow check costs real requests, and how far healthy cached runs drift from uncached ones.

    python bench/probes/shadow_probe.py MODEL_DIR [--context 2000] [--rounds 8] [--prefill-chunk 512]

Part 1, drift: ``prefixd verify``'s built-in prompt set (an exact repeat,
partial hits at three depths, a chat's next turn, an edit near the end) on a
daemon with the shadow check off; each reply's ``verify`` map gives the
largest log-probability difference between the cached and the uncached run,
printed per checkpoint kind beside the tolerance the daemon applies.

Part 2, delay: a daemon with ``--shadow-rate 1``. Each round sends a long
prompt twice (the repeat is a hit, so its shadow run, a full uncached
prefill of the context in chunk-sized passes, starts once the engine is
idle), then, at a random moment inside that run, a short new prompt whose
client TTFT is timed; the same short request on an idle engine (no check
pending) is the baseline. The shadow check runs one pass at a time and only
while nothing is queued, so the probe should wait at most one pass: the
figure printed is the extra wait beside the longest shadow pass the daemon
timed (``stats.shadow.longest_pass_ms``; a later pass of a long prompt
costs more than an early one, its attention spans more positions).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import Daemon, connect, timed_generate  # noqa: E402
from prefixd.client.verify_command import builtin_checks  # noqa: E402


def drift(model_dir: Path, workdir: Path) -> None:
    with Daemon(model_dir, workdir, ["--shadow-rate", "0"]) as daemon, connect(daemon.socket_path) as client:
        checks = list(builtin_checks(client, {"max_tokens": 16, "temperature": 0.0}, nonce=f"{random.getrandbits(32):08x}"))
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for check in checks:
        by_kind[check.checkpoint or "(none)"].append(check.verify)
    print("drift: cached vs uncached, the prompt's last log-probabilities (top 8 of the uncached run)")
    for kind, verdicts in sorted(by_kind.items()):
        compared = [v for v in verdicts if v.get("max_logprob_difference") is not None]
        worst = max((v["max_logprob_difference"] for v in compared), default=None)
        statuses = ", ".join(f"{s} {sum(v['status'] == s for v in verdicts)}" for s in sorted({v["status"] for v in verdicts}))
        tolerance = next((v["tolerance"] for v in compared), None)
        print(f"  {kind:<12} {statuses:<28} max |d logprob| {_num(worst)} nats (tolerance {_num(tolerance)})")


def delay(model_dir: Path, workdir: Path, context: int, rounds: int, chunk: int) -> None:
    rng = random.Random(0)
    words = ("cache", "prefix", "engine", "shadow", "token", "store", "radix", "batch", "window", "state")
    with Daemon(model_dir, workdir, ["--shadow-rate", "1", "--prefill-chunk", str(chunk)]) as daemon, \
            connect(daemon.socket_path) as client:
        def long_prompt(index: int) -> str:
            body = " ".join(rng.choice(words) for _ in range(context))
            return f"Round {index}. {body}"

        def probe(index: int, tag: str) -> float:
            reply = timed_generate(client, prompt=f"{tag} probe {index}: {rng.random()}", max_tokens=1)
            return reply["client_ttft_ms"]

        def wait_idle() -> None:
            while client.stats()["shadow"]["pending"]:
                time.sleep(0.02)

        probe(-1, "warm-up")
        idle_ms, during_ms, run_ms = [], [], []
        for index in range(rounds):
            prompt = long_prompt(index)
            cold = client.generate(prompt=prompt, max_tokens=1)
            wait_idle()
            idle_ms.append(probe(index, "idle"))
            client.generate(prompt=prompt, max_tokens=1)  # the hit: its shadow run starts now
            started = time.perf_counter()
            time.sleep(rng.uniform(0, 0.8) * cold["timings"]["prefill_ms"] / 1000)
            during_ms.append(probe(index, "during"))
            wait_idle()
            run_ms.append((time.perf_counter() - started) * 1000)
            print(f"  round {index}: {cold['cache']['prompt_tokens']} prompt tokens; probe TTFT idle {idle_ms[-1]:7.1f} ms, "
                  f"during a shadow run {during_ms[-1]:7.1f} ms; the run took {run_ms[-1]:6.1f} ms")
        shadow = client.stats()["shadow"]
    longest = shadow["longest_pass_ms"]
    extra = [d - i for d, i in zip(during_ms, idle_ms)]
    print(f"delay: probe TTFT median idle {statistics.median(idle_ms):.1f} ms, during {statistics.median(during_ms):.1f} ms; "
          f"extra wait median {statistics.median(extra):.1f} ms, max {max(extra):.1f} ms; "
          f"longest shadow pass {longest:.1f} ms -> max extra = {max(extra) / longest:.2f} of it")
    print(f"shadow stats: {shadow['per_model']}")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--context", type=int, default=2000, help="words in each round's long prompt")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pfx-shadow-") as workdir:
        drift(args.model, Path(workdir))
        delay(args.model, Path(workdir), args.context, args.rounds, args.prefill_chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
