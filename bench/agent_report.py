"""Figures, targets and output (Markdown, JSON) for bench/agent_workload.py.

All ratios are prefixd / mlx-lm server from the same run. Targets: on a GPU, warm TTFT
p50 <= 0.5x and wall time <= 0.7x mlx-lm server's; on a CPU, warm TTFT p50 <= 0.7x.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from report import percentile, ratio

PREFIXD, SERVER = "prefixd", "mlx-lm server"
TARGETS = {"gpu": [("warm TTFT p50", "warm_p50", 0.5), ("wall time", "wall_s", 0.7)],
           "cpu": [("warm TTFT p50", "warm_p50", 0.7)]}
TIMING_KEYS = ("queue_ms", "encode_ms", "lookup_ms", "prefill_ms", "ttft_ms", "decode_ms")


def device_kind(choice: str) -> str:
    if choice != "auto":
        return choice
    return "gpu" if shutil.which("nvidia-smi") else "cpu"


def round_line(name: str, turn: int, results: list[dict], wall: float) -> str:
    ok = [r for r in results if "error" not in r]
    ttft = ", ".join(f"{r['ttft_ms']:.0f}" for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    prefilled = sum(r["prefilled_tokens"] for r in ok)
    return f"  turn {turn} {name:<14} TTFT ms {ttft:<32} prompt {prompt:>6} prefilled {prefilled:>6} wall {wall:6.2f} s"


def summarize(run: dict) -> dict:
    """{server: figures}: TTFT percentiles (first turn, warm turns, each turn), tokens, wall, timings."""
    out = {}
    for name in dict.fromkeys(r["server"] for r in run["rounds"]):
        rounds = [r for r in run["rounds"] if r["server"] == name]
        done = [x for r in rounds for x in r["results"] if "error" not in x]
        first = [x["ttft_ms"] for x in done if x["turn"] == 1]
        warm = [x for x in done if x["turn"] >= 2]
        turns = sorted({x["turn"] for x in done})
        timings = [x["server_timings"] for x in warm if x.get("server_timings")]
        out[name] = {
            "first_p50": percentile(first, 50), "first_p90": percentile(first, 90),
            "warm_p50": percentile([x["ttft_ms"] for x in warm], 50),
            "warm_p90": percentile([x["ttft_ms"] for x in warm], 90),
            "turn_p50": {t: percentile([x["ttft_ms"] for x in done if x["turn"] == t], 50) for t in turns},
            "turn_prefilled": {t: sum(x["prefilled_tokens"] for x in done if x["turn"] == t) for t in turns},
            "wall_s": sum(r["wall_s"] for r in rounds),
            "prompt_tokens": sum(x["prompt_tokens"] for x in done),
            "cached_tokens": sum(x["cached_tokens"] for x in done),
            "prefilled": sum(x["prefilled_tokens"] for x in done),
            "warm_prefilled": sum(x["prefilled_tokens"] for x in warm),
            "completion_tokens": sum(x["completion_tokens"] for x in done),
            "errors": sum(len(r["results"]) for r in rounds) - len(done),
            "warm_timings_p50": {k: statistics.median(t[k] for t in timings) for k in TIMING_KEYS} if timings else None,
            "warm_front_ms_p50": statistics.median(x["ttft_ms"] - x["server_timings"]["ttft_ms"] for x in warm
                                                   if x.get("server_timings")) if timings else None,
        }
    return out


def serving_order(run: dict) -> dict | None:
    """How prefixd orders a round's warm turns, from its replies: the first-served agent's TTFT (its tail's
    prefill alone), the gaps between consecutive first tokens, and each gap less the decode time of the agent
    served before (when that is about the first-served TTFT, every agent waits for each earlier agent's whole
    prefill and whole answer). ``back_to_back_p50_ms``: the p50 if the tails ran one after another with no
    decode step between them (agent k at k x the first-served TTFT)."""
    firsts, gaps, rests = [], [], []
    for r in run["rounds"]:
        if r["server"] != PREFIXD or r["turn"] < 2 or any("error" in x for x in r["results"]):
            continue
        served = sorted(r["results"], key=lambda x: x["ttft_ms"])
        firsts.append(served[0]["ttft_ms"])
        for before, after in zip(served, served[1:]):
            gaps.append(after["ttft_ms"] - before["ttft_ms"])
            rests.append(gaps[-1] - before["server_timings"]["decode_ms"])
    if not rests:
        return None
    first = statistics.median(firsts)
    agents = run["sizes"]["agents"]
    return {"first_served_ms": first, "gap_ms": statistics.median(gaps), "gap_less_decode_ms": statistics.median(rests),
            "back_to_back_p50_ms": percentile([k * first for k in range(1, agents + 1)], 50)}


def targets(run: dict, summary: dict) -> list[dict]:
    lines = []
    if PREFIXD not in summary or SERVER not in summary:
        return lines
    for goal, key, limit in TARGETS[run["meta"]["device"]]:
        r = ratio(summary[PREFIXD][key], summary[SERVER][key])
        lines.append({"goal": f"{goal} <= {limit}x mlx-lm server's", "prefixd": summary[PREFIXD][key],
                      "server": summary[SERVER][key], "ratio": r, "verdict": "met" if r <= limit else "MISSED"})
    return lines


def agreement(run: dict) -> str:
    """How many requests saw the same prompt token count and gave the same greedy text on both servers."""
    by = {}
    for r in run["rounds"]:
        for x in r["results"]:
            by.setdefault((x["turn"], x["agent"]), {})[r["server"]] = x
    pairs = [(v[PREFIXD], v[SERVER]) for v in by.values() if PREFIXD in v and SERVER in v]
    pairs = [(a, b) for a, b in pairs if "error" not in a and "error" not in b]
    same_prompt = sum(a["prompt_tokens"] == b["prompt_tokens"] for a, b in pairs)
    same_text = sum(a["text"] == b["text"] for a, b in pairs)
    return f"same prompt token count {same_prompt}/{len(pairs)}, same greedy text {same_text}/{len(pairs)}"


def markdown(run: dict, summary: dict, goals: list[dict]) -> str:
    m, s = run["meta"], run["sizes"]
    lines = [f"# Agent workload: prefixd vs mlx-lm server ({'quick' if m['quick'] else 'full'}, {m['device']})", "",
             f"{m['date']}; {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB; mlx {m['mlx']}, mlx-lm {m['mlx_lm']};"
             f" prefixd {m['prefixd_commit']}; model {m['model_dir']}",
             f"Load average before {m['load_before']}, after {m['load_after']}; elapsed {m['elapsed_s']:.0f} s.",
             f"{s['agents']} agents x {s['turns']} turns, all agents' turn k at once; system prompt "
             f"{run['system_prompt_tokens']} tokens (instructions + tool schemas + repository map); tool results "
             f"{min(run['tool_result_tokens'])}-{max(run['tool_result_tokens'])} tokens; max_tokens {s['max_tokens']}, greedy,"
             " streaming /v1/chat/completions on both.", "",
             "| | first-turn TTFT p50 / p90 ms | warm TTFT p50 / p90 ms | wall s | prompt tok | cached tok | prefilled tok"
             " (warm turns) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, x in summary.items():
        lines.append(f"| {name} | {x['first_p50']:.0f} / {x['first_p90']:.0f} | {x['warm_p50']:.0f} / {x['warm_p90']:.0f}"
                     f" | {x['wall_s']:.1f} | {x['prompt_tokens']} | {x['cached_tokens']} | {x['prefilled']}"
                     f" ({x['warm_prefilled']}) |")
    if PREFIXD in summary and SERVER in summary:
        p, q = summary[PREFIXD], summary[SERVER]
        lines.append(f"| ratio | {ratio(p['first_p50'], q['first_p50']):.2f}x | {ratio(p['warm_p50'], q['warm_p50']):.2f}x"
                     f" / {ratio(p['warm_p90'], q['warm_p90']):.2f}x | {ratio(p['wall_s'], q['wall_s']):.2f}x | | |"
                     f" {ratio(p['prefilled'], q['prefilled']):.2f}x |")
    lines += ["", "Targets: " + "; ".join(f"{g['goal']}: {g['ratio']:.2f}x **{g['verdict']}**" for g in goals), "",
              "TTFT p50 ms and tokens prefilled (all agents) per turn:", "",
              "| turn | " + " | ".join(f"{n} TTFT | {n} prefilled" for n in summary) + " |",
              "|---|" + "---:|---:|" * len(summary)]
    for t in next(iter(summary.values()))["turn_p50"]:
        lines.append(f"| {t} | " + " | ".join(f"{x['turn_p50'].get(t, float('nan')):.0f} | {x['turn_prefilled'].get(t, 0)}"
                                              for x in summary.values()) + " |")
    timings = summary.get(PREFIXD, {}).get("warm_timings_p50")
    if timings:
        lines += ["", "prefixd's own timings on warm turns (prefixd_timings, median ms): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
                  + f"; client TTFT - daemon ttft_ms (HTTP front and socket) {summary[PREFIXD]['warm_front_ms_p50']:.0f}."]
    order = serving_order(run)
    if order and SERVER in summary:
        lines += ["", f"prefixd's serving order on warm turns (medians): the first-served agent's TTFT {order['first_served_ms']:.0f}"
                  f" ms; {order['gap_ms']:.0f} ms between consecutive agents' first tokens, {order['gap_less_decode_ms']:.0f}"
                  " ms of it besides the decode of the agent served before. Back to back, with no decode step between"
                  f" the tails, the warm p50 would be {order['back_to_back_p50_ms']:.0f} ms"
                  f" ({ratio(order['back_to_back_p50_ms'], summary[SERVER]['warm_p50']):.2f}x mlx-lm server's)."]
    lines += ["", f"Sanity: {agreement(run)}.", ""]
    return "\n".join(lines)


def write(run: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    goals = targets(run, summary)
    run["summary"], run["targets"], run["serving_order"] = summary, goals, serving_order(run)
    text = markdown(run, summary, goals)
    print("\n" + text)
    (out / "agent.md").write_text(text)
    (out / "agent.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    print(f"written: {out / 'agent.md'}, {out / 'agent.json'}")
