#!/usr/bin/env python
"""A campaign of hostile inputs and injected faults against the real daemon, with a bystander watching.

    .venv/bin/python bench/hostile.py [--quick] [--model DIR] [--json out.json]

A bystander client sends one greedy request over and over (cache off) and
checks every answer against the one it got before the campaign. Meanwhile
the campaign sends malformed frames, wrong params, oversized and deeply
nested messages, prompts that cannot fit, a thousand-message chat, one-token
prompts at once, cancel storms, connection floods and vanishing clients;
then it restarts the daemon with faults injected at each step of the engine
loop (PREFIXD_FAULTS, see daemon/engine/faults.py) and does it again.

Printed: inputs tried, proper error replies, connections closed without a
reply where the protocol promises one (target 0), daemon crashes (target 0),
bystander wrong or failed answers (target 0), the bystander's worst wait
against its median, and the daemon's RSS before and after. Exit code 1 when
a target is missed. tests/e2e/test_hostile_campaign.py runs the --quick form.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BenchError, Daemon  # noqa: E402
from hostile_cases import (Outcome, Wire, frame_cases, run_cancel_storm, run_connection_flood,  # noqa: E402
                           run_frames, run_together, run_vanishing_stream)

BYSTANDER = {"prompt": "The bystander asks: what is two plus two?", "max_tokens": 8,
             "cache": {"use": False, "store": False}}
FAULT_PLANS = ["admit:2", "prefill:3", "first_token:2", "decode_step:4", "token:5", "finish:3",
               "store_answer:2", "loop:6", "control:3"]


class Bystander(threading.Thread):
    """Asks the same greedy question until stopped; records each answer's wait and whether it was right."""

    def __init__(self, socket_path: Path, expected: str):
        super().__init__(daemon=True)
        self.socket_path, self.expected = socket_path, expected
        self.waits: list[float] = []
        self.started: list[float] = []  # monotonic start of each ask
        self.num_wrong = self.num_failed = 0
        self.num_injected = 0  # failed by a fault the campaign injected: the daemon did what it should
        self.stopping = threading.Event()

    def run(self) -> None:
        msgid = 0
        while not self.stopping.is_set():
            msgid += 1
            started = time.monotonic()
            try:
                wire = Wire(self.socket_path, timeout=120)
                try:
                    wire.send([0, msgid, "generate", [BYSTANDER]])
                    responses = wire.responses(1, timeout=120)
                finally:
                    wire.close()
            except OSError:
                responses = []
            self.waits.append(time.monotonic() - started)
            self.started.append(started)
            if responses and responses[0][2] is not None and "injected fault" in str(responses[0][2]):
                self.num_injected += 1
            elif not responses or responses[0][2] is not None:
                self.num_failed += 1
            elif responses[0][3]["text"] != self.expected:
                self.num_wrong += 1


def ask(socket_path: Path, params: dict, attempts: int = 5) -> dict:
    """One generate's result; an answer failed by an injected fault is asked again."""
    for _ in range(attempts):
        wire = Wire(socket_path, timeout=120)
        try:
            wire.send([0, 1, "generate", [params]])
            responses = wire.responses(1, timeout=120)
        finally:
            wire.close()
        if responses and responses[0][2] is None:
            return responses[0][3]
        if not (responses and "injected fault" in str(responses[0][2])):
            break
    raise BenchError(f"generate failed: {responses}")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def campaign(socket_path: Path, quick: bool) -> tuple[list[Outcome], list[tuple[str, float, float]]]:
    """The outcomes, and (case, start, end) on the monotonic clock, to tell what a slow bystander answer overlapped."""
    steps = [lambda name=name, frames=frames, expected=expected: run_frames(socket_path, name, frames, expected)
             for name, frames, expected in frame_cases(1 << 20)]  # an id beyond any vocabulary here
    steps += [
        lambda: run_together(socket_path, "three 1-token prompts at once",
                             lambda i: [0, 1, "generate", [{"prompt": "Hi", "max_tokens": 1}]], 3),
        lambda: run_together(socket_path, "eight sessions on one prompt at once",
                             lambda i: [0, 1, "generate", [{"prompt": f"shared start, then {i}", "max_tokens": 3}]], 8),
        lambda: run_cancel_storm(socket_path, 8 if quick else 40),
        lambda: run_connection_flood(socket_path, 50 if quick else 300),
        lambda: run_vanishing_stream(socket_path),
    ]
    outcomes, spans = [], []
    for step in steps:
        started = time.monotonic()
        outcome = step()
        outcomes.append(outcome)
        spans.append((outcome.case, started, time.monotonic()))
    return outcomes, spans


def worst_wait_during(bystander: "Bystander", spans: list[tuple[str, float, float]]) -> str:
    """The campaign cases that ran while the bystander waited longest."""
    if not bystander.waits:
        return ""
    index = max(range(len(bystander.waits)), key=bystander.waits.__getitem__)
    start, end = bystander.started[index], bystander.started[index] + bystander.waits[index]
    return ", ".join(case for case, a, b in spans if a < end and b > start)


