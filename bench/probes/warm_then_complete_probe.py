#!/usr/bin/env python
"""An editor's warm-then-complete: what the completion after a ``cache.warm`` costs to its first token.

    python bench/probes/warm_then_complete_probe.py [MODEL_DIR] [--files 3] [--words 1100] [--json OUT]

The real daemon over its socket: per file, a prompt of a system message and a
user message holding the file (about ``--words`` words of source text), first
``cache.warm`` (the editor preparing the prompt while the user looks at the
file), then the completion itself, 8 greedy tokens. Printed per file: the
warm's prefill, the completion's client TTFT and what its reply says it
prefilled. Run it with ``PYTHONPATH`` at another tree's package to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for harness
from harness import Daemon, connect, timed_generate  # noqa: E402

DEFAULT_MODEL = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"
SOURCE = Path(__file__).resolve().parents[2] / "daemon" / "engine" / "scheduler.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--words", type=int, default=1100)
    parser.add_argument("--json")
    args = parser.parse_args()
    words = SOURCE.read_text().split()
    rows = []
    with tempfile.TemporaryDirectory() as workdir, Daemon(Path(args.model), Path(workdir)) as daemon, \
            connect(daemon.socket_path) as conn:
        for index in range(args.files):
            start = index * 97  # a file of its own each time
            text = " ".join(words[start : start + args.words])
            messages = [{"role": "system", "content": "You complete code."},
                        {"role": "user", "content": f"File {index}:\n{text}\nComplete the next line."}]
            warmed = conn.cache_warm(messages=messages)
            reply = timed_generate(conn, messages=messages, max_tokens=8, temperature=0)
            row = {"prompt_tokens": reply["cache"]["prompt_tokens"], "warm_prefill_ms": warmed["timings"]["prefill_ms"],
                   "ttft_ms": reply["client_ttft_ms"], "prefilled_tokens": reply["cache"]["prefilled_tokens"],
                   "hit": reply["cache"]["hit"], "text": reply["text"]}
            rows.append(row)
            print(f"file {index}: {row['prompt_tokens']} tokens, warm prefill {row['warm_prefill_ms']:.0f} ms, "
                  f"completion TTFT {row['ttft_ms']:.1f} ms ({row['hit']}, prefilled {row['prefilled_tokens']})")
    print(f"completion TTFT median {statistics.median(r['ttft_ms'] for r in rows):.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
