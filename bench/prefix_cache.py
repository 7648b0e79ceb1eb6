#!/usr/bin/env python
"""Prefix-cache benchmark: the real daemon, the real socket, figures printed (not a test).

    .venv/bin/python bench/prefix_cache.py [--quick] [--json out.json]

Per model (SmolLM2-135M-Instruct, then the tiny lfm2 hybrid), each in its own daemon run:
  1. a long chat prompt sent cold, then 3 identical repeats: TTFT, warm/cold ratio, reuse, same text;
  2. a multi-turn chat: per turn prompt / reused / prefilled tokens next to the new message's size;
  3. the daemon's own overhead on a warm hit (client TTFT minus the reply's prefill_ms), and for
     SmolLM2 the in-process floor: one forward of the last token + argmax on a ready mlx-lm cache.
TTFT is measured here, at the client: request sent -> first generate.chunk. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.support.tiny_models

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

BLAS = preload_blas()  # before anything imports mlx (the in-process floor, the tiny-model build)

from harness import BenchError, Daemon, connect, timed_generate  # noqa: E402

from workloads import CHAT_QUESTIONS, REPEAT_QUESTION  # noqa: E402 (the same questions as compare.py)

WARM_REPEATS = 3
REPEAT_MAX_TOKENS = 8
CHAT_MAX_TOKENS = 16


def stdlib_text(name: str) -> list[str]:
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8").splitlines(keepends=True)


def fit_system(conn, lines: list[str], question: str, target: int) -> list[dict]:
    """[system (first n lines of a stdlib file), user question] with the largest n whose prompt <= target tokens."""
    def build(n: int) -> list[dict]:
        return [{"role": "system", "content": "Answer questions about this Python source file.\n\n" + "".join(lines[:n])},
                {"role": "user", "content": question}]

    low, high = 1, len(lines)
    while low < high:
        mid = (low + high + 1) // 2
        if conn.tokenize(messages=build(mid))["num_tokens"] <= target:
            low = mid
        else:
            high = mid - 1
    return build(low)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- workloads ------------------------------------------------------------------------------------


def repeat_workload(conn, messages: list[dict]) -> dict:
    """1 + 3: cold, then identical warm repeats; the daemon's overhead on each warm hit."""
    params = dict(messages=messages, max_tokens=REPEAT_MAX_TOKENS, temperature=0)
    cold = timed_generate(conn, **params)
    warm = [timed_generate(conn, **params) for _ in range(WARM_REPEATS)]
    warm_ttft = median([w["client_ttft_ms"] for w in warm])
    return {
        "cold": cold, "warm": warm,
        "cold_ttft_ms": cold["client_ttft_ms"], "warm_ttft_ms": warm_ttft,
        "warm_over_cold_pct": 100 * warm_ttft / cold["client_ttft_ms"],
        "same_text": all(w["text"] == cold["text"] for w in warm),
        "all_exact": all(w["cache"]["hit"] == "exact" for w in warm),
        # Where a warm TTFT goes (medians over the warm repeats):
        "overhead_ms": median([w["client_ttft_ms"] - w["timings"]["prefill_ms"] for w in warm]),
        "socket_and_front_ms": median([w["client_ttft_ms"] - w["timings"]["ttft_ms"] for w in warm]),
        "before_prefill_ms": median([w["timings"]["ttft_ms"] - w["timings"]["prefill_ms"] for w in warm]),
        "prefill_ms": median([w["timings"]["prefill_ms"] for w in warm]),
    }


def chat_workload(conn, system: dict, turns: int) -> list[dict]:
    """2: each turn appends the previous answer and a new user question."""
    messages, rows = [system], []
    for question in CHAT_QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        reply = timed_generate(conn, messages=messages, max_tokens=CHAT_MAX_TOKENS, temperature=0)
        reply["new_message_tokens"] = conn.tokenize(prompt=question)["num_tokens"]
        rows.append(reply)
        messages.append({"role": "assistant", "content": reply["text"]})
    return rows


