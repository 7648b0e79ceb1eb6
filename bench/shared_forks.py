#!/usr/bin/env python
"""Sessions on one stored system prompt, with forks that copy it (--fork copy) and forks that read it in place (share).

    .venv/bin/python bench/shared_forks.py [--model DIR] [--sessions 1,4,8] [--words 2400] [--max-tokens 32]
                                           [--distinct] [--json OUT]

For each mode a daemon is started, the system prompt is stored by one request,
then N sessions (one connection each) send it with a question of their own at
once, greedy. ``--distinct``: nothing is stored first and every session sends a
system prompt of its own, new to the daemon (cold prompts that are stored and
then decode together: prefill.read_prompt_in_place). Printed per mode and N: time to first token (p50 / worst),
aggregate decode tokens/s, the most KV the scheduler reserved for running
requests and the most memory MLX held (sampled from ``stats`` every 50 ms,
above what it held before the sessions), and whether every answer is the
one the other mode gave. Figures of one run, compared within it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness import Daemon, connect, run_at_once, timed_generate  # noqa: E402

DEFAULT_MODEL = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"
WORDS = "river stone cloud garden lamp window copper violet harbor meadow pencil orbit ledger canyon".split()
QUESTIONS = ["the first", "the second", "the last", "every", "a red", "no", "two", "the longest"]


def system_prompt(num_words: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    return "You keep this inventory. " + " ".join(rng.choice(WORDS) for _ in range(num_words))


class MemorySampler:
    """The most reserved KV and MLX memory seen while it runs, from ``stats`` on a connection of its own."""

    def __init__(self, socket_path: Path):
        self.socket_path = socket_path
        self.peak_reserved = self.peak_active = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with connect(self.socket_path) as conn:
            while not self._stop.is_set():
                stats = conn.stats()
                self.peak_reserved = max(self.peak_reserved, stats["requests"].get("kv_reserved_bytes", 0))
                self.peak_active = max(self.peak_active, stats["process"]["mlx_active_bytes"])
                time.sleep(0.05)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def sessions_at_once(socket_path: Path, systems: list[str], max_tokens: int) -> dict:
    """One session per system prompt in ``systems``, all at once."""
    num_sessions = len(systems)
    results: list[dict] = [None] * num_sessions
    barrier = threading.Barrier(num_sessions)

    def session(index: int) -> None:
        with connect(socket_path) as conn:
            barrier.wait()
            question = f"How many items are on {QUESTIONS[index % len(QUESTIONS)]} shelf, session {index}?"
            results[index] = timed_generate(
                conn,
                messages=[{"role": "system", "content": systems[index]}, {"role": "user", "content": question}],
                max_tokens=max_tokens,
                temperature=0,
            )

    with connect(socket_path) as conn:
        active_before = conn.stats()["process"]["mlx_active_bytes"]
    with MemorySampler(socket_path) as memory:
        wall = run_at_once(session, num_sessions)
    ttfts = [r["client_ttft_ms"] for r in results]
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    decode_s = wall - max(ttfts) / 1000
    return {
        "sessions": num_sessions,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_max_ms": max(ttfts),
        # None when the answers were empty (the model stopped at once, as SmolLM2 does past ~6k tokens):
        # there is no decode to time, and wall time minus TTFT would be noise
        "decode_tok_s": (tokens - num_sessions) / decode_s if decode_s > 0 and tokens > num_sessions else None,
        "wall_s": wall,
        "reused_tokens": [r["cache"]["reused_tokens"] for r in results],
        "prompt_tokens": results[0]["cache"]["prompt_tokens"],
        "peak_reserved_mib": memory.peak_reserved / 2**20,
        "peak_active_above_mib": (memory.peak_active - active_before) / 2**20,
        "texts": [r["text"] for r in results],
    }


def decode_cell(tok_s: float | None) -> str:
    return "no tokens" if tok_s is None else f"{tok_s:.1f}"


def run_mode(model: Path, mode: str, words: int, sessions: list[int], max_tokens: int, distinct: bool) -> list[dict]:
    rows = []
    system = system_prompt(words)
    with tempfile.TemporaryDirectory() as workdir, Daemon(model, Path(workdir), ["--fork", mode]) as daemon:
        with connect(daemon.socket_path) as conn:
            fork = conn.models()
            if not distinct:
                timed_generate(conn, messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
                               max_tokens=1, temperature=0)  # stores the system prompt
        for num_sessions in sessions:
            # Distinct: prompts no earlier round sent (seeded by round and session, so every mode sends the same).
            systems = ([system_prompt(words, seed=1000 * num_sessions + i) for i in range(num_sessions)] if distinct
                       else [system] * num_sessions)
            row = sessions_at_once(daemon.socket_path, systems, max_tokens)
            row["mode"] = mode
            rows.append(row)
        rows[0]["models"] = fork
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--sessions", default="1,4,8")
    parser.add_argument("--words", type=int, default=2400, help="system prompt length in words (~1.2 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="copy,share,copy,share", help="run in this order (alternate to see the spread)")
    parser.add_argument("--distinct", action="store_true", help="a cold system prompt of its own per session")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sessions = [int(n) for n in args.sessions.split(",")]
    all_rows = []
    shared = "a cold one of its own per session" if args.distinct else "one, stored first"
    print(f"model {args.model.name}; system prompt {args.words} words ({shared}); "
          f"{args.max_tokens} tokens per answer, greedy")
    print(f"{'mode':>5} {'N':>2} {'prompt':>6} {'TTFT p50':>9} {'worst':>7} {'decode tok/s':>12} {'reserved MiB':>12} "
          f"{'MLX above MiB':>13} {'wall s':>6}")
    for mode in args.modes.split(","):
        for row in run_mode(args.model, mode, args.words, sessions, args.max_tokens, args.distinct):
            all_rows.append(row)
            print(f"{row['mode']:>5} {row['sessions']:>2} {row['prompt_tokens']:>6} {row['ttft_p50_ms']:>9.0f} "
                  f"{row['ttft_max_ms']:>7.0f} {decode_cell(row['decode_tok_s']):>12} {row['peak_reserved_mib']:>12.1f} "
                  f"{row['peak_active_above_mib']:>13.1f} {row['wall_s']:>6.1f}", flush=True)
    by_key: dict[int, set] = {}
    for row in all_rows:
        by_key.setdefault(row["sessions"], set()).add(tuple(row["texts"]))
    same = all(len(texts) == 1 for texts in by_key.values())
    print(f"every session's answer the same in every mode and run: {'yes' if same else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"rows": all_rows, "same_answers": same}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
