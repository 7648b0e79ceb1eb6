"""Figures, targets and output (Markdown, JSON, PNG) for bench/compare.py.

``summarize`` turns the raw per-request results into one row per workload and system;
``targets`` checks the goals of the comparison; ``markdown`` and ``plots`` render them.
All ratios are prefixd / peer from the same run (same machine, same load).
"""

from __future__ import annotations

import math
import statistics

PREFIXD, SERVER, INPROC = "prefixd", "mlx-lm server", "in-process mlx-lm"
NAN = float("nan")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return NAN
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def decode_rate(result: dict) -> float | None:
    """Decode steps only: chunks after the first / seconds from the first chunk to the last.

    Older results without a ``decode_window`` fall back to (completion - 1) / (total - TTFT),
    which also counts what a server does after its last token.
    """
    window = result.get("decode_window")
    if window:
        return window["steps"] / window["seconds"]
    seconds = (result["total_ms"] - result["ttft_ms"]) / 1000
    if result.get("completion_tokens", 0) < 2 or seconds <= 0:
        return None
    return (result["completion_tokens"] - 1) / seconds


def summarize(run: dict) -> dict:
    """{workload key: {system: row}} with TTFT percentiles, prefill, decode, wall, memory."""
    out = {}
    for w in run["workloads"]:
        rows = out[w["key"]] = {}
        for name, p in w["peers"].items():
            done = [r for r in p["requests"] if "error" not in r]
            ttft = {ph: [r["ttft_ms"] for r in done if r["phase"] == ph] for ph in ("cold", "warm")}
            rates = [x for x in map(decode_rate, done) if x is not None]
            rows[name] = {
                "cold_p50": percentile(ttft["cold"], 50), "cold_p95": percentile(ttft["cold"], 95),
                "warm_p50": percentile(ttft["warm"], 50), "warm_p95": percentile(ttft["warm"], 95),
                "prompt_tokens": sum(r["prompt_tokens"] for r in done),
                "prefilled": sum(r["prefilled_tokens"] for r in done),
                "decode_tok_s": statistics.median(rates) if rates else NAN,
                "throughput": sum(r["completion_tokens"] for r in done) / p["wall_s"] if p["wall_s"] else NAN,
                "wall_s": p["wall_s"], "peak_mib": p["peak_kb"] / 1024, "errors": len(p["requests"]) - len(done),
                "error": p.get("error"),
            }
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else NAN


def targets(run: dict, summary: dict) -> list[dict]:
    """The goals, one line per workload where they apply; verdict 'met' / 'MISSED' / 'n/a'."""
    lines = []
    for w in run["workloads"]:
        s = summary[w["key"]]
        if PREFIXD not in s:
            continue
        if SERVER in s:
            r = ratio(s[PREFIXD]["warm_p50"], s[SERVER]["warm_p50"])
            lines.append(_target("warm TTFT p50 <= mlx-lm server's", w, s[PREFIXD]["warm_p50"], s[SERVER]["warm_p50"],
                                 r, r <= 1.0, "ms"))
        if INPROC in s:
            r = ratio(s[PREFIXD]["decode_tok_s"], s[INPROC]["decode_tok_s"])
            applies = not w["concurrent"]  # concurrent sessions share the CPU; in-process ran them one by one
            lines.append(_target("decode tok/s >= 0.95x in-process mlx-lm", w, s[PREFIXD]["decode_tok_s"],
                                 s[INPROC]["decode_tok_s"], r, r >= 0.95 if applies else None, "tok/s"))
        if w.get("floor") and PREFIXD in s:
            # Issue 13: within 1.5x of the floor on a GPU, 1.2x on a CPU.
            limit = 1.2 if "cpu" in w["floor"]["device"] else 1.5
            r = ratio(s[PREFIXD]["warm_p50"], w["floor"]["floor_ms"])
            lines.append(_target(f"warm TTFT p50 <= {limit}x the in-process floor", w, s[PREFIXD]["warm_p50"],
                                 w["floor"]["floor_ms"], r, r <= limit, "ms"))
        if w["key"] == "shared":
            r = ratio(s[PREFIXD]["prefilled"], w["min_prefill"])
            lines.append(_target("prefilled tokens <= 1.05x the minimum", w, s[PREFIXD]["prefilled"], w["min_prefill"],
                                 r, r <= 1.05, "tokens"))
    return lines


def _target(goal, w, ours, theirs, r, ok, unit) -> dict:
    verdict = "n/a" if ok is None or math.isnan(r) else ("met" if ok else "MISSED")
    return {"goal": goal, "workload": w["key"], "title": w["title"], "prefixd": ours, "reference": theirs,
            "ratio": r, "verdict": verdict, "unit": unit}


