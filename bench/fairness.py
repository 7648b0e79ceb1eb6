#!/usr/bin/env python
"""Fairness: how long a bystander waits while another client sends something big.

    .venv/bin/python bench/fairness.py [--quick] [--model DIR] [--json out.json]

One daemon (default flags, --http on loopback). A bystander sends a short
streamed request (cache off, 8 tokens) over and over on the socket; first
alone, then while each load runs:

- a chat of 250 / 500 / 1,000 one-word messages (one request, socket; about
  1.8k / 3.5k / 7k tokens with SmolLM2's template);
- a raw prompt of about 6k tokens (socket);
- a burst of 500 HTTP connections, each a one-token completion (those beyond
  the three quarters of --max-queued one client may hold get 503 at once:
  counted as refused, not as the case's failure);
- 16 cold prompts of ~300 tokens at once (socket).

Printed per case: the bystander's worst and median time to first token, its
worst gap between two tokens, and the target: worst first token <= 2x its
median alone + one prefill chunk's time (a cold prompt of one chunk, cache
off, measured alone in the same run). Exit code 1 when a case misses it.
--quick: the 250-message chat, the raw prompt at 1,500 words (about 4.4k
tokens), a burst of 100 and 8 cold prompts.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Daemon, connect, free_port, timed_generate  # noqa: E402

DEFAULT_MODEL = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"
BYSTANDER = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
             "cache": {"use": False, "store": False}}
NO_CACHE = {"use": False, "store": False}


def bystander_once(socket_path: Path) -> dict:
    """One bystander request: its first-token time and its worst gap between tokens, in seconds."""
    with connect(socket_path) as conn:
        started = time.perf_counter()
        stream = conn.stream(**BYSTANDER)
        arrivals = [time.perf_counter() for _ in stream]
        timings = (stream.result or {}).get("timings", {})
    ttft = (arrivals[0] if arrivals else time.perf_counter()) - started
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # Where the daemon says the wait went: in line (encoding included) or in the prefill up to the first token.
    where = {key: timings.get(key) for key in ("queue_ms", "encode_ms", "prefill_ms", "lookup_ms")}
    return {"ttft_s": ttft, "max_gap_s": max(gaps, default=0.0), "daemon_timings": where}


CHAT_WORDS = ["ok", "yes", "sure", "fine", "right", "good", "then", "next"]  # one token each


def chat_of(num_messages: int) -> list[dict]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": CHAT_WORDS[i % len(CHAT_WORDS)]} for i in range(num_messages)]
    messages[-1] = {"role": "user", "content": "and now?"}
    return messages


def socket_request(socket_path: Path, params: dict) -> Callable[[], None]:
    def send() -> None:
        with connect(socket_path) as conn:
            timed_generate(conn, **params)
    return send


class Refused(Exception):
    """The daemon said OVERLOADED at once: back-pressure on the load, not a failure of the case."""


def together(senders: list[Callable[[], None]], refused: list[int] | None = None) -> Callable[[], None]:
    """All senders at once; Refused ones are counted in ``refused`` (if given), other errors fail the load."""
    def send() -> None:
        errors = []

        def one(sender: Callable[[], None]) -> None:
            try:
                sender()
            except Refused:
                if refused is None:
                    raise
                refused.append(1)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors.append(exc)
        threads = [threading.Thread(target=one, args=(sender,), daemon=True) for sender in senders]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(senders)} failed: {errors[0]}")
    return send


def http_completion(port: int, token: str, model: str, index: int) -> Callable[[], None]:
    body = json.dumps({"model": model, "prompt": f"Number {index}:", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as conn:
            conn.sendall(head + body)
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        if reply.startswith(b"HTTP/1.1 503") and b"OVERLOADED" in reply.upper():
            raise Refused(reply[:200].decode(errors="replace"))
        if not reply.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(reply[:200].decode(errors="replace"))
    return send


def raw_prompt(num_words: int, seed: int) -> str:
    words = ["river", "stone", "cloud", "lamp", "garden", "copper", "violet", "engine", "harbor", "meadow"]
    return " ".join(words[(i * 7 + seed) % len(words)] + str(i % 97) for i in range(num_words))


def run_case(socket_path: Path, load: Callable[[], None]) -> dict:
    """The bystander, over and over, while ``load`` runs; at least one request."""
    failure: list[BaseException] = []

    def run_load() -> None:
        try:
            load()
        except BaseException as exc:  # noqa: BLE001 - reported in the row
            failure.append(exc)
    started = time.perf_counter()
    loader = threading.Thread(target=run_load, daemon=True)
    loader.start()
    time.sleep(0.3)  # the load reaches the daemon first
    samples = [bystander_once(socket_path)]
    while loader.is_alive():
        samples.append(bystander_once(socket_path))
    loader.join()
    ttfts = [s["ttft_s"] for s in samples]
    worst = max(samples, key=lambda s: s["ttft_s"])
    return {"load_s": time.perf_counter() - started, "bystander_requests": len(samples), "worst_ttft_s": max(ttfts),
            "worst_daemon_timings": worst["daemon_timings"],
            "median_ttft_s": statistics.median(ttfts), "worst_gap_s": max(s["max_gap_s"] for s in samples),
            "load_error": str(failure[0]) if failure else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--daemon-arg", action="append", default=[], help="passed to the daemon (repeat)")
    parser.add_argument("--only", action="append", default=[], help="run the cases whose name holds this (repeat)")
    args = parser.parse_args()

    port, token = free_port(), "fairness-bench"
    workdir = Path(tempfile.mkdtemp(prefix="prefixd-fairness-"))
    (workdir / "token").write_text(token)
    daemon_args = ["--http", f"127.0.0.1:{port}", "--http-token-file", str(workdir / "token"), *args.daemon_arg]
    rows = []
    with Daemon(args.model, workdir, daemon_args) as daemon:
        path = daemon.socket_path
        with connect(path) as conn:
            chunk = conn.stats().get("prefill_chunk") or 512
        alone = [bystander_once(path) for _ in range(5)]
        alone_ttft = statistics.median(s["ttft_s"] for s in alone)
        alone_gap = statistics.median(s["max_gap_s"] for s in alone)
        with connect(path) as conn:
            model = conn.tokenize(prompt="x")["model"]
            tokens_per_word = len(conn.tokenize(prompt=raw_prompt(400, seed=99))["tokens"]) / 400
            chunk_prompt = raw_prompt(int(chunk / tokens_per_word), seed=99)
            num_chunk_tokens = len(conn.tokenize(prompt=chunk_prompt)["tokens"])
            chunk_s = statistics.median(
                timed_generate(conn, prompt=chunk_prompt, max_tokens=1, cache=NO_CACHE)["client_ttft_ms"] / 1000
                for _ in range(2))
        target = 2 * alone_ttft + chunk_s
        print(f"alone: first token {alone_ttft * 1000:.0f} ms, worst gap {alone_gap * 1000:.0f} ms; "
              f"one chunk ({num_chunk_tokens} tokens, cold) {chunk_s * 1000:.0f} ms; target {target * 1000:.0f} ms",
              flush=True)

        chats = [250] if args.quick else [250, 500, 1000]
        raw_words = 1500 if args.quick else int(6000 / tokens_per_word)
        burst = 100 if args.quick else 500
        num_cold = 8 if args.quick else 16
        with connect(path) as conn:
            chat_tokens = {n: len(conn.tokenize(messages=chat_of(n))["tokens"]) for n in chats}
            raw_tokens = len(conn.tokenize(prompt=raw_prompt(raw_words, seed=1))["tokens"])
        burst_refused: list[int] = []
        cases: list[tuple[str, Callable[[], None]]] = [
            (f"chat of {n} messages ({chat_tokens[n]} tok)",
             socket_request(path, {"messages": chat_of(n), "max_tokens": 4, "cache": NO_CACHE}))
            for n in chats]
        cases += [
            (f"raw prompt of {raw_tokens} tokens", socket_request(path, {"prompt": raw_prompt(raw_words, seed=1),
                                                                        "max_tokens": 4, "cache": NO_CACHE})),
            (f"burst of {burst} HTTP connections",
             together([http_completion(port, token, model, i) for i in range(burst)], burst_refused)),
            (f"{num_cold} cold prompts at once", together([
                socket_request(path, {"prompt": raw_prompt(150, seed=10 + i), "max_tokens": 8, "cache": NO_CACHE})
                for i in range(num_cold)])),
        ]
        if args.only:
            cases = [(name, load) for name, load in cases if any(part in name for part in args.only)]
        for name, load in cases:
            row = {"case": name, **run_case(path, load)}
            row["target_s"] = target
            if name.startswith("burst"):
                row["load_refused"] = len(burst_refused)
            row["met"] = row["worst_ttft_s"] <= target and row["load_error"] is None
            rows.append(row)
            print(f"{name:34s} bystander first token worst {row['worst_ttft_s'] * 1000:7.0f} ms "
                  f"(median {row['median_ttft_s'] * 1000:5.0f}, {row['bystander_requests']} requests), "
                  f"worst gap {row['worst_gap_s'] * 1000:6.0f} ms; load {row['load_s']:6.1f} s; "
                  f"worst's queue {row['worst_daemon_timings']['queue_ms']} ms "
                  f"prefill {row['worst_daemon_timings']['prefill_ms']} ms; "
                  f"{'met' if row['met'] else 'MISSED'}"
                  + (f"; {row['load_refused']} of the load refused (OVERLOADED)" if row.get("load_refused") else "")
                  + (f"; load failed: {row['load_error']}"
                                                            if row["load_error"] else ""), flush=True)
    summary = {"alone_ttft_s": alone_ttft, "alone_gap_s": alone_gap, "chunk_tokens": num_chunk_tokens,
               "chunk_s": chunk_s, "target_s": target, "cases": rows, "quick": args.quick}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if all(row["met"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
