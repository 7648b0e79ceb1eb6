"""Figures of bench/router_workload.py: per policy run and for the fault, and the Markdown report."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(name: str, records: list[dict[str, Any]], daemon_urls: list[str], wall_s: float) -> dict[str, Any]:
    """Reuse (all requests, and warm ones: all but each tenant's first), TTFTs, and where each tenant went."""
    ok = [r for r in records if r["ok"]]
    warm = [r for r in ok if not r["first_of_tenant"]]
    cold = [r for r in ok if r["first_of_tenant"]]
    daemons_of_tenant: dict[int, set[str]] = defaultdict(set)
    for r in ok:
        daemons_of_tenant[r["tenant"]].add(r["worker"])
    served = Counter(r["worker"] for r in ok)
    home: dict[int, str] = {}
    for r in sorted(ok, key=lambda r: r["sent_at"]):
        home.setdefault(r["tenant"], r["worker"])
    # A warm request that found less than half its prompt stored: its tenant's prefix was evicted
    # from that daemon, or the tenant had not been there before.
    thin = Counter(r["worker"] for r in warm if r["cached_tokens"] * 2 < r["prompt_tokens"])
    return {
        "name": name,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if r.get("error")})[:5],
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "reused_tokens": sum(r["cached_tokens"] for r in ok),
        "reuse_share": _share(sum(r["cached_tokens"] for r in ok), sum(r["prompt_tokens"] for r in ok)),
        "warm_reuse_share": _share(sum(r["cached_tokens"] for r in warm), sum(r["prompt_tokens"] for r in warm)),
        "in_place_share": _share(sum((r.get("cache") or {}).get("in_place_tokens", 0) for r in ok),
                                 sum(r["cached_tokens"] for r in ok)),
        "warm_ttft_p50_s": _quantile([r["ttft_s"] for r in warm], 0.5),
        "warm_ttft_p90_s": _quantile([r["ttft_s"] for r in warm], 0.9),
        "warm_ttft_mean_s": statistics.fmean(r["ttft_s"] for r in warm) if warm else None,
        "warm_server_ttft_p50_s": _quantile([r["server_ttft_s"] for r in warm], 0.5),
        "cold_ttft_p50_s": _quantile([r["ttft_s"] for r in cold], 0.5),
        "daemons_per_tenant": statistics.fmean(len(d) for d in daemons_of_tenant.values()) if daemons_of_tenant else 0,
        "requests_per_daemon": [sum(n for url, n in served.items() if url.rstrip("/") == d) for d in daemon_urls],
        "tenants_per_daemon": [sorted(t for t, url in home.items() if url.rstrip("/") == d) for d in daemon_urls],
        "warm_misses_per_daemon": [sum(n for url, n in thin.items() if url.rstrip("/") == d) for d in daemon_urls],
        "wall_s": wall_s,
    }


