#!/usr/bin/env python
"""Concurrency benchmark: continuous batching and chunked prefill, through the real daemon.

    .venv/bin/python bench/concurrency.py [--smollm2 DIR] [--quick] [--tokens N] [--depth N] [--json out.json]

1. Aggregate decode tokens/s with 1, 2, 4 and 8 sessions generating at once (one
   connection each, different prompts, greedy, cache off so every session decodes
   the same amount of work); prints the ratio to the single-session figure.
2. Time-to-first-token of a short request sent while a ~3,000-token prompt is being
   prefilled, next to the length of one prefill chunk of that prompt.
Figures are printed (ratios within one run); this is not a test. On a GPU the
default 48 tokens a session last a fraction of a second, so sessions joining
and leaving weigh on the figure; ``--tokens 200`` shows the steady batch.
``--depth N`` puts a distinct text of about N tokens before each session's
question, so the batch decodes N tokens deep (a coding agent's context), and
runs part 1 only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

from harness import Daemon, connect, run_at_once, timed_generate  # noqa: E402

TOPICS = ["the sea", "a city at night", "winter mornings", "old libraries", "trains", "mountains", "gardens", "rivers"]


def deep_contexts(socket_path: Path, count: int, depth: int) -> list[str]:
    """``count`` distinct texts of about ``depth`` tokens each (lines of Python's own sources, from different places)."""
    lines = Path(threading.__file__).read_text().splitlines(keepends=True)
    lines += Path(json.__file__).parent.joinpath("decoder.py").read_text().splitlines(keepends=True)
    texts = []
    with connect(socket_path) as conn:
        for index in range(count):
            start, text, taken = index * 97 % len(lines), "", 0
            while conn.tokenize(prompt=text)["num_tokens"] < depth:
                block = [lines[(start + taken + i) % len(lines)] for i in range(40)]
                text += "".join(block)
                taken += 40
            texts.append(text)
    return texts


def decode_throughput(socket_path: Path, num_sessions: int, max_tokens: int, contexts: list[str] | None = None) -> dict:
    """All sessions start together; aggregate = generated tokens / wall time of the slowest."""
    results: list[dict] = [None] * num_sessions
    barrier = threading.Barrier(num_sessions)

    def session(index: int) -> None:
        question = f"Write a long, detailed essay about {TOPICS[index % len(TOPICS)]}."
        if contexts:
            question = f"{contexts[index]}\n\n{question}"
        with connect(socket_path) as conn:
            barrier.wait()
            results[index] = timed_generate(
                conn,
                messages=[{"role": "user", "content": question}],
                max_tokens=max_tokens,
                cache={"use": False, "store": False},
            )

    wall = run_at_once(session, num_sessions)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    # Decode-only aggregate: from the last first token to the last finish.
    decode_window = wall - max(r["client_ttft_ms"] for r in results) / 1000
    return {
        "sessions": num_sessions,
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tok_s": tokens / wall,
        "decode_aggregate_tok_s": tokens / decode_window if decode_window > 0 else 0.0,
        "per_session_tok_s": [r["timings"]["decode_tokens_per_s"] for r in results],
    }


def short_during_long_prefill(socket_path: Path, long_tokens: int, chunk: int) -> dict:
    lines = (Path(threading.__file__)).read_text().splitlines(keepends=True)
    with connect(socket_path) as conn:
        text, n = "", 0
        for line in lines:  # grow until the prompt has about long_tokens tokens
            text += line
            if len(text) % 40 == 0 and conn.tokenize(prompt=text)["num_tokens"] >= long_tokens:
                break
        n = conn.tokenize(prompt=text)["num_tokens"]
    long_result: dict = {}

    def long_request() -> None:
        with connect(socket_path) as conn:
            long_result.update(timed_generate(conn, prompt=text, max_tokens=4, cache={"use": False, "store": False}))

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # the long prompt is now being prefilled
    with connect(socket_path) as conn:
        short = timed_generate(conn, prompt="Hello! Say hi back.", max_tokens=4, cache={"use": False, "store": False})
    thread.join()
    num_chunks = -(-n // chunk)
    chunk_s = long_result["timings"]["prefill_ms"] / 1000 / num_chunks
    return {
        "long_prompt_tokens": n,
        "long_ttft_s": long_result["client_ttft_ms"] / 1000,
        "mean_chunk_s": chunk_s,
        "short_ttft_s": short["client_ttft_ms"] / 1000,
        "short_ttft_in_chunks": short["client_ttft_ms"] / 1000 / chunk_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smollm2", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per session (default 24 quick, 48 full)")
    parser.add_argument("--depth", type=int, default=None, help="tokens of distinct context before each question")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.smollm2 is None:
        from prefixd.daemon.models.model_setup import ensure_smollm2

        args.smollm2 = ensure_smollm2()
    chunk = 512
    max_tokens = args.tokens or (24 if args.quick else 48)
    sessions = [1, 2, 4] if args.quick else [1, 2, 4, 8]
    report: dict = {"model": str(args.smollm2), "depth": args.depth, "throughput": [], "prefill_interleave": None}
    with tempfile.TemporaryDirectory(prefix="pdbench") as workdir, Daemon(args.smollm2, Path(workdir), ["--prefill-chunk", str(chunk)]) as daemon:
        contexts = deep_contexts(daemon.socket_path, max(sessions), args.depth) if args.depth else None
        deep = f", each about {args.depth} tokens deep" if args.depth else ""
        print(f"SmolLM2 decode throughput, {max_tokens} tokens per session{deep} (greedy, cache off)")
        print(f"{'sessions':>8} {'tokens':>7} {'wall s':>7} {'aggregate tok/s':>16} {'decode-only tok/s':>18} {'x single':>9}")
        single = None
        for num_sessions in sessions:
            row = decode_throughput(daemon.socket_path, num_sessions, max_tokens, contexts)
            single = single or row["decode_aggregate_tok_s"]
            row["ratio_to_single"] = row["decode_aggregate_tok_s"] / single
            report["throughput"].append(row)
            print(f"{num_sessions:>8} {row['completion_tokens']:>7} {row['wall_s']:>7.1f} {row['aggregate_tok_s']:>16.1f} "
                  f"{row['decode_aggregate_tok_s']:>18.1f} {row['ratio_to_single']:>8.2f}x")
        target = next((r for r in report["throughput"] if r["sessions"] == 4), None)
        if target:
            verdict = "meets" if target["ratio_to_single"] >= 2.5 else "MISSES"
            print(f"4 sessions: {target['ratio_to_single']:.2f}x the single-session aggregate ({verdict} the 2.5x target)")
        long_tokens = 1500 if args.quick else 3000
        if args.depth:
            long_tokens = 0  # part 1 only
        if long_tokens:
            print(f"\nA short request while a {long_tokens}-token prompt is prefilled ({chunk}-token chunks)")
            row = short_during_long_prefill(daemon.socket_path, long_tokens, chunk)
            report["prefill_interleave"] = row
            verdict = "meets" if row["short_ttft_in_chunks"] <= 2 else "MISSES"
            print(f"  long prompt {row['long_prompt_tokens']} tokens, cold TTFT {row['long_ttft_s']:.1f} s, mean chunk {row['mean_chunk_s']:.2f} s")
            print(f"  short request TTFT {row['short_ttft_s']:.2f} s = {row['short_ttft_in_chunks']:.2f} chunks ({verdict} the 2-chunk target)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
