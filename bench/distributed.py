#!/usr/bin/env python
"""One daemon on 1 rank and on N ranks (ring backend over loopback): decode speed and warm TTFT, by launcher.

    .venv/bin/python bench/distributed.py [--rounds 2] [--max-tokens 24] [--only llama|ministral3|smollm2 ...]
                                          [--launchers prefixd,mlx]

Each model on one process and then across ranks: the tiny random llama of
the tests on 2 ranks, tensor parallel (mlx-lm's shard()); the tiny random
ministral3 on 2 ranks, tensor and pipeline parallel (mlx-lm's pipeline():
2 of its 4 layers per rank); SmolLM2-135M-Instruct on 3, tensor (its 9
attention heads do not split over 2). Per round, a fresh prompt of about 600 tokens is sent cold (a miss:
full prefill), then again (an exact hit: one token to run), greedy,
``max_tokens`` tokens; the figures are the daemon's own timings, median over
rounds: cold TTFT, warm TTFT, decode tokens/s. Each ranked setup runs once per
launcher: ``prefixd`` (``--ranks N``, daemon/service/rank_launcher.py) and
``mlx`` (``mlx.launch -n N``, as a multi-machine set-up starts it), and the
launcher's own CPU seconds over the measurement are printed beside.

On this project's 2-core CPU machine, ranks share the same two cores, so
more ranks cannot be faster: the figures show what the lock-step costs
(a broadcast per engine iteration; tensor: an all_sum per layer's attention
and MLP output; pipeline: a send/recv per rank boundary and an all_gather of
the last hidden state per pass), not the speed-up of ranks that each have a device of their own.
Nothing fails on a number: it is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.daemon_process import DaemonProcess, RawConnection  # noqa: E402
from tests.e2e.ranked_daemon import RankedDaemon  # noqa: E402
from tests.support.tiny_models import ensure_tiny_model  # noqa: E402

SMOLLM2 = Path(os.environ.get("PREFIXD_MODELS_DIR", "~/.local/share/prefixd/models")).expanduser() / "SmolLM2-135M-Instruct"
FILLER = "A prefix cache keeps the keys and values of every prompt it has seen, so the next one starts warm. "


def measure(daemon: DaemonProcess, rounds: int, max_tokens: int) -> dict[str, float]:
    cold, warm, decode = [], [], []
    with RawConnection(daemon.socket_path, timeout=600) as conn:
        for round_number in range(rounds):
            prompt = f"Round {round_number}. " + FILLER * 30 + "Now write a long story about it:"
            params = {"prompt": prompt, "max_tokens": max_tokens}
            first = conn.result("generate", params)
            again = conn.result("generate", params)
            assert again["cache"]["hit"] == "exact" and again["text"] == first["text"], (first["cache"], again["cache"])
            cold.append(first["timings"]["ttft_ms"])
            warm.append(again["timings"]["ttft_ms"])
            decode.append(again["timings"]["decode_tokens_per_s"])
            prompt_tokens, completion_tokens = first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]
    return {"cold_ttft_ms": statistics.median(cold), "warm_ttft_ms": statistics.median(warm),
            "decode_tok_s": statistics.median(decode), "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(model: Path, num_ranks: int, parallel: str, launcher: str, workdir: Path, rounds: int,
        max_tokens: int) -> dict[str, float]:
    if num_ranks == 1:
        daemon: DaemonProcess = DaemonProcess([model], workdir / f"{model.name}-1")
    else:
        daemon = RankedDaemon([model], workdir / f"{model.name}-{num_ranks}-{parallel}-{launcher}", num_ranks=num_ranks,
                              extra_args=["--parallel", parallel], launcher=launcher)
    daemon.start(timeout=300)
    try:
        before = cpu_seconds(daemon.proc.pid)
        figures = measure(daemon, rounds, max_tokens)
        figures["launcher_cpu_s"] = cpu_seconds(daemon.proc.pid) - before if num_ranks > 1 else float("nan")
        return figures
    finally:
        daemon.stop(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--only", choices=["llama", "ministral3", "smollm2"], action="append",
                        help="measure only these models (repeatable; default all)")
    parser.add_argument("--launchers", default="prefixd,mlx",
                        help="how the ranks are started: prefixd (--ranks N), mlx (mlx.launch -n N); comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pfx-dist-") as tmp:
        workdir = Path(tmp)
        # (model, [(ranks, parallel mode), ...]); 1 rank is the plain one-process daemon.
        setups = {"llama": (lambda: ensure_tiny_model("llama", workdir / "models"), [(1, "-"), (2, "tensor")]),
                  "ministral3": (lambda: ensure_tiny_model("ministral3", workdir / "models"),
                                 [(1, "-"), (2, "tensor"), (2, "pipeline")]),
                  "smollm2": (lambda: SMOLLM2, [(1, "-"), (3, "tensor")])}
        chosen = args.only or list(setups)
        if "smollm2" in chosen and not (SMOLLM2 / "config.json").is_file():
            print(f"(SmolLM2 is not set up at {SMOLLM2}: run ./run setup; measuring the tiny models only)")
            chosen.remove("smollm2")
        launchers = args.launchers.split(",")
        print(f"{'model':<24} {'ranks':>5} {'mode':>8} {'launcher':>8} {'prompt':>6} {'cold TTFT ms':>12} "
              f"{'warm TTFT ms':>12} {'decode tok/s':>12} {'launcher CPU s':>14}")
        for name in chosen:
            make_model, runs = setups[name]
            model = make_model()
            for num_ranks, parallel in runs:
                for launcher in (["-"] if num_ranks == 1 else launchers):
                    figures = run(model, num_ranks, parallel, launcher, workdir, args.rounds, args.max_tokens)
                    print(f"{model.name:<24} {num_ranks:>5} {parallel:>8} {launcher:>8} {figures['prompt_tokens']:>6} "
                          f"{figures['cold_ttft_ms']:>12.1f} {figures['warm_ttft_ms']:>12.1f} "
                          f"{figures['decode_tok_s']:>12.1f} {figures['launcher_cpu_s']:>14.2f}", flush=True)
    print("ranks share this machine's cores: the figures show the lock-step's cost, not a speed-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
