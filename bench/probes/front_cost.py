#!/usr/bin/env python
"""What streaming costs the daemon per token: CPU seconds of its front thread, streamed against whole replies.

    python bench/probes/front_cost.py MODEL_DIR [--tokens 400] [--rounds 4] [--http] [--daemon-args "..."]

A streamed answer makes the event loop do work for every token: take the
engine's event, build the chunk, encode it, write it to the socket. That work
holds the GIL the engine thread needs to build its next step, and on a small
machine it takes a core from MLX as well. A reply asked for whole
(``stream: false``) sends no chunks, so the difference between the two is the
streaming path's own cost.

For each mode the probe runs ``--rounds`` greedy answers of ``--tokens``
tokens (cache off), alternating, and reads the daemon's threads' CPU times
from /proc before and after each: the front is the process's main thread (its
event loop), everything else (the engine thread, MLX's worker threads) is
reported together. Thread CPU time is far steadier than wall time on a shared
machine; the decode rates are printed as well, as the daemon measured them.
With ``--http`` the same answers go through the OpenAI front instead
(``/v1/completions``, server-sent events against one JSON reply, the cache
on as a client leaves it), the way coding agents and editors ask. Linux only (/proc). Figures are printed;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for harness

from harness import Daemon, connect, free_port, timed_generate  # noqa: E402

PROMPT = "Write a long story about a river, a stone and a lamp. Take your time and describe every detail."
TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of each thread of ``pid``."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
        times[int(tid)] = (int(fields[11]) / TICKS, int(fields[12]) / TICKS)
    return times


class OpenAIFront:
    """The daemon's OpenAI front on loopback: one completion, streamed or whole; (completion tokens, tok/s)."""

    def __init__(self, port: int, token: str):
        self.port, self.token = port, token

    def generate(self, prompt: str, max_tokens: int, stream: bool) -> tuple[int, float]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        if stream:
            usage = None
            for line in response:
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        else:
            usage = json.loads(response.read())["usage"]
        seconds = time.perf_counter() - started
        conn.close()
        return usage["completion_tokens"], usage["completion_tokens"] / seconds


def one_answer(conn, pid: int, tokens: int, stream: bool) -> tuple[float, float, float, int, float]:
    """(front user s, front system s, other threads' CPU s, completion tokens, decode tok/s) of one answer."""
    before = thread_cpu_seconds(pid)
    if isinstance(conn, OpenAIFront):  # its rate is the client's, request to last byte: prefill included
        num_tokens, rate = conn.generate(PROMPT, tokens, stream)
    else:
        params = dict(prompt=PROMPT, max_tokens=tokens, temperature=0, cache={"use": False, "store": False})
        reply = timed_generate(conn, **params) if stream else conn.generate(**params)
        num_tokens, rate = reply["usage"]["completion_tokens"], reply["timings"]["decode_tokens_per_s"]
    after = thread_cpu_seconds(pid)
    spent = {
        tid: (user - before.get(tid, (0.0, 0.0))[0], system - before.get(tid, (0.0, 0.0))[1])
        for tid, (user, system) in after.items()
    }
    front_user, front_system = spent.pop(pid, (0.0, 0.0))
    other = sum(user + system for user, system in spent.values())
    return front_user, front_system, other, num_tokens, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--http", action="store_true", help="through the OpenAI front instead of the socket")
    parser.add_argument("--daemon-args", default="", help="extra arguments for the daemon, one string")
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float, float, int, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as workdir:
        extra = shlex.split(args.daemon_args)
        if args.http:
            port = free_port()
            token_file = Path(workdir) / "http-token"
            token_file.write_text("front-cost-probe\n")
            extra += ["--http", f"127.0.0.1:{port}", "--http-token-file", str(token_file)]
        with Daemon(args.model, Path(workdir), extra) as daemon:
            with connect(daemon.socket_path) as socket_conn:
                conn = OpenAIFront(port, "front-cost-probe") if args.http else socket_conn
                one_answer(conn, daemon.proc.pid, 16, True)  # first-call set-up
                for _ in range(args.rounds):
                    for stream in (True, False):
                        results[stream].append(one_answer(conn, daemon.proc.pid, args.tokens, stream))
    front = "the OpenAI front (SSE against one JSON reply; cache on)" if args.http else "the socket, cache off"
    print(f"{args.model.name}: {args.rounds} rounds of {args.tokens} tokens, greedy, through {front}")
    rate_label = "client tok/s" if args.http else "decode tok/s"
    print(f"reply    front CPU ms/token (user + system)  other threads ms/token  {rate_label} (median)")
    per_token = {}
    for stream in (True, False):
        rows = results[stream]
        user = statistics.median(u / n * 1000 for u, _, _, n, _ in rows)
        system = statistics.median(s / n * 1000 for _, s, _, n, _ in rows)
        front = statistics.median((u + s) / n * 1000 for u, s, _, n, _ in rows)
        other = statistics.median(o / n * 1000 for _, _, o, n, _ in rows)
        rate = statistics.median(r for *_, r in rows)
        per_token[stream] = front
        print(
            f"{'streamed' if stream else 'whole':8s} {front:18.3f} ({user:.3f} + {system:.3f}) {other:18.3f} "
            f"{rate:18.1f}"
        )
    print(f"streaming's front cost: {per_token[True] - per_token[False]:.3f} ms of CPU per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
