#!/usr/bin/env python
"""Coding agents on one long system prompt: prefixd next to mlx-lm's server, the same requests, one run.

    .venv/bin/python bench/agent_workload.py [--quick] [--model DIR] [--out DIR]

Several agents at once (4; --quick 2) share one system prompt of instructions and ~18 tool
specifications (JSON schemas as plain text: SmolLM2's template renders no ``tools``; ~8,000
tokens, fewer where the model's context would not hold the last turn; --quick 1,500). Each agent
does N turns (8; --quick 4): turn 1 is the system prompt and the agent's task; every later turn
appends the model's own previous answer (an assistant message) and a tool result of a few hundred
tokens (a user message, <tool_response>...</tool_response>, deterministic per agent and turn).
Both servers get streaming /v1/chat/completions, greedy, max_tokens 24. Round k sends every agent's
turn k at once to one server, then to the other (the order alternates per round, so a burst of
load from elsewhere lands on both); each server's conversations carry its own answers.
Writes agent.md (printed too) and agent.json to --out (default bench/results/<date>-agent[-quick]).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import agent_prompts as prompts  # noqa: E402
import agent_report  # noqa: E402
from compare import DEFAULT_MODEL, load_average, machine_meta  # noqa: E402
from harness import BenchError, Daemon  # noqa: E402
from harness import free_port  # noqa: E402
from peers import MlxServerPeer, _sse_data, wait_for_models  # noqa: E402
from workloads import Tokens, fit_lines  # noqa: E402


@dataclass
class Sizes:
    agents: int = 4
    turns: int = 8
    system_tokens: int = 8000  # the whole templated system message; capped by the model's context
    tool_tokens: int = 300  # each tool result message
    max_tokens: int = 24

    @classmethod
    def quick(cls) -> Sizes:
        return cls(agents=2, turns=4, system_tokens=1500, tool_tokens=200)


# -- the prompts ----------------------------------------------------------------------------------


def context_length(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or 4096)


def build_prompts(tokens: Tokens, sizes: Sizes, context: int) -> tuple[dict, list[str], dict]:
    """(system message, each agent's task, {(agent, turn): tool result message}), all fitted to size.

    The system prompt shrinks where the last turn (system + every answer and tool result) would not
    fit the model's context: ~60 tokens of template and answer slack per turn besides the tool result.
    """
    last_turn = sizes.turns * (sizes.tool_tokens + sizes.max_tokens + 60) + sizes.max_tokens
    target = min(sizes.system_tokens, context - last_turn)
    sections = prompts.system_sections()

    def system(parts):
        return [{"role": "system", "content": "".join(parts)}]

    system_message = system(sections[:fit_lines(tokens, sections, system, target)])[0]
    tasks = [prompts.TASKS[a % len(prompts.TASKS)] for a in range(sizes.agents)]
    results = {}
    for agent in range(sizes.agents):
        for turn in range(1, sizes.turns):
            kind, arguments, lines = prompts.tool_result_lines(agent, turn)

            def message(part, kind=kind, arguments=arguments):
                return [{"role": "user", "content": prompts.tool_message(kind, arguments, "\n".join(part))}]

            results[agent, turn] = message(lines[:fit_lines(tokens, lines, message, sizes.tool_tokens)])[0]
    return system_message, tasks, results


class Conversations:
    """One server's agents: each agent's messages so far, its own answers included."""

    def __init__(self, system: dict, tasks: list[str], tool_results: dict):
        self.messages = [[system, {"role": "user", "content": task}] for task in tasks]
        self.tool_results = tool_results

    def turn(self, agent: int) -> list[dict]:
        return list(self.messages[agent])

    def record(self, agent: int, turn: int, answer: str) -> None:
        """The answer as an assistant message, then the tool result the next turn starts from."""
        self.messages[agent] += [{"role": "assistant", "content": answer}, self.tool_results[agent, turn]]


# -- the servers ----------------------------------------------------------------------------------


class PrefixdHttp:
    """The real daemon with its OpenAI-compatible HTTP front on a loopback port (no token)."""

    name = "prefixd"

    def __init__(self, model_dir: Path, workdir: Path):
        self.port = free_port()
        self.daemon = Daemon(model_dir, workdir, ["--http", f"127.0.0.1:{self.port}", "--http-no-token"])
        self.settings = "defaults, --http 127.0.0.1:PORT --http-no-token"

    def start(self) -> None:
        self.daemon.start()
        wait_for_models(self.port, self.daemon.proc, self.log_tail)

    @property
    def pid(self) -> int:
        return self.daemon.proc.pid

    def log_tail(self) -> str:
        return self.daemon.log_tail()

    def stop(self) -> None:
        self.daemon.stop()


def chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion; TTFT at the client: request sent -> first chunk with content."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise BenchError(f"port {port} answered {response.status}: {response.read()[:300]!r}")
    first_at, text, usage, extras = None, "", None, {}
    for event in _sse_data(response):
        for choice in event.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content and first_at is None:
                first_at = time.perf_counter()
            text += content or ""
        usage = event.get("usage") or usage
        extras.update({k: event[k] for k in ("prefixd_cache", "prefixd_timings") if k in event})
    done = time.perf_counter()
    conn.close()
    if usage is None:
        raise BenchError(f"port {port} sent no usage chunk")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    cache = extras.get("prefixd_cache") or {}
    return {"ttft_ms": ((first_at or done) - started) * 1000, "total_ms": (done - started) * 1000,
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
            "prefilled_tokens": cache.get("prefilled_tokens", usage["prompt_tokens"] - cached),
            "completion_tokens": usage["completion_tokens"], "text": text, "cache": cache,
            "server_timings": extras.get("prefixd_timings")}


def run_round(server, conversations: Conversations, turn: int, max_tokens: int) -> tuple[list[dict], float]:
    """Every agent's turn at once (a thread and a connection each). Returns (results, wall s)."""
    agents = len(conversations.messages)
    results: list[dict] = [{} for _ in range(agents)]
    barrier = threading.Barrier(agents + 1)

    def one(agent: int) -> None:
        messages = conversations.turn(agent)
        barrier.wait()
        try:
            results[agent] = chat(server.port, messages, max_tokens)
        except Exception as exc:  # noqa: BLE001 - recorded; the report counts it
            results[agent] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=one, args=(a,)) for a in range(agents)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    for agent, result in enumerate(results):
        result.update(agent=agent, turn=turn)
        if (agent, turn) in conversations.tool_results:  # not after the last turn
            conversations.record(agent, turn, result.get("text", ""))
    return results, wall


