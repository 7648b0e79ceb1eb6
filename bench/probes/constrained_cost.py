#!/usr/bin/env python
"""What constrained decoding costs per token: the same model and prompts, with and without a ``constraint``.

    .venv/bin/python bench/probes/constrained_cost.py [MODEL_DIR] [--rounds 3] [--max-tokens 48]

One daemon (default model SmolLM2-135M-Instruct), greedy, cache off so every
request runs the same work. Each round runs, interleaved so that a busy
machine slows every variant alike:

* solo: one request at a time (the solo path), unconstrained, then under a
  JSON schema (one long string field, so the answer runs long) and a regex;
* batch: four requests in one write (rows of one batch), all unconstrained,
  then two constrained (schema) beside two unconstrained.

The figure is the daemon's own decode time per token (``timings.decode_ms``
over the tokens after the first), median over rounds; ratios are against the
unconstrained run of the same round shape, measured in this run. In the mixed
batch, the unconstrained rows' figure shows what their constrained neighbours
cost them. Nothing fails on a number: it is printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import Daemon  # noqa: E402

DEFAULT_MODEL = Path(os.environ.get("PREFIXD_MODELS_DIR", "~/.local/share/prefixd/models")).expanduser() / "SmolLM2-135M-Instruct"
LONG_STRING = {"type": "object", "properties": {"story": {"type": "string", "minLength": 600, "maxLength": 4000}},
               "required": ["story"], "additionalProperties": False}
REGEX = "[A-Za-z][a-z ,.'A-Z]{600,4000}"
NO_CACHE = {"use": False, "store": False}


class Conn:
    """A few lines of msgpack-RPC: several generates in one write, their results by msgid."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.msgid = 0

    def generate_all(self, requests: list[dict]) -> list[dict]:
        msgids = list(range(self.msgid + 1, self.msgid + 1 + len(requests)))
        self.msgid += len(requests)
        self.sock.sendall(b"".join(msgpack.packb([0, m, "generate", [r]]) for m, r in zip(msgids, requests)))
        results: dict[int, dict] = {}
        while len(results) < len(msgids):
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError("the daemon closed the connection")
            self.unpacker.feed(data)
            for message in self.unpacker:
                if message[0] == 1:
                    if message[2] is not None:
                        raise RuntimeError(f"generate failed: {message[2]}")
                    results[message[1]] = message[3]
        return [results[m] for m in msgids]


def ms_per_token(result: dict) -> float | None:
    tokens = result["usage"]["completion_tokens"]
    return result["timings"]["decode_ms"] / (tokens - 1) if tokens > 1 else None


def request(topic: str, max_tokens: int, constraint: dict | None = None) -> dict:
    params = {"messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
              "max_tokens": max_tokens, "cache": NO_CACHE}
    if constraint is not None:
        params["constraint"] = constraint
    return params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {}

    tokens: dict[str, list[int]] = {}

    def note(name: str, results: list[dict]) -> None:
        values = [v for v in map(ms_per_token, results) if v is not None]
        figures.setdefault(name, []).extend(values)
        tokens.setdefault(name, []).extend(r["usage"]["completion_tokens"] for r in results)

    topics = ["a lighthouse", "a city of bridges", "a robot gardener", "two rival bakers"]
    schema, regex = {"json_schema": LONG_STRING}, {"regex": REGEX}
    n = args.max_tokens
    print(f"load average {os.getloadavg()[0]:.2f}; model {args.model.name}; {args.rounds} rounds, max_tokens {n}")
    with tempfile.TemporaryDirectory() as tmp, Daemon(args.model, Path(tmp)) as daemon:
        conn = Conn(daemon.socket_path)
        conn.generate_all([request("warming up", 8), request("warming up", 8, schema), request("warming up", 8, regex)])
        for round_ in range(args.rounds):
            for topic in topics[:2]:
                note("solo, unconstrained", conn.generate_all([request(topic, n)]))
                note("solo, json_schema", conn.generate_all([request(topic, n, schema)]))
                note("solo, regex", conn.generate_all([request(topic, n, regex)]))
            plain = conn.generate_all([request(t, n) for t in topics])
            note("batch of 4, all unconstrained", plain)
            mixed = conn.generate_all([request(topics[0], n, schema), request(topics[1], n),
                                       request(topics[2], n, schema), request(topics[3], n)])
            note("batch of 4, its 2 constrained rows", [mixed[0], mixed[2]])
            note("batch of 4, its 2 unconstrained rows", [mixed[1], mixed[3]])
            print(f"  round {round_ + 1} done ({time.strftime('%H:%M:%S')})", flush=True)
    median = {name: statistics.median(values) for name, values in figures.items() if values}
    baseline = {"solo": median["solo, unconstrained"], "batch": median["batch of 4, all unconstrained"]}
    print(f"\n{'decode, ms per token (median)':40} {'ms':>7} {'x unconstrained':>16} {'tokens (mean)':>14}")
    for name, value in median.items():
        base = baseline["solo" if name.startswith("solo") else "batch"]
        print(f"{name:40} {value:7.2f} {value / base:16.2f} {statistics.mean(tokens[name]):14.1f}")
    print("(a row that ends early leaves a smaller batch to the rest: compare batch rows of equal token counts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
