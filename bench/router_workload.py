"""Many daemons behind a cache-aware router: prefix reuse and warm TTFT, cache_aware against round_robin and one daemon.

    .venv/bin/python bench/router_workload.py [--quick] [--model DIR] [--out bench/results/DATE-router]

Runs the same multi-tenant chat workload (bench/router_client.py: tenants with
long system prompts of their own, several sessions each, two turns, arriving
interleaved; every request names its tenant in smg's routing-key header) against,
in turn and each from cold:

* one daemon alone with all the memory (``--daemons`` times a daemon's), behind the router;
* ``--daemons`` daemons behind smg with ``--policy cache_aware`` (routing by request text);
* the same behind ``--policy manual --assignment-mode min_group`` (routing by the tenant's key: a new
  tenant goes to the daemon with the fewest tenants in flight, then stays there);
* the same behind smg with ``--policy round_robin``;
* with ``--policies ...,prefix_hash``, the same behind ``--policy prefix_hash`` (a consistent-hash ring
  over the request's first 256 tokens, 1,024 characters of an untokenized request: its system prompt,
  with bounded load);

once for each per-daemon ``--cache-bytes`` in ``--cache-mib``. The first size is the question routing
answers, a memory-bound fleet: each daemon has room for its third of the tenants' prefixes plus the KV
its running requests reserve when every client is on it at once (a running request reserves what its KV
can grow to, more than a tenant's stored prefix here), but not for every tenant, while one daemon with
three times the memory holds them all. With SmolLM2 and this workload that is 224 MiB (a third of the
220 MiB one daemon stores, plus up to 151 MiB reserved; the report's peak row shows both). The second,
160 MiB, is a fleet short of that room: running requests push out even an evenly placed daemon's
prefixes. While each run goes, every daemon's store is sampled each second (bytes held and reserved,
evictions), so the report says which daemon evicted, when, and with which tenants.

Then a fault: under cache_aware, with the disk cache on, the daemon that holds
the most tenants is killed (SIGKILL) under load and started again on the same
port. Each reply's ``usage.prompt_tokens_details.cached_tokens`` gives the
reuse; the router's ``x-smg-routed-worker-id`` header names the daemon.

Targets: a cache-aware policy's reused share within 5 points of one daemon's,
and at least twice round_robin's. Writes report.md, results.json and records.jsonl to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from compare import load_average, machine_meta  # noqa: E402
from router_client import run_turns, workload  # noqa: E402
from router_fleet import SMG_VERSION, Fleet, LoadSampler, find_smg  # noqa: E402
from router_report import fault_summary, render_report, summarize  # noqa: E402

SMOLLM2 = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"
MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--daemons", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=4, help="sessions per tenant")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--system-words", type=int, default=450, help="words in each tenant's system prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--cache-mib", default="224,160",
                        help="each daemon's --cache-bytes in MiB; a comma-separated list runs the policies once per size")
    parser.add_argument("--fork-modes", default="auto",
                        help="the daemons' --fork; a comma-separated list (copy,auto) runs each size once per mode, "
                             "so a size's figures with and without reading stored prefixes in place come from one run")
    parser.add_argument("--policies", default="cache_aware,tenant_key,round_robin",
                        help=f"the fleet's runs, comma-separated, of {', '.join(FLEET_RUNS)} (round_robin is always run)")
    parser.add_argument("--fault-seconds", type=float, default=12.0, help="how long the killed daemon stays down")
    parser.add_argument("--no-fault", action="store_true", help="skip the kill-and-restart phase")
    parser.add_argument("--quick", action="store_true", help="3 tenants x 2 sessions, short prompts, a short fault")
    parser.add_argument("--out", type=Path, default=None, help="folder for report.md and results.json")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one request may take")
    args = parser.parse_args(argv)
    args.cache_mib = [int(size) for size in str(args.cache_mib).split(",")]
    args.fork_modes = [mode for mode in str(args.fork_modes).split(",") if mode]
    args.policies = [key for key in str(args.policies).split(",") if key]
    unknown = [key for key in args.policies if key not in FLEET_RUNS]
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)}; choose from {', '.join(FLEET_RUNS)}")
    if "round_robin" not in args.policies:
        args.policies.append("round_robin")  # the report's targets are ratios to it
    if args.quick:
        args.tenants, args.sessions, args.system_words, args.fault_seconds = 3, 2, 150, 6.0
        args.cache_mib = args.cache_mib[:1]
    return args


# --policies: the fleet's runs, as (name in the report, smg's --policy); round_robin is the baseline, always run.
FLEET_RUNS = {"cache_aware": ("cache_aware", "cache_aware"), "tenant_key": ("tenant key", "manual"),
              "prefix_hash": ("prefix_hash", "prefix_hash"), "round_robin": ("round_robin", "round_robin")}
# First, one daemon with all the memory behind the router.
SINGLE_RUN = ("one daemon", "cache_aware")


def run_policies(args: argparse.Namespace, workdir: Path, cache_mib: int, fork: str,
                 records: list[dict[str, Any]]) -> dict[str, Any]:
    """One daemon with all the memory, then the fleet under each of ``--policies``, every daemon with ``--fork fork``."""
    single_name, single_policy = SINGLE_RUN
    fleet_runs = [FLEET_RUNS[key] for key in args.policies]
    return {"cache_mib_each": cache_mib, "fork": fork, "runs": [
        run_policy(args, workdir, single_name, 1, single_policy, cache_mib * args.daemons, fork, records),
        *(run_policy(args, workdir, name, args.daemons, policy, cache_mib, fork, records)
          for name, policy in fleet_runs)]}


def run_policy(args: argparse.Namespace, workdir: Path, name: str, num_daemons: int, policy: str,
               cache_mib: int, fork: str, all_records: list[dict[str, Any]]) -> dict[str, Any]:
    print(f"== {name}: {num_daemons} daemon(s) x {cache_mib} MiB, --fork {fork}, smg --policy {policy}", flush=True)
    with Fleet(args.model, workdir / f"{name}-{cache_mib}-{fork}", num_daemons, policy, cache_mib * MIB,
               ["--fork", fork]) as fleet:
        order = workload(args.tenants, args.sessions, args.turns)
        sampler = LoadSampler(fleet.daemons, cache_mib * MIB)
        sampler.start()
        started = time.monotonic()
        records = run_turns(fleet.router.url, fleet.token, args.model.name, order, args.system_words, args.max_tokens,
                            args.concurrency, args.timeout)
        wall_s = time.monotonic() - started
        samples = sampler.stop()
        daemon_urls = [d.url for d in fleet.daemons]
        stores = [d.store() for d in fleet.daemons]
    all_records.extend({"run": name, "cache_mib": cache_mib, "fork": fork, "sent_s": round(r["sent_at"] - started, 2), **r}
                       for r in records)
    summary = summarize(name, records, daemon_urls, wall_s)
    summary["evictions_per_daemon"] = [store["num_evictions"] for store in stores]
    summary["stored_mib_per_daemon"] = [round(store["num_bytes"] / MIB) for store in stores]
    summary["peak_stored_mib_per_daemon"] = [round(max((s[1] for s in daemon), default=0) / MIB) for daemon in samples]
    summary["peak_reserved_mib_per_daemon"] = [round(max((s[2] for s in daemon), default=0) / MIB) for daemon in samples]
    summary["first_eviction_s_per_daemon"] = [next((s[0] for s in daemon if s[3] > 0), None) for daemon in samples]
    summary["store_samples"] = samples
    print(f"   reused {summary['reuse_share']:.1%} of prompt tokens, warm TTFT p50 {summary['warm_ttft_p50_s']:.3f} s, "
          f"{summary['failed']} failed, {wall_s:.0f} s", flush=True)
    return summary


def run_fault(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Warm every tenant, then kill the busiest daemon under load and start it again from its disk cache."""
    print(f"== fault: {args.daemons} daemons, cache_aware, one killed for {args.fault_seconds:.0f} s", flush=True)
    daemon_args = ["--disk-cache-bytes", "1G", "--disk-save-interval", "1", "--fork", args.fork_modes[-1]]
    with Fleet(args.model, workdir / "fault", args.daemons, "cache_aware", args.cache_mib[0] * MIB,
               daemon_args) as fleet:
        warm = run_turns(fleet.router.url, fleet.token, args.model.name, workload(args.tenants, 1, 1), args.system_words,
                         args.max_tokens, args.concurrency, args.timeout)
        home = {r["tenant"]: r["worker"] for r in warm if r["ok"]}
        victim_url = max(set(home.values()), key=list(home.values()).count)
        victim = fleet.daemons[fleet.daemon_at(victim_url)]
        time.sleep(2.5)  # a disk save (every second) has written what the warm-up stored
        stop = threading.Event()
        # Sessions 1.. of every tenant, turn 0 only: each reuses its tenant's system prompt.
        order = [t for t in workload(args.tenants, 400, 1, seed=1) if t.session > 0]
        load: list[dict[str, Any]] = []
        sender = threading.Thread(target=lambda: load.extend(run_turns(
            fleet.router.url, fleet.token, args.model.name, order, args.system_words, args.max_tokens, args.concurrency,
            args.timeout, stop)))
        sender.start()
        time.sleep(3.0)
        killed_at = time.monotonic()
        victim.kill()
        print(f"   killed {victim.name}", flush=True)
        time.sleep(args.fault_seconds)
        victim.start()
        back_at = time.monotonic()
        print(f"   {victim.name} is back after {back_at - killed_at:.1f} s", flush=True)
        time.sleep(max(30.0, 2 * args.fault_seconds))
        stop.set()
        sender.join()
        summary = fault_summary(load, victim_url, [t for t, url in home.items() if url == victim_url],
                                killed_at, back_at, [d.url for d in fleet.daemons])
    print(f"   during the outage: {summary['outage_ok']} ok, {summary['outage_failed']} failed, "
          f"slowest {summary['outage_max_s']:.1f} s; after: first request to it {summary['back_first_routed_s']} s "
          f"after its restart, reused {summary['back_reuse_share']}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if find_smg() is None:
        print("smg (Shepherd Model Gateway) is not installed: pip install smg (the test extra has it)", file=sys.stderr)
        return 2
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}: ./run setup imports SmolLM2, or pass --model", file=sys.stderr)
        return 2
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pfx-router-") as tmp:
        workdir = Path(tmp)
        results = {
            "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
            "machine": machine_meta(args, args.model),
            "smg_version": SMG_VERSION,
            "regimes": [run_policies(args, workdir, cache_mib, fork, records)
                        for cache_mib in args.cache_mib for fork in args.fork_modes],
        }
        if not args.no_fault:
            results["fault"] = run_fault(args, workdir)
        results["machine"]["load_after"] = load_average()
    report = render_report(results)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "report.md").write_text(report)
        (args.out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"wrote {args.out}/report.md, results.json and records.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
