#!/usr/bin/env python
"""Where a long prompt's join into decoding goes on a GPU: prefill, first token, the join, the next steps, each timed.

    python bench/probes/join_probe.py MODEL_DIR [--lengths 1682,4340,4340,6651] [--json OUT]

The fairness benchmark's step trace on an H100 (bench/results/2026-12-06-fairness)
showed a plan that only joins a sequence to its model's decode batch taking
0.45-0.7 s, after the 1,682- to 6,651-token prompts of its loads, while every
other join took under 1 ms, and warming the paths up at load did not remove it.
This runs the daemon's own pieces in process (the loader, BatchDecoder with its
solo path, the same model calls as prefill.py) and times each piece with a
device synchronisation after it, in two scenarios per prompt length:

* alone: the long prompt's sequence joins an empty decoder (the solo path);
* beside: a short sequence is decoding alone when the long one joins (the
  solo row moves into mlx-lm's batch, and the long row is inserted beside it).

``--crowd ROWS`` times instead what a join and a leave cost a batch that is
already running: ROWS sequences of the given lengths decode together, one
more joins (mlx-lm gives it a one-row pass of its own, then concatenates
every row's KV into a new padded batch), and later one leaves (its row is
extracted and every other row's KV is gathered into a new batch). Each is
set against the batch's steady steps around it, in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prefixd.daemon.models.blas import preload_blas

preload_blas()

import mlx.core as mx  # noqa: E402

from prefixd.daemon.engine.batch_decoder import BatchDecoder, sample_first  # noqa: E402
from prefixd.daemon.engine.jobs import GenerateJob  # noqa: E402
from prefixd.daemon.engine.prefill import make_sequence  # noqa: E402
from prefixd.daemon.kv.fork import fork_cache  # noqa: E402
from prefixd.daemon.models.loaded_model import load_model  # noqa: E402
from prefixd.protocol.methods import parse_generate  # noqa: E402

CHUNK = 2048


def timed(fn) -> tuple[object, float]:
    mx.synchronize()
    started = time.perf_counter()
    value = fn()
    mx.synchronize()
    return value, round((time.perf_counter() - started) * 1000, 2)


def sequence(loaded, length: int, max_tokens: int, seed: int) -> tuple[object, int, dict]:
    """A fresh sequence with ``length`` made-up prompt tokens prefilled as prefill.py feeds them; its first token."""
    params = parse_generate({"prompt": "probe", "max_tokens": max_tokens, "temperature": 0.0, "stream": False})
    seq = make_sequence(GenerateJob("probe", None, params, emit=lambda kind, payload: None), loaded)
    seq.cache = fork_cache(loaded.model, loaded.layout, [], None, 0)
    tokens = [(i * 7919 + seed) % 30000 + 100 for i in range(length)]
    passes = []
    for start in range(0, length - 1, CHUNK):
        end = min(start + CHUNK, length - 1)

        def run(start=start, end=end):
            loaded.model(mx.array(tokens[start:end])[None], cache=seq.cache)
            mx.eval([c.state for c in seq.cache])

        passes.append(timed(run)[1])

    def first():
        logits = loaded.model(mx.array(tokens[-1:])[None], cache=seq.cache)[:, -1, :]
        return sample_first(seq, logits)

    token, first_ms = timed(first)
    seq.generated.append(token)
    return seq, token, {"passes_ms": passes, "first_token_ms": first_ms}


def steps(decoder: BatchDecoder, count: int) -> list[float]:
    times = []
    for _ in range(count):
        events, ms = timed(decoder.step)
        for event in events:
            event.seq.generated.append(event.token)
        times.append(ms)
    return times


def scenario(loaded, name: str, length: int, seed: int) -> dict:
    decoder = BatchDecoder(loaded.model, loaded.eos_token_ids)
    row: dict = {"scenario": name, "length": length}
    short = None
    if name == "beside":
        short, token, _ = sequence(loaded, 16, 40, seed + 1)
        decoder.add(short, [token], 39)
        row["short_steps_ms"] = steps(decoder, 3)
    seq, token, prefill = sequence(loaded, length, 8, seed)
    row.update(prefill)
    row["join_ms"] = timed(lambda: decoder.add(seq, [token], 7))[1]
    row["steps_after_ms"] = steps(decoder, 4)
    for each in (seq, short):
        if each is not None and decoder.holds(each):
            decoder.remove(each)
    return row


def crowd(loaded, rows: int, length: int, seed: int) -> dict:
    """ROWS rows ``length`` deep decoding; the step a row joins in and the step a row leaves in, against steady steps."""
    decoder = BatchDecoder(loaded.model, loaded.eos_token_ids)
    steady_tokens = 12
    for index in range(rows):
        # The first row leaves by its token budget after the join has settled; the others outlast the probe.
        budget = 2 * steady_tokens + 4 if index == 0 else 200
        seq, token, _ = sequence(loaded, length, budget + 1, seed + index)
        decoder.add(seq, [token], budget)
    before = steps(decoder, steady_tokens)
    joiner, token, _ = sequence(loaded, length, 200, seed + rows)
    join_ms = timed(lambda: decoder.add(joiner, [token], 199))[1]
    join_step = steps(decoder, 1)[0]
    between = steps(decoder, steady_tokens + 2)  # the first row's last token comes in this run or the next step
    during = []
    while len(decoder) > rows:  # rows + 1 until the first row has left
        during.append(steps(decoder, 1)[0])
        if len(during) > 8:
            raise RuntimeError("the first row did not leave")
    after = steps(decoder, steady_tokens)

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    return {
        "scenario": "crowd",
        "rows": rows,
        "length": length,
        "steady_step_ms": median(before[2:]),
        "join_add_ms": join_ms,
        "join_step_ms": join_step,
        "steady_with_joiner_ms": median(between[2:]),
        "leave_step_ms": during[-1],
        "steady_after_leave_ms": median(after[2:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--lengths", default="1682,4340,4340,6651")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--crowd", type=int, help="rows already decoding (the crowd scenario instead)")
    args = parser.parse_args()
    loaded = load_model(str(args.model))
    rows = []
    if args.crowd:
        for index, length in enumerate(int(n) for n in args.lengths.split(",")):
            row = crowd(loaded, args.crowd, length, seed=index * 10)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    for index, length in enumerate(int(n) for n in args.lengths.split(",")):
        for name in ("alone", "beside"):
            row = scenario(loaded, name, length, seed=index * 10)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