def agreement(run: dict) -> list[str]:
    """Sanity checks: do the systems see the same prompt tokens and produce the same greedy text?"""
    notes = []
    for w in run["workloads"]:
        peers = {n: p["requests"] for n, p in w["peers"].items()}
        if INPROC not in peers:
            continue
        ref = peers[INPROC]
        for name, reqs in peers.items():
            if name == INPROC:
                continue
            pairs = [(a, b) for a, b in zip(reqs, ref) if "error" not in a and "error" not in b]
            same_prompt = sum(a["prompt_tokens"] == b["prompt_tokens"] for a, b in pairs)
            same_text = sum(a["text"] == b["text"] for a, b in pairs)
            notes.append(f"{w['key']}: {name} vs in-process: same prompt token count {same_prompt}/{len(pairs)},"
                         f" same greedy text {same_text}/{len(pairs)}")
    return notes


# -- Markdown -------------------------------------------------------------------------------------


def fmt(x: float, digits: int = 0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def markdown(run: dict, summary: dict, goals: list[dict]) -> str:
    m = run["meta"]
    out = [f"# prefixd vs mlx-lm, side by side ({'quick' if m['quick'] else 'full'} run)", "",
           f"- date: {m['date']}; total bench time {m['elapsed_s']:.0f} s",
           f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.1f} GiB RAM; {m['platform']}",
           f"- load average (1/5/15 min): before {m['load_before']}, after {m['load_after']}"
           " (a test suite shared the machine: absolute times are inflated, ratios less so)",
           f"- mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, prefixd {m['prefixd_commit']}",
           f"- model: {m['model_dir']}", ""]
    out += [f"- **{name}**: {p['settings']}" for name, p in run["peers"].items()]
    out += ["", "All requests greedy (temperature 0), streamed; systems interleaved step by step, rotating the order.",
            "", "| workload | system | cold TTFT p50 ms | cold p95 | warm TTFT p50 ms | warm p95 | prompt tok |"
            " prefilled tok (min) | decode tok/s | out tok/s | wall s | peak MiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in run["workloads"]:
        for name, row in summary[w["key"]].items():
            broken = f" ({row['errors']} failed)" if row["errors"] or row["error"] else ""
            out.append(f"| {w['title']} | {name}{broken} | {fmt(row['cold_p50'])} | {fmt(row['cold_p95'])} |"
                       f" {fmt(row['warm_p50'])} | {fmt(row['warm_p95'])} | {row['prompt_tokens']:,} |"
                       f" {row['prefilled']:,} ({w['min_prefill']:,}) | {fmt(row['decode_tok_s'], 1)} | {fmt(row['throughput'], 1)} |"
                       f" {fmt(row['wall_s'], 1)} | {fmt(row['peak_mib'])} |")
    out += ["", "## Targets (ratios prefixd / reference, same run)", "",
            "| goal | workload | prefixd | reference | ratio | verdict |", "|---|---|---:|---:|---:|---|"]
    for g in goals:
        digits = 1 if g["unit"] != "tokens" else 0
        out.append(f"| {g['goal']} | {g['workload']} | {fmt(g['prefixd'], digits)} {g['unit']} |"
                   f" {fmt(g['reference'], digits)} {g['unit']} | {fmt(g['ratio'], 3)} | **{g['verdict']}** |")
    out += ["", "## Other ratios (prefixd / peer)", "", "| workload | peer | cold TTFT | warm TTFT | prefilled | decode | wall |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for w in run["workloads"]:
        s = summary[w["key"]]
        for name in (SERVER, INPROC):
            if PREFIXD in s and name in s:
                a, b = s[PREFIXD], s[name]
                out.append(f"| {w['key']} | {name} | {fmt(ratio(a['cold_p50'], b['cold_p50']), 2)} |"
                           f" {fmt(ratio(a['warm_p50'], b['warm_p50']), 3)} | {fmt(ratio(a['prefilled'], b['prefilled']), 3)} |"
                           f" {fmt(ratio(a['decode_tok_s'], b['decode_tok_s']), 2)} | {fmt(ratio(a['wall_s'], b['wall_s']), 2)} |")
    out += ["", "## Verdict in words", ""] + [f"- {line}" for line in plain_words(goals, run)]
    out += ["", "## Sanity checks", ""] + [f"- {line}" for line in agreement(run)]
    errors = [f"{w['key']} / {n}: {p['error']}" for w in run["workloads"] for n, p in w["peers"].items() if p.get("error")]
    out += [f"- FAILED: {e}" for e in errors]
    out += ["", COLUMNS]
    return "\n".join(out) + "\n"


def plain_words(goals: list[dict], run: dict) -> list[str]:
    """Shortfalls said plainly, one sentence each."""
    words = []
    for g in goals:
        if g["verdict"] == "MISSED":
            words.append(f"prefixd falls short on '{g['goal']}' in {g['title']}: {fmt(g['prefixd'], 1)} vs"
                         f" {fmt(g['reference'], 1)} {g['unit']} (ratio {fmt(g['ratio'], 3)}).")
    met = sum(g["verdict"] == "met" for g in goals)
    words.append(f"{met} of {sum(g['verdict'] != 'n/a' for g in goals)} applicable targets met.")
    if run["meta"]["quick"]:
        words.append("Quick mode: short prompts and few samples (p95 of 2-4 values is close to the max); "
                     "use the full run for claims.")
    return words


COLUMNS = """## Columns

- **cold TTFT**: time to first token of requests whose prompt no earlier request shared (beyond the chat
  template's first tokens), measured at the client (prefixd: request sent -> first `generate.chunk`;
  mlx-lm server: request sent -> first SSE chunk with content; in-process: inside the worker, from
  templating to the first `stream_generate` response). **warm TTFT**: requests whose prefix was sent
  before (repeats, later chat turns, round 2 of the shared prompt, edits). In-process mlx-lm has no
  cache, so its "warm" requests are cold prefills too: they show what the cache saves.
- **p50 / p95**: linear-interpolated percentiles over that workload's requests of that phase.
- **prompt tok**: templated prompt tokens reported by each system, summed. **prefilled tok**: prompt
  tokens the system actually ran (prefixd: `cache.prefilled_tokens`; mlx-lm server: `prompt_tokens -
  cached_tokens`; in-process: all). **(min)**: the fewest possible: the tokens this workload's prompts
  add to a token trie of every prompt sent so far in the run (1 for a prompt already seen whole).
  Generated tokens are not counted as seen, so a server that keeps its answers' KV can beat it on chat.
- **decode tok/s**: median over requests of (completion tokens - 1) / (total time - TTFT). For the
  concurrent workload it is per session while sessions share the CPU, so not comparable with in-process
  (which ran them one after another).
- **out tok/s**: completion tokens of the workload / wall s (for the concurrent workload: aggregate).
- **wall s**: sum over the workload's steps of that system's wall time (concurrent steps: all sessions).
- **peak MiB**: VmHWM (peak resident set) of the serving process after the workload (cumulative)."""


# -- plots ----------------------------------------------------------------------------------------


def plots(run: dict, summary: dict, outdir) -> list[str]:
    """summary.png (cold/warm TTFT, decode), prefilled.png, chat_turns.png; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [w["key"] for w in run["workloads"]]
    names = list(run["peers"])
    written = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (field, title, log) in zip(axes, [("cold_p50", "cold TTFT p50 (ms)", True),
                                             ("warm_p50", "warm TTFT p50 (ms)", True),
                                             ("decode_tok_s", "decode tok/s (median)", False)]):
        _bars(ax, keys, names, lambda k, n: summary[k].get(n, {}).get(field, NAN), title, log)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(outdir / "compare_summary.png", dpi=110)
    written.append("compare_summary.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    _bars(ax, keys, names, lambda k, n: summary[k].get(n, {}).get("prefilled", NAN), "prefilled tokens (x = minimum)", True)
    middle = 0.4 - 0.4 / max(len(names), 1)  # the centre of each group of bars
    ax.plot([i + middle for i in range(len(keys))], [w["min_prefill"] for w in run["workloads"]], "kx",
            markersize=10, label="minimum")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(outdir / "compare_prefilled.png", dpi=110)
    written.append("compare_prefilled.png")

    chat = next((w for w in run["workloads"] if w["key"] == "chat"), None)
    if chat:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, p in chat["peers"].items():
            ttft = [r.get("ttft_ms", NAN) for r in p["requests"]]
            ax.plot(range(1, len(ttft) + 1), ttft, marker="o", label=name)
        ax.set(xlabel="turn", ylabel="TTFT (ms)", yscale="log", title=chat["title"])
        ax.set_xticks(range(1, 1 + max(len(p["requests"]) for p in chat["peers"].values())))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(outdir / "compare_chat_turns.png", dpi=110)
        written.append("compare_chat_turns.png")
    plt.close("all")
    return written


def _bars(ax, keys, names, value, title, log) -> None:
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        ax.bar([i + j * width for i in range(len(keys))], [value(k, name) for k in keys], width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(keys))], keys)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