def keep_logs(servers, out: Path) -> None:
    """The servers' logs beside the results: prefixd's JSON log has each request's timings and batch steps."""
    out.mkdir(parents=True, exist_ok=True)
    for server in servers:
        log = server.daemon.log_path if isinstance(server, PrefixdHttp) else server.log_path
        if log.is_file():
            shutil.copyfile(log, out / f"{server.name.replace(' ', '_')}.log")


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 agents, 4 turns, a 1,500-token system prompt")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/<date>-agent[-quick]")
    parser.add_argument("--logs", type=Path, default=None, help="copy both servers' logs here (not kept in the tree)")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                        help="which targets apply (auto: gpu where nvidia-smi exists)")
    for field, default in asdict(Sizes()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, help=f"default {default}")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    for field in asdict(sizes):
        if getattr(args, field) is not None:
            setattr(sizes, field, getattr(args, field))
    out = args.out or BENCH / "results" / f"{datetime.date.today()}-agent{'-quick' if args.quick else ''}"
    started = time.monotonic()
    run = {"meta": machine_meta(args, args.model), "sizes": asdict(sizes), "rounds": []}
    run["meta"]["device"] = agent_report.device_kind(args.device)
    tokens = Tokens(args.model)
    system, tasks, tool_results = build_prompts(tokens, sizes, context_length(args.model))
    run["system_prompt_tokens"] = len(tokens.chat([system]))
    run["tool_result_tokens"] = sorted(len(tokens.chat([m])) for m in tool_results.values())
    print(f"agent workload: {args.model} ({'quick' if args.quick else 'full'}), {sizes.agents} agents x {sizes.turns}"
          f" turns, system prompt {run['system_prompt_tokens']} tokens; load average {load_average()}", flush=True)
    servers = []
    try:
        with tempfile.TemporaryDirectory(prefix="prefixd-agent-") as tmp:
            try:
                for cls in (PrefixdHttp, MlxServerPeer):
                    servers.append(cls(args.model, Path(tmp)))
                    servers[-1].start()
                    chat(servers[-1].port, [{"role": "user", "content": "Hello"}], 2)  # first-call setup, untimed
                run["settings"] = {s.name: s.settings for s in servers}
                conversations = {s.name: Conversations(system, tasks, tool_results) for s in servers}
                for turn in range(1, sizes.turns + 1):
                    order = servers if turn % 2 else servers[::-1]
                    for server in order:
                        load = load_average()
                        results, wall = run_round(server, conversations[server.name], turn, sizes.max_tokens)
                        run["rounds"].append({"server": server.name, "turn": turn, "wall_s": wall, "load": load,
                                              "results": results})
                        print(agent_report.round_line(server.name, turn, results, wall), flush=True)
                        failed = [r["error"] for r in results if "error" in r]
                        if failed:
                            raise BenchError(f"{server.name} failed at turn {turn}: {failed[0]}\n{server.log_tail()}")
            finally:
                for server in servers:
                    server.stop()
                if args.logs:
                    keep_logs(servers, args.logs)
    except BenchError as exc:
        print(f"\nagent workload failed: {exc}", file=sys.stderr)
        return 1
    run["meta"].update(load_after=load_average(), elapsed_s=time.monotonic() - started)
    agent_report.write(run, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
