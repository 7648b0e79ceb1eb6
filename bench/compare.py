#!/usr/bin/env python
"""prefixd vs mlx-lm's server vs in-process mlx-lm: the same workloads, interleaved, one run.

    .venv/bin/python bench/compare.py [--quick] [--model DIR] [--out bench/results]

Starts all three systems on the same model directory (float32 weights, OpenBLAS in each),
then runs four workloads step by step, each step on every system in turn (the order rotates
per step, so a burst of load from elsewhere hits all three alike):
  1. a long prompt sent cold, then repeated;   2. a multi-turn chat;
  3. concurrent sessions sharing one system prompt (one connection per session), 2 rounds;
  4. an editor: a file as context, then edits to lines near its end.
Writes compare.md (the table, printed too), compare.json (raw numbers) and PNG plots to --out.
See bench/README.md for what each column means. Figures, not a test: nothing fails on a miss.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
from harness import BenchError  # noqa: E402
from peers import InProcessPeer, MlxServerPeer, PrefixdPeer  # noqa: E402
from workloads import PrefillFloor, Request, Sizes, Tokens, build_workloads  # noqa: E402

DEFAULT_MODEL = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"
PEER_CLASSES = [PrefixdPeer, MlxServerPeer, InProcessPeer]


# -- one step -------------------------------------------------------------------------------------


def run_step(peer, requests) -> tuple[list[dict], float]:
    """The step's requests on one system: in parallel threads (one client each) if it serves
    concurrently and there are several, else one after another. Returns (results, wall s)."""
    results: list[dict] = [{} for _ in requests]

    def one(i: int, client, barrier) -> None:
        try:
            if barrier:
                barrier.wait()  # all sessions send at once
            results[i] = client.generate(requests[i])
        except Exception as exc:  # noqa: BLE001 - recorded; the report says which request failed
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            client.close()

    started = time.perf_counter()
    if peer.concurrent and len(requests) > 1:
        clients = [peer.client() for _ in requests]  # connect first: connection setup is not in TTFT
        barrier = threading.Barrier(len(requests))
        threads = [threading.Thread(target=one, args=(i, c, barrier)) for i, c in enumerate(clients)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(requests)):
            one(i, peer.client(), None)
    wall = time.perf_counter() - started
    for request, result in zip(requests, results):
        result.update(phase=request.phase, label=request.label)
    return results, wall


def run_workload(workload, peers) -> dict:
    """Every step on every system, interleaved; per system: results, step walls, peak memory."""
    sessions = {p.name: workload.make_session() for p in peers}
    record = {p.name: {"requests": [], "step_walls": [], "error": None} for p in peers}
    step = 0
    while True:
        order = peers[step % len(peers):] + peers[:step % len(peers)]
        plan = {p.name: sessions[p.name].next_step() for p in order}
        if all(v is None for v in plan.values()):
            break
        for peer in order:
            requests = plan[peer.name]
            if requests is None or record[peer.name]["error"]:
                continue
            results, wall = run_step(peer, requests)
            sessions[peer.name].record(requests, results)
            record[peer.name]["requests"] += results
            record[peer.name]["step_walls"].append(wall)
            failed = [r["error"] for r in results if "error" in r]
            if failed:  # a broken system skips the rest of this workload; the others go on
                record[peer.name]["error"] = f"{failed[0]}\n--- log tail ---\n{peer.log_tail()}"
                print(f"    {peer.name}: FAILED at step {step + 1}: {failed[0]}", flush=True)
            print_step(peer.name, results, wall)
        step += 1
    for peer in peers:
        record[peer.name]["wall_s"] = sum(record[peer.name]["step_walls"])
        record[peer.name]["peak_kb"] = peer.peak_kb()
    # The minimum prefill is computed on what prefixd was sent (chat prompts depend on its answers).
    sent = sessions[peers[0].name].sent
    return {"key": workload.key, "title": workload.title, "notes": workload.notes,
            "concurrent": workload.concurrent, "peers": record, "sent_messages": [r.messages for r in sent]}


def print_step(name: str, results: list[dict], wall: float) -> None:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    ttft = ", ".join(f"{r['ttft_ms']:.0f}" for r in ok)
    pre = sum(r["prefilled_tokens"] for r in ok)
    print(f"    {name:<18} {ok[0]['label']:<28} TTFT ms {ttft:<40} prefilled {pre:>6}  wall {wall:6.1f} s", flush=True)


# -- machine and versions -----------------------------------------------------------------------


def machine_meta(args, model_dir: Path) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    # A tree exported for another machine carries its commit in COMMIT (git there may see another repo).
    stamp = REPO / "COMMIT"
    commit = stamp.read_text().strip() if stamp.is_file() else subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu,
            "cores": os.cpu_count(), "ram_gib": mem_kb / 2**20, "platform": platform.platform(),
            "mlx": metadata.version("mlx"), "mlx_lm": metadata.version("mlx-lm"), "prefixd_commit": commit or "unknown",
            "model_dir": str(model_dir), "quick": args.quick, "load_before": load_average()}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- main -----------------------------------------------------------------------------------------


def start_peers(model_dir: Path, workdir: Path) -> list:
    """Start the three systems one after another (so their loads do not skew each other)."""
    peers = []
    for cls in PEER_CLASSES:
        peer = cls(model_dir, workdir)
        peers.append(peer)  # appended first: stopped in `finally` even if start() fails
        t0 = time.perf_counter()
        peer.start()
        peer.startup_s = time.perf_counter() - t0
        print(f"  started {peer.name} (pid {peer.pid}) in {peer.startup_s:.1f} s", flush=True)
    return peers


WARM_UP = Request([{"role": "user", "content": "Hello"}], 2, "cold", "warm-up")


def warm_up(peers) -> None:
    """One untimed short request each: a process's first forward pass pays one-time setup that
    would otherwise land on the first cold TTFT (the in-process worker warms itself up)."""
    for peer in peers:
        if peer.concurrent:  # the servers; the in-process worker did its own
            run_step(peer, [WARM_UP])


FLOOR_REPEATS = 9


def warm_hit_floor(peers, messages: list[dict]) -> dict | None:
    """The in-process floor of a warm exact hit on the repeat workload's own prompt, in this run
    (bench/inproc_worker.py: copy of a ready cache + the last token's pass + argmax)."""
    inproc = next((p for p in peers if isinstance(p, InProcessPeer)), None)
    if inproc is None:
        return None
    floor = inproc.ask({"op": "floor", "messages": messages, "repeats": FLOOR_REPEATS})
    if "error" in floor:
        print(f"    in-process floor failed: {floor['error']}", flush=True)
        return None
    print(f"    in-process floor of a warm hit on this prompt: {floor['floor_ms']:.1f} ms (median of {FLOOR_REPEATS})",
          flush=True)
    return floor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short prompts, fewer turns/sessions (< 5 min)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="MLX model directory (float32 recommended)")
    parser.add_argument("--out", type=Path, default=BENCH / "results", help="where compare.md/.json and PNGs go")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    started = time.monotonic()
    run = {"meta": machine_meta(args, args.model), "sizes": vars(sizes), "peers": {}, "workloads": []}
    print(f"compare: {args.model} ({'quick' if args.quick else 'full'}), load average {load_average()}", flush=True)
    tokens = Tokens(args.model)
    workloads = build_workloads(tokens, sizes)
    floor = PrefillFloor()
    floor.add([tokens.chat(WARM_UP.messages)])
    peers = []
    try:
        with tempfile.TemporaryDirectory(prefix="prefixd-compare-") as tmp:
            try:
                peers = start_peers(args.model, Path(tmp))
                warm_up(peers)
                run["peers"] = {p.name: {"settings": p.settings, "startup_s": p.startup_s, "pid": p.pid} for p in peers}
                for w in workloads:
                    print(f"\n{w.title} ({w.notes}); load average {load_average()}", flush=True)
                    result = run_workload(w, peers)
                    if w.key == "repeat":
                        result["floor"] = warm_hit_floor(peers, result["sent_messages"][0])
                    result["min_prefill"] = floor.add([tokens.chat(m) for m in result.pop("sent_messages")])
                    run["workloads"].append(result)
            finally:
                for peer in peers:
                    peer.stop()
    except BenchError as exc:
        print(f"\ncompare failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted (all systems stopped)", file=sys.stderr)
        return 130
    run["meta"].update(load_after=load_average(), elapsed_s=time.monotonic() - started)
    write_outputs(run, args.out)
    return 0


def write_outputs(run: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = report.summarize(run)
    goals = report.targets(run, summary)
    run["summary"], run["targets"] = summary, goals
    text = report.markdown(run, summary, goals)
    print("\n" + text)
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    try:
        pngs = report.plots(run, summary, out)
    except ImportError:
        pngs = []
        print("(matplotlib is not installed: no plots; `.venv/bin/pip install matplotlib`)")
    print(f"written: {out / 'compare.md'}, {out / 'compare.json'}" + "".join(f", {out / p}" for p in pngs))


if __name__ == "__main__":
    sys.exit(main())
