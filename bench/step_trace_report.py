#!/usr/bin/env python
"""Summarise an engine step trace (PREFIXD_TRACE_STEPS): where the engine's time went, and its longest plans.

    .venv/bin/python bench/step_trace_report.py steps.jsonl [--top 15]

Each plan is put under one kind (what it did: a prefill pass, a decode step,
lookups and forks, finishes, or several) and the kinds are summed; prefill
passes are also grouped by how many tokens they fed and how deep they
started, since a pass's cost grows with both. The longest plans are printed
whole: a bystander's worst wait is one of them, or a run of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def kind_of(line: dict) -> str:
    parts = []
    if line["prefill"]:
        parts.append("prefill")
    if line["decode"]:
        parts.append("decode")
    if line["starts"]:
        parts.append("start")
    if line["joins"]:
        parts.append("join")
    if line["finishes"] or line["drops"]:
        parts.append("finish")
    return "+".join(parts) or "empty"


def size_bin(tokens: int) -> str:
    for limit in (8, 64, 256, 512, 1024):
        if tokens <= limit:
            return f"<={limit}"
    return ">1024"


def depth_bin(depth: int) -> str:
    for limit in (0, 1024, 2048, 4096):
        if depth <= limit:
            return f"<={limit}"
    return ">4096"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    lines = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    if not lines:
        print("empty trace")
        return 1
    total = sum(line["ms"] for line in lines)
    span = (lines[-1]["t"] - lines[0]["t"]) * 1000 + lines[-1]["ms"]
    print(f"{len(lines)} plans, {total:.0f} ms of runs in {span:.0f} ms of wall time ({100 * total / span:.0f}% busy)")
    by_kind: dict[str, list[float]] = defaultdict(list)
    for line in lines:
        by_kind[kind_of(line)].append(line["ms"])
    print(f"\n{'kind':28s} {'plans':>6s} {'total ms':>9s} {'median':>8s} {'p99':>8s} {'max':>8s}")
    for kind, times in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
        ordered = sorted(times)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        print(f"{kind:28s} {len(times):6d} {sum(times):9.0f} {statistics.median(times):8.1f} {p99:8.1f} {max(times):8.1f}")
    passes: dict[tuple[str, str], list[float]] = defaultdict(list)
    for line in lines:
        if len(line["prefill"]) == 1 and not line["decode"] and not line["starts"]:
            _, start, end = line["prefill"][0]
            passes[(size_bin(end - start), depth_bin(start))].append(line["ms"])
    if passes:
        print(f"\nprefill passes alone in their plan: {'tokens':>7s} {'from depth':>10s} {'passes':>6s} {'median ms':>9s} {'max ms':>7s}")
        for (size, depth), times in sorted(passes.items()):
            print(f"{'':35s}{size:>7s} {depth:>10s} {len(times):6d} {statistics.median(times):9.1f} {max(times):7.1f}")
    print(f"\nlongest {args.top} plans:")
    t0 = lines[0]["t"]
    for line in sorted(lines, key=lambda item: -item["ms"])[: args.top]:
        what = {key: line[key] for key in ("decode", "prefill", "starts", "joins", "finishes", "drops") if line[key]}
        print(f"  +{(line['t'] - t0) * 1000:9.0f} ms  {line['ms']:8.1f} ms  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