def run_daemon_phase(model: Path, workdir: Path, label: str, faults: str | None, quick: bool) -> dict:
    daemon = Daemon(model, workdir, extra_args=["--max-active", "8"])
    if faults:
        daemon.env = {**daemon.env, "PREFIXD_FAULTS": faults}
    daemon.start()
    try:
        expected = ask(daemon.socket_path, BYSTANDER)["text"]
        baseline = [0.0]
        for _ in range(3):
            started = time.monotonic()
            ask(daemon.socket_path, BYSTANDER)
            baseline.append(time.monotonic() - started)
        rss_before = rss_bytes(daemon.proc.pid)
        bystander = Bystander(daemon.socket_path, expected)
        bystander.start()
        outcomes, spans = campaign(daemon.socket_path, quick)
        bystander.stopping.set()
        bystander.join(180)
        crashed = daemon.proc.poll() is not None
        rss_after = 0 if crashed else rss_bytes(daemon.proc.pid)
    finally:
        daemon.stop()
    exit_code = daemon.proc.returncode
    return {
        "label": label, "faults": faults, "outcomes": [asdict(o) for o in outcomes],
        "crashed": crashed or exit_code not in (0, None), "exit_code": exit_code,
        "bystander": {"answers": len(bystander.waits), "wrong": bystander.num_wrong, "failed": bystander.num_failed,
                      "failed_by_injected_fault": bystander.num_injected,
                      "worst_wait_s": round(max(bystander.waits, default=0.0), 3),
                      "median_wait_s": round(statistics.median(bystander.waits), 3) if bystander.waits else None,
                      "alone_wait_s": round(statistics.median(baseline[1:]), 3),
                      "worst_wait_during": worst_wait_during(bystander, spans)},
        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
    }


def summarize(phases: list[dict]) -> dict:
    outcomes = [o for phase in phases for o in phase["outcomes"]]
    return {
        "inputs_tried": len(outcomes),
        "replies_promised": sum(o["replies_expected"] for o in outcomes),
        "proper_error_replies": sum(sum(o["errors"].values()) for o in outcomes),
        "closed_without_reply": sum(o["closed_without_reply"] for o in outcomes),
        "no_reply_in_time": sum(o["timed_out"] for o in outcomes),
        "daemon_crashes": sum(1 for phase in phases if phase["crashed"]),
        "bystander_wrong": sum(phase["bystander"]["wrong"] for phase in phases),
        "bystander_failed": sum(phase["bystander"]["failed"] for phase in phases),
    }


def print_report(phases: list[dict], totals: dict) -> None:
    print("\n| phase | inputs | replies promised / got | closed w/o reply | crash | bystander answers (wrong, failed) "
          "| bystander wait: alone / median / worst | RSS before -> after |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for phase in phases:
        outs, b = phase["outcomes"], phase["bystander"]
        promised, got = sum(o["replies_expected"] for o in outs), sum(o["replies"] for o in outs)
        print(f"| {phase['label']} | {len(outs)} | {promised} / {got} | {sum(o['closed_without_reply'] for o in outs)} "
              f"| {'YES' if phase['crashed'] else 'no'} | {b['answers']} ({b['wrong']}, {b['failed']}) "
              f"| {b['alone_wait_s']} / {b['median_wait_s']} / {b['worst_wait_s']} s "
              f"| {phase['rss_before_bytes'] >> 20} -> {phase['rss_after_bytes'] >> 20} MiB |")
    for phase in phases:
        print(f"  {phase['label']}: the bystander's worst wait overlapped: {phase['bystander']['worst_wait_during']}")
        for o in phase["outcomes"]:
            if o["closed_without_reply"] or o["timed_out"]:
                print(f"  {o['case']} ({phase['label']}): closed without reply {o['closed_without_reply']}, "
                      f"no reply in time {o['timed_out']}")
    print("\n" + "  ".join(f"{key}={value}" for key, value in totals.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: SmolLM2 from `prefixd setup`)")
    parser.add_argument("--quick", action="store_true", help="the short form (CI): fewer fault plans, smaller floods")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from prefixd.daemon.models.model_setup import ensure_smollm2

        model = ensure_smollm2()
    plans = FAULT_PLANS[:3] if args.quick else FAULT_PLANS
    phases = []
    with tempfile.TemporaryDirectory(prefix="prefixd-hostile.") as tmp:
        for index, faults in enumerate([None, ",".join(plans)] if args.quick else [None, *plans]):
            workdir = Path(tmp) / f"phase{index}"
            workdir.mkdir()
            label = "hostile inputs" if faults is None else f"faults {faults}"
            print(f"==> {label}", file=sys.stderr)
            phases.append(run_daemon_phase(model, workdir, label, faults, args.quick))
    totals = summarize(phases)
    print_report(phases, totals)
    if args.json:
        args.json.write_text(json.dumps({"phases": phases, "totals": totals}, indent=2))
    met = (totals["closed_without_reply"] == 0 and totals["no_reply_in_time"] == 0 and totals["daemon_crashes"] == 0
           and totals["bystander_wrong"] == 0 and totals["bystander_failed"] == 0)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
