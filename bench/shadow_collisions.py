#!/usr/bin/env python
"""Do back-to-back requests wait behind the shadow check?

    python bench/shadow_collisions.py [MODEL_DIR] [--requests 14] [--shadow-rate 1]

A client that sends its next request as soon as an answer ends (a chat, an
agent's loop) finds the engine idle for a moment, and a pending shadow check
(an idle-time re-run of a cache hit without the cache, one uninterruptible
pass at a time) may start in that moment. This sends ``--requests`` exact
hits of two alternating ~500-token prompts back to back through the real
daemon with ``--shadow-rate`` (1: every greedy hit is checked) and prints the
client's TTFT of each, the warm p50 and maximum, and the shadow check's
counters afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from harness import Daemon, connect, timed_generate

DEFAULT_MODEL = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=14)
    parser.add_argument("--shadow-rate", default="1")
    args = parser.parse_args()
    text = " ".join(["river stone cloud garden lamp window copper violet"] * 60)
    with tempfile.TemporaryDirectory() as workdir, \
            Daemon(args.model, Path(workdir), ["--shadow-rate", args.shadow_rate]) as daemon, \
            connect(daemon.socket_path) as conn:
        ttfts = [timed_generate(conn, prompt=f"{text} {i % 2}", max_tokens=4, temperature=0)["client_ttft_ms"]
                 for i in range(args.requests)]
        warm = ttfts[2:]  # from the third on: exact hits (the first is cold, the second a partial hit)
        print("client TTFT ms:", " ".join(f"{t:.0f}" for t in ttfts))
        print(f"warm p50 {statistics.median(warm):.0f} ms, max {max(warm):.0f} ms")
        print("shadow:", conn.stats().get("shadow"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