def fault_summary(load: list[dict[str, Any]], victim_url: str, victim_tenants: list[int], killed_at: float,
                  back_at: float, daemon_urls: list[str]) -> dict[str, Any]:
    """What the clients saw while the victim was down, and whether it served (warm) once it was back."""
    sent = [r for r in load if not r.get("skipped")]
    outage = [r for r in sent if killed_at <= r["sent_at"] < back_at]
    in_flight = [r for r in sent if r["sent_at"] < killed_at <= r["sent_at"] + r["total_s"]]
    after = sorted((r for r in sent if r["sent_at"] >= back_at), key=lambda r: r["sent_at"])
    to_victim = [r for r in after if r["ok"] and r["worker"] == victim_url]
    first_routed = to_victim[0]["sent_at"] - back_at if to_victim else None
    return {
        "victim": daemon_urls.index(victim_url),
        "victim_tenants": victim_tenants,
        "down_s": round(back_at - killed_at, 1),
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": sum(not r["ok"] for r in in_flight),
        "outage_ok": sum(r["ok"] for r in outage),
        "outage_failed": sum(not r["ok"] for r in outage),
        "outage_errors": sorted({r["error"] for r in outage + in_flight if r.get("error")})[:5],
        "outage_max_s": max((r["total_s"] for r in outage + in_flight), default=0.0),
        "after_ok": sum(r["ok"] for r in after),
        "after_failed": sum(not r["ok"] for r in after),
        "back_requests": len(to_victim),
        "back_first_routed_s": round(first_routed, 1) if first_routed is not None else None,
        "back_reuse_share": round(_share(sum(r["cached_tokens"] for r in to_victim),
                                         sum(r["prompt_tokens"] for r in to_victim)), 3) if to_victim else None,
        "back_first_cache": to_victim[0].get("cache") if to_victim else None,
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_report(results: dict[str, Any]) -> str:
    settings, machine = results["settings"], results["machine"]
    lines = [
        f"# Many daemons behind smg {results['smg_version']}: cache_aware and tenant keys vs round_robin vs one daemon",
        "",
        f"{machine['date']}, {machine['cpu']} ({machine['cores']} cores), prefixd {machine['prefixd_commit']}, "
        f"mlx {machine['mlx']}; model {settings['model']}; load average {machine['load_before']} before, "
        f"{machine.get('load_after', '?')} after.",
        f"Workload: {settings['tenants']} tenants x {settings['sessions']} sessions x {settings['turns']} turns, "
        f"system prompts of {settings['system_words']} words, max_tokens {settings['max_tokens']}, "
        f"{settings['concurrency']} clients, {settings['daemons']} daemons; one daemon alone gets all their memory. "
        "Every request names its tenant in `x-smg-routing-key`; only `tenant key` reads it.",
        "Router: `smg launch --load-monitor-interval 1` and `--policy cache_aware` (the request text's prefix "
        "tree; a prefix it has not seen goes to the lowest expected wait), `--policy manual --assignment-mode "
        "min_group` (tenant key: a new key goes to the daemon with the fewest keys in flight, then stays), "
        "`--policy prefix_hash` (a consistent-hash ring over the request's first 1,024 characters, walked on "
        "past a daemon with over 1.25x the average load), or `--policy round_robin`.",
    ]
    for regime in results["regimes"]:
        fork = regime.get("fork", "auto")
        lines += ["", f"**{regime['cache_mib_each']} MiB --cache-bytes per daemon, --fork {fork}**", ""]
        lines += _policy_table(regime["runs"])
    if results.get("fault"):
        lines += _fault_lines(results["fault"], results["regimes"][0]["cache_mib_each"])
    return "\n".join(lines) + "\n"


def _per_daemon(values: list[Any]) -> str:
    return " / ".join("-" if v is None else str(v) for v in values)


def _policy_table(runs: list[dict[str, Any]]) -> list[str]:
    single = runs[0]
    robin = next(r for r in runs if r["name"] == "round_robin")

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(r) for r in runs) + " |"

    lines = [
        "| | " + " | ".join(r["name"] for r in runs) + " |",
        "|---|" + "---:|" * len(runs),
        row("requests (failed)", lambda r: f"{r['requests']} ({r['failed']})"),
        row("prompt tokens reused", lambda r: f"{r['reuse_share']:.1%}"),
        row("... of warm requests (all but each tenant's first)", lambda r: f"{r['warm_reuse_share']:.1%}"),
        row("... of them read in place, not copied (--fork)", lambda r: f"{r.get('in_place_share', 0):.1%}"),
        row("warm TTFT p50 / p90, s (client, through the router)",
            lambda r: f"{_seconds(r['warm_ttft_p50_s'])} / {_seconds(r['warm_ttft_p90_s'])}"),
        row("warm TTFT p50 in the daemon, s", lambda r: _seconds(r["warm_server_ttft_p50_s"])),
        row("first request of a tenant, TTFT p50, s", lambda r: _seconds(r["cold_ttft_p50_s"])),
        row("daemons that served each tenant (mean)", lambda r: f"{r['daemons_per_tenant']:.2f}"),
        row("tenants placed per daemon (by first request)",
            lambda r: " / ".join(",".join(map(str, ts)) or "-" for ts in r["tenants_per_daemon"])),
        row("requests per daemon", lambda r: _per_daemon(r["requests_per_daemon"])),
        row("warm requests with < half their prompt stored, per daemon", lambda r: _per_daemon(r["warm_misses_per_daemon"])),
        row("prefix-store evictions per daemon", lambda r: _per_daemon(r["evictions_per_daemon"])),
        row("first eviction, s into the run, per daemon", lambda r: _per_daemon(r["first_eviction_s_per_daemon"])),
        row("peak stored / peak reserved by running requests, MiB, per daemon",
            lambda r: " / ".join(f"{s}+{v}" for s, v in zip(r["peak_stored_mib_per_daemon"], r["peak_reserved_mib_per_daemon"]))),
        row("prefix store at the end per daemon, MiB", lambda r: _per_daemon(r["stored_mib_per_daemon"])),
        row("wall time, s", lambda r: f"{r['wall_s']:.0f}"),
        "",
    ]
    for aware in runs[1:]:
        if aware is robin:
            continue
        lines.append(
            f"Targets, {aware['name']}: within 5 points of one daemon: {aware['reuse_share']:.1%} vs "
            f"{single['reuse_share']:.1%} ({'met' if single['reuse_share'] - aware['reuse_share'] <= 0.05 else 'missed'}); "
            f"at least 2x round_robin: {_share(aware['reuse_share'], robin['reuse_share']):.2f}x "
            f"({'met' if aware['reuse_share'] >= 2 * robin['reuse_share'] else 'missed'}).")
    for r in runs:
        if r["errors"]:
            lines.append(f"Errors ({r['name']}): " + "; ".join(r["errors"]))
    return lines


def _fault_lines(fault: dict[str, Any], cache_mib: int) -> list[str]:
    reuse = fault["back_reuse_share"]
    first = fault["back_first_cache"] or {}
    lines = [
        "",
        f"**Fault** (cache_aware, {cache_mib} MiB per daemon, disk cache on): daemon {fault['victim']} (tenants "
        f"{fault['victim_tenants']}) killed with SIGKILL under load, started again after {fault['down_s']} s on the same port.",
        "",
        "| | figure |",
        "|---|---:|",
        f"| requests in flight at the kill (failed) | {fault['in_flight_at_kill']} ({fault['in_flight_failed']}) |",
        f"| requests sent while it was down: ok / failed | {fault['outage_ok']} / {fault['outage_failed']} |",
        f"| slowest of those, s | {fault['outage_max_s']:.2f} |",
        f"| requests after its restart: ok / failed | {fault['after_ok']} / {fault['after_failed']} |",
        f"| first request routed to it, s after its restart | {fault['back_first_routed_s']} |",
        f"| requests it served after the restart, prompt tokens reused | {fault['back_requests']}, "
        f"{'-' if reuse is None else format(reuse, '.1%')} |",
        f"| its first reply's cache map after the restart | hit {first.get('hit')}, source {first.get('source')} |",
    ]
    if fault["outage_errors"]:
        lines.append("Errors seen: " + "; ".join(fault["outage_errors"]))
    return lines
