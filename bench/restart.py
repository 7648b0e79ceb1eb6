#!/usr/bin/env python
"""What the disk cache buys across a restart: the real daemon, the real socket, figures printed.

    .venv/bin/python bench/restart.py [--quick] [--store-mib 1024] [--json out.json]

1. A ~3,000-token chat prompt on SmolLM2: cold TTFT, then warm (in memory).
2. SIGTERM (the daemon saves its prefix store to disk), start again: time until the socket answers
   ping, time until the background load is over (``disk_cache_loaded``), then the same prompt:
   TTFT from disk, with the reply's ``cache.source`` and the greedy text compared with the cold one.
3. Start-up with a big disk store: warm distinct ~2,000-token prompts (``cache.warm``) until the
   store holds about ``--store-mib`` MiB, SIGTERM, start again: time to ping and to the end of the
   lazy load. Start-up is what systemd waits for; the load runs while the daemon already serves.
Not a test: nothing fails when a target is missed; ratios are measured within this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness import BenchError, Daemon, connect, timed_generate  # noqa: E402
from prefix_cache import fit_system, stdlib_text  # noqa: E402

QUESTION = "Explain in one short paragraph what the module above is for."
MAX_TOKENS = 8
STORE_SOURCES = ["argparse.py", "inspect.py", "typing.py", "dataclasses.py", "pathlib.py", "subprocess.py",
                 "threading.py", "logging/__init__.py", "collections/__init__.py", "functools.py", "enum.py",
                 "tarfile.py", "zipfile/__init__.py", "shutil.py", "tempfile.py", "ast.py", "json/decoder.py",
                 "email/message.py", "http/client.py", "urllib/request.py", "asyncio/tasks.py", "pdb.py"]


def disk_args(cache_dir: Path) -> list[str]:
    return ["--disk-cache-bytes", "8G", "--cache-dir", str(cache_dir), "--disk-save-interval", "3600"]


def log_events(daemon: Daemon, event: str) -> list[dict]:
    found = []
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            found.append(entry)
    return found


def start_timed(daemon: Daemon, wait_for_load: bool = True) -> dict:
    """Start the daemon; seconds to the first ping answer and to the end of the disk-cache load."""
    started = time.perf_counter()
    daemon.start()
    ping_s = time.perf_counter() - started
    loaded_s = None
    if wait_for_load:
        deadline = time.monotonic() + 600
        while not (loaded := log_events(daemon, "disk_cache_loaded")):
            if time.monotonic() > deadline:
                raise BenchError(f"no disk_cache_loaded line within 600 s:\n{daemon.log_tail()}")
            time.sleep(0.05)
        loaded_s = time.perf_counter() - started
        return {"ping_s": ping_s, "loaded_s": loaded_s, "imported": loaded[-1].get("imported"),
                "skipped": loaded[-1].get("skipped"), "load_s_daemon": loaded[-1].get("load_s")}
    return {"ping_s": ping_s}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def restart_workload(model_dir: Path, work: Path, target_tokens: int) -> dict:
    cache_dir = work / "kv-restart"
    with Daemon(model_dir, work, disk_args(cache_dir)) as daemon, connect(daemon.socket_path) as conn:
        messages = fit_system(conn, stdlib_text("inspect.py"), QUESTION, target_tokens)
        params = dict(messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        timed_generate(conn, prompt="warm-up", max_tokens=2, cache={"use": False, "store": False})
        cold = timed_generate(conn, **params)
        warm = timed_generate(conn, **params)
    daemon = Daemon(model_dir, work, disk_args(cache_dir))
    try:
        startup = start_timed(daemon)
        with connect(daemon.socket_path) as conn:
            # The same untimed first call as before the cold run: measure the cache, not MLX's first-call setup.
            timed_generate(conn, prompt="warm-up", max_tokens=2, cache={"use": False, "store": False})
            from_disk = timed_generate(conn, **params)
    finally:
        daemon.stop()
    return {"cold": cold, "warm": warm, "from_disk": from_disk, "startup": startup, "disk_bytes": dir_bytes(cache_dir)}


def big_store_workload(model_dir: Path, work: Path, store_mib: int) -> dict:
    cache_dir = work / "kv-big"
    filled = 0
    with Daemon(model_dir, work, disk_args(cache_dir) + ["--cache-bytes", f"{store_mib + 512}M"]) as daemon, \
            connect(daemon.socket_path) as conn:
        started = time.perf_counter()
        for index in range(10_000):
            source = STORE_SOURCES[index % len(STORE_SOURCES)]
            lines = stdlib_text(source)
            offset = (index // len(STORE_SOURCES)) * 150  # distinct prompts once the list wraps
            messages = fit_system(conn, lines[offset:] or lines, f"Question {index}: what is {source} for?", 2000)
            conn.cache_warm(messages=messages)
            filled = conn.stats()["cache"]["total"]["num_bytes"]
            if filled >= store_mib << 20:
                break
        fill_s = time.perf_counter() - started
    disk = dir_bytes(cache_dir)
    daemon = Daemon(model_dir, work, disk_args(cache_dir) + ["--cache-bytes", f"{store_mib + 512}M"])
    try:
        startup = start_timed(daemon)
    finally:
        daemon.stop()
    return {"memory_bytes": filled, "disk_bytes": disk, "fill_s": fill_s, "startup": startup}


def report(restart: dict, big: dict) -> None:
    cold, warm, disk = (restart[k]["client_ttft_ms"] for k in ("cold", "warm", "from_disk"))
    prompt = restart["cold"]["cache"]["prompt_tokens"]
    print(f"\n## Repeated {prompt:,}-token prompt across a restart (SmolLM2, TTFT at the client)")
    print("| run | TTFT ms | reused | prefilled | hit | source | vs cold |")
    print("|---|---:|---:|---:|---|---|---:|")
    for name, key in (("cold", "cold"), ("warm, in memory", "warm"), ("after restart, from disk", "from_disk")):
        r = restart[key]
        c = r["cache"]
        print(f"| {name} | {r['client_ttft_ms']:,.0f} | {c['reused_tokens']:,} | {c['prefilled_tokens']:,} | {c['hit']} "
              f"| {c.get('source') or '-'} | {r['client_ttft_ms'] / cold:.1%} |")
    same = restart["from_disk"]["text"] == restart["cold"]["text"]
    print(f"\nfrom disk / cold: {disk / cold:.1%} (target: close to warm's {warm / cold:.1%}); "
          f"from disk / warm: {disk / warm:.2f}x; same greedy text as cold: {'yes' if same else 'NO'}")
    s = restart["startup"]
    print(f"restart: ping after {s['ping_s']:.2f} s, disk cache loaded after {s['loaded_s']:.2f} s "
          f"({s['imported']} entries, {restart['disk_bytes'] / (1 << 20):,.1f} MiB on disk)")
    b, bs = big, big["startup"]
    print(f"\n## Start-up with a {b['disk_bytes'] / (1 << 30):.2f} GiB disk store "
          f"(filled with cache.warm in {b['fill_s']:.0f} s; {b['memory_bytes'] / (1 << 20):,.0f} MiB in memory)")
    print(f"ping answered after {bs['ping_s']:.2f} s (serving starts before the load); "
          f"load over after {bs['loaded_s']:.2f} s ({bs['imported']} entries imported, {bs['skipped']} skipped; "
          f"{b['disk_bytes'] / (1 << 20) / max(bs['load_s_daemon'] or 1e-9, 1e-9):,.0f} MiB/s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", type=Path, help="SmolLM2 model dir (default: prefixd's setup)")
    parser.add_argument("--quick", action="store_true", help="a ~1,500-token prompt and a 256 MiB store")
    parser.add_argument("--store-mib", type=int, help="disk store size for the start-up figure (default 1024; quick 256)")
    parser.add_argument("--json", type=Path, help="write the raw replies and figures here")
    args = parser.parse_args()
    if args.smollm2 is None:
        from prefixd.daemon.models.model_setup import ensure_smollm2

        args.smollm2 = ensure_smollm2()
    store_mib = args.store_mib or (256 if args.quick else 1024)
    print(f"# prefixd restart benchmark · load average {os.getloadavg()[0]:.2f} · {time.strftime('%Y-%m-%d %H:%M')}")
    work = Path(tempfile.mkdtemp(prefix="pfx-restart-", dir="/tmp"))
    try:
        restart = restart_workload(args.smollm2, work, 1500 if args.quick else 3000)
        big = big_store_workload(args.smollm2, work, store_mib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(restart, big)
    if args.json:
        args.json.write_text(json.dumps({"restart": restart, "big_store": big}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