def in_process_floor(model_dir: Path, tokens: list[int], chunk: int, repeats: int = 5) -> dict:
    """mlx-lm alone, in this process: a ready cache of tokens[:-1], then the last token + argmax."""
    import copy

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    model.set_dtype(mx.float32)  # what the daemon does on a Linux CPU (--dtype auto)
    cache = make_prompt_cache(model)
    started = time.perf_counter()
    for start in range(0, len(tokens) - 1, chunk):
        model(mx.array(tokens[start:min(start + chunk, len(tokens) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    prefill_s = time.perf_counter() - started

    def one_token(target_cache) -> tuple[float, int]:
        t0 = time.perf_counter()
        token = mx.argmax(model(mx.array([tokens[-1:]]), cache=target_cache)[0, -1]).item()
        return (time.perf_counter() - t0) * 1000, token

    plain, forked, first = [], [], None
    for _ in range(repeats):
        ms, first = one_token(cache)
        plain.append(ms)
        for c in cache:
            c.trim(1)  # back to tokens[:-1] (KVCache only: SmolLM2)
        t0 = time.perf_counter()
        ms, _ = one_token(copy.deepcopy(cache))
        forked.append((time.perf_counter() - t0) * 1000)
    return {"prefill_s": prefill_s, "one_token_ms": median(plain), "deepcopy_one_token_ms": median(forked),
            "first_token": first}


# -- one model ------------------------------------------------------------------------------------


def bench_model(label: str, model_dir: Path, workdir: Path, args) -> dict:
    print(f"\n=== {label}: {model_dir} ===  (load average {load_average()}: "
          f"other work on this {os.cpu_count()}-core box skews absolute times)", flush=True)
    out: dict = {"model_dir": str(model_dir), "load_average_before": os.getloadavg()}
    with Daemon(model_dir, workdir, ["--prefill-chunk", str(args.prefill_chunk)]) as daemon:
        try:
            with connect(daemon.socket_path) as conn:
                rep, chat, prompt_tokens = run_workloads(conn, out, args)
        except Exception as exc:  # the client's errors, socket errors, a timeout: say which model, show the log
            raise BenchError(f"{label}: {type(exc).__name__}: {exc}\n--- daemon log (tail) ---\n{daemon.log_tail()}") from exc
    print_overhead(rep)
    if args.floor:
        print("    in-process floor: loading the model with mlx-lm in the bench process ...", flush=True)
        out["floor"] = floor = in_process_floor(model_dir, prompt_tokens, args.prefill_chunk)
        same = floor["first_token"] == rep["cold"]["first_token"]
        print(f"    in-process floor (one token at this context): {floor['one_token_ms']:8.1f} ms"
              f"   (+ copy.deepcopy fork: {floor['deepcopy_one_token_ms']:.1f} ms; same first token as the daemon: {yes(same)})")
        print(f"    daemon warm TTFT / floor: {rep['warm_ttft_ms'] / floor['one_token_ms']:.1f}x;"
              f" in-process cold prefill of {len(prompt_tokens) - 1} tokens: {floor['prefill_s']:.1f} s")
    out["reuse_ok"] = reuse_verdict(rep, chat)
    out["load_average_after"] = os.getloadavg()
    return out


def run_workloads(conn, out: dict, args) -> tuple[dict, list[dict], list[int]]:
    info = out["model"] = conn.models()["models"][0]
    print(f"dtype {info['dtype']}, hybrid {info['hybrid']}, cache layers {info['cache_layers']}, blas {BLAS or 'bundled'}")
    repeat_msgs = fit_system(conn, stdlib_text("inspect.py"), REPEAT_QUESTION, args.prompt_tokens)
    chat_system = fit_system(conn, stdlib_text("argparse.py"), CHAT_QUESTIONS[0], args.prompt_tokens)[0]
    prompt_tokens = conn.tokenize(messages=repeat_msgs)["tokens"]
    # Untimed, uncached: the process's first forward pass and decode batch pay one-time setup costs
    # that would otherwise inflate the cold TTFT (and flatter the warm/cold ratio).
    warmup = timed_generate(conn, messages=[{"role": "user", "content": "Hello"}], max_tokens=2, cache={"use": False, "store": False})
    out["warmup_ms"] = warmup["client_total_ms"]
    print(f"warm-up request (cache off): {warmup['client_total_ms']:.0f} ms")
    print(f"[1] repeated prompt: {len(prompt_tokens)} tokens, cold + {WARM_REPEATS} warm, max_tokens {REPEAT_MAX_TOKENS}", flush=True)
    out["repeat"] = rep = repeat_workload(conn, repeat_msgs)
    print_repeat(rep)
    print(f"[2] {args.turns}-turn chat on a ~{args.prompt_tokens}-token system message, max_tokens {CHAT_MAX_TOKENS}", flush=True)
    out["chat"] = chat = chat_workload(conn, chat_system, args.turns)
    print_chat(chat)
    out["stats"] = conn.stats()
    return rep, chat, prompt_tokens


def reuse_verdict(rep: dict, chat: list[dict]) -> dict:
    later = chat[1:]
    verdict = {
        "warm_exact": rep["all_exact"],
        "same_greedy_text": rep["same_text"],
        "later_turns_reuse": all(t["cache"]["reused_tokens"] > 0 for t in later),
        "later_turns_prefill_excess": [t["cache"]["prefilled_tokens"] - t["new_message_tokens"] for t in later],
    }
    print(f"    reuse: warm repeats exact {yes(verdict['warm_exact'])}, same greedy text {yes(verdict['same_greedy_text'])},"
          f" turns 2+ reuse > 0 {yes(verdict['later_turns_reuse'])};"
          f" turns 2+ prefilled minus new message: {verdict['later_turns_prefill_excess']}")
    return verdict


# -- printing -------------------------------------------------------------------------------------


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def row_cells(r: dict) -> str:
    c, t = r["cache"], r["timings"]
    return (f"{r['client_ttft_ms']:10.1f} {c['prompt_tokens']:7d} {c['reused_tokens']:7d} {c['prefilled_tokens']:9d}"
            f" {c['hit']:>8} {c['checkpoint'] or '-':>11} {t['prefill_ms']:10.1f} {t['ttft_ms'] - t['prefill_ms']:8.1f}"
            + ("" if r["first_chunk"] else "  (no chunk: TTFT = full reply)"))


HEADER = f"{'TTFT ms':>10} {'prompt':>7} {'reused':>7} {'prefilled':>9} {'hit':>8} {'checkpoint':>11} {'prefill_ms':>10} {'pre_ms':>8}"


def print_repeat(rep: dict) -> None:
    print(f"    {'run':<7}{HEADER}  text")
    for name, r in [("cold", rep["cold"])] + [(f"warm {i + 1}", w) for i, w in enumerate(rep["warm"])]:
        print(f"    {name:<7}{row_cells(r)}  {r['text'][:40]!r}")
    ok = rep["warm_over_cold_pct"] <= 5
    print(f"    cold TTFT {rep['cold_ttft_ms']:.1f} ms, warm TTFT (median) {rep['warm_ttft_ms']:.1f} ms:"
          f" warm/cold = {rep['warm_over_cold_pct']:.2f}% (target <= 5%: {'met' if ok else 'MISSED'});"
          f" warm text == cold text: {yes(rep['same_text'])}")


def print_chat(rows: list[dict]) -> None:
    print(f"    {'turn':<5}{HEADER} {'new msg':>8}  miss_reason@diverged_at")
    for i, r in enumerate(rows, 1):
        print(f"    {i:<5}{row_cells(r)} {r['new_message_tokens']:8d}  {r['cache']['miss_reason'] or '-'}@{r['cache']['diverged_at']}")
    print("    (new msg = the new user message's own tokens, without template; prefilled should be about that + glue)")


def print_overhead(rep: dict) -> None:
    print(f"[3] daemon overhead on a warm hit (medians of {WARM_REPEATS}):"
          f" client TTFT - reply prefill_ms = {rep['overhead_ms']:.1f} ms")
    print(f"    of which socket + front (client TTFT - reply ttft_ms) {rep['socket_and_front_ms']:.1f} ms,"
          f" in the daemon before prefill (queue, template, tokenize, lookup) {rep['before_prefill_ms']:.1f} ms;"
          f" prefill_ms (tail + first decode step) {rep['prefill_ms']:.1f} ms")


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="~1,500-token prompts and 5 chat turns (a few minutes)")
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct directory (default: ensure_smollm2())")
    parser.add_argument("--tiny-root", type=Path, default=Path.home() / ".cache" / "prefixd" / "bench-models",
                        help="where the tiny lfm2 model is built / cached")
    parser.add_argument("--models", default="smollm2,lfm2", help="comma-separated subset of smollm2,lfm2")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="passed to the daemon (and used by the floor)")
    args = parser.parse_args(argv)
    args.prompt_tokens, args.turns = (1500, 5) if args.quick else (3000, 10)
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    results: dict = {"quick": args.quick, "blas": BLAS, "prompt_tokens_target": args.prompt_tokens, "turns": args.turns, "models": {}}
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="prefixd-bench-") as tmp:
            for name in wanted:
                if name == "smollm2":
                    from prefixd.daemon.models.model_setup import ensure_smollm2

                    model_dir = args.smollm2 or ensure_smollm2()
                    args.floor = True
                elif name == "lfm2":
                    from tests.support.tiny_models import ensure_tiny_model

                    model_dir, args.floor = ensure_tiny_model("lfm2", args.tiny_root), False
                else:
                    raise BenchError(f"unknown model {name!r} in --models (use smollm2 and/or lfm2)")
                results["models"][name] = bench_model(name, Path(model_dir), Path(tmp), args)
    except BenchError as exc:
        print(f"\nbench failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted (the daemon was stopped)", file=sys.stderr)
        return 130
    finally:
        if args.json and results["models"]:
            args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
            print(f"\nraw numbers written to {args.json}")
    print(f"\ndone in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
