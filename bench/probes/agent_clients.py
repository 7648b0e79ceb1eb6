"""Run the real coding agents against prefixd by hand: two turns each, and what the cache did on each turn.

    .venv/bin/python bench/probes/agent_clients.py                       # the tiny 64k agent model (built offline)
    .venv/bin/python bench/probes/agent_clients.py --model ~/.local/share/prefixd/models/SmolLM2-135M-Instruct
    .venv/bin/python bench/probes/agent_clients.py --clients codex,agents-sdk --opencode-tools-off

Starts a daemon of its own (HTTP on a free loopback port, its bearer token
given to every client), then for each installed client (Codex CLI, Claude
Code, opencode from .agents/ or PATH; the OpenAI Agents SDK in this process)
asks "say hi", then continues the same conversation with a second prompt,
as the end-to-end tests do (tests/e2e/test_agent_clients.py). Prints per
turn the client's exit code and answer, the daemon's cache map for the
turn's agent request (prompt tokens, reused, prefilled) and the client's own
cached-token figure. The second turn should reuse at least the first turn's
prompt and answer. A prompt longer than the model's context (SmolLM2's 8k
holds none of the three CLIs' prompts with their tools) shows as the error
each client prints.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.agent_clients import (CLIENTS, FIRST_PROMPT, SECOND_PROMPT, AgentClient, Endpoint,  # noqa: E402
                                         agents_sdk_turns, find_client)
from tests.support.agent_model import LONG_CONTEXT, ensure_agent_model  # noqa: E402
from tests.support.http_daemon import HttpDaemon, http_daemon  # noqa: E402
from tests.support.tiny_models import ensure_tiny_model  # noqa: E402

SDK = "agents-sdk"
ALL_CLIENTS = (*CLIENTS, SDK)
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")


def model_context(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    for source in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(source.get(key), int):
                return source[key]
    raise SystemExit(f"{model_dir}/config.json names no context length: pass --context")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the model directory to serve (default: the tiny 64k agent model)")
    parser.add_argument("--context", type=int, help="the model's context length (default: from its config.json)")
    parser.add_argument("--clients", default=",".join(ALL_CLIENTS), help=f"comma-separated, of {', '.join(ALL_CLIENTS)}")
    parser.add_argument("--max-output-tokens", type=int, default=128, help="cap on each answer: the daemon's "
                        "--max-output-tokens (Codex, the SDK), opencode's limit.output, Claude Code's "
                        "CLAUDE_CODE_MAX_OUTPUT_TOKENS (default 128: a real model's answers stay short on a CPU)")
    parser.add_argument("--opencode-tools-off", action="store_true", help='opencode with "tools": {"*": false}')
    args = parser.parse_args()
    names = [name.strip() for name in args.clients.split(",") if name.strip()]
    unknown = sorted(set(names) - set(ALL_CLIENTS))
    if unknown:
        parser.error(f"unknown clients: {', '.join(unknown)} (known: {', '.join(ALL_CLIENTS)})")

    with tempfile.TemporaryDirectory(prefix="prefixd-agents-") as scratch:
        root = Path(scratch)
        model = args.model.expanduser() if args.model else ensure_agent_model(
            ensure_tiny_model("llama", root / "models"), root / "models", LONG_CONTEXT)
        with http_daemon(model, root / "daemon", model_dirs=[model],
                         extra_args=["--max-output-tokens", str(args.max_output_tokens)]) as daemon:
            endpoint = Endpoint(daemon.base_url, daemon.token, model.name, args.context or model_context(model),
                                args.max_output_tokens)
            print(f"daemon at {daemon.base_url}, model {endpoint.model} (context {endpoint.context}); log: {daemon.log_path}")
            print(f"{'client':<12} {'turn':>4} {'exit':>4} {'prompt':>7} {'reused':>7} {'prefilled':>9} "
                  f"{'client cached':>13}  answer or error")
            for name in names:
                for row in run_client(name, endpoint, daemon, root / name, args.opencode_tools_off):
                    print(row)


def run_client(name: str, endpoint: Endpoint, daemon: HttpDaemon, workdir: Path, opencode_tools_off: bool) -> list[str]:
    if name == SDK:
        return run_agents_sdk(endpoint, daemon)
    client: AgentClient = CLIENTS[name](workdir / "home", workdir / "project")
    if find_client(client.binary) is None:
        return [f"{name:<12} not installed (./run test installs it into .agents/; or npm install -g it)"]
    if opencode_tools_off and name == "opencode":
        client.tools = False
    client.configure(endpoint)
    rows = []
    for number, (prompt, follow_up) in enumerate(((FIRST_PROMPT, False), (SECOND_PROMPT, True)), start=1):
        before = len(daemon.events("generate"))
        # opencode answers a prompt too long by compacting and resending without end: stopped after 5 minutes.
        turn = client.run(prompt, endpoint, follow_up=follow_up, timeout=300.0, stop_at_timeout=True)
        shown = turn.answer if turn.returncode == 0 else turn.error or last_lines(turn.printed)
        rows.append(row(name, number, turn.returncode, request_of(daemon.events("generate")[before:]), turn.cached_tokens, shown))
        if turn.returncode != 0:
            break
    return rows


def run_agents_sdk(endpoint: Endpoint, daemon: HttpDaemon) -> list[str]:
    if importlib.util.find_spec("agents") is None:
        return [f"{SDK:<12} not installed (pip install openai-agents; it is in the test extra)"]
    before_sdk = len(daemon.events("generate", path="/v1/responses"))
    try:
        results = agents_sdk_turns(endpoint)
    except Exception as exc:  # what the SDK raises is what its user sees
        return [row(SDK, 1, 1, None, None, f"{type(exc).__name__}: {exc}")]
    lines = daemon.events("generate", path="/v1/responses")[before_sdk:]
    return [row(SDK, number, 0, lines[number - 1] if len(lines) >= number else None,
                result.raw_responses[-1].usage.input_tokens_details.cached_tokens, result.final_output)
            for number, result in enumerate(results, start=1)]


def request_of(lines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A turn's agent request: its longest prompt (a client may also ask for a title, say)."""
    return max(lines, key=lambda line: line["prompt_tokens"]) if lines else None


def row(name: str, number: int, code: int | None, request: dict[str, Any] | None, cached: int | None, shown: Any) -> str:
    figures = (request["prompt_tokens"], request["reused_tokens"], request["prefilled_tokens"]) if request else ("-",) * 3
    exit_code = "stop" if code is None else code
    text = " ".join(str(shown).split())[:90]
    return (f"{name:<12} {number:>4} {exit_code:>4} {figures[0]:>7} {figures[1]:>7} {figures[2]:>9} "
            f"{'-' if cached is None else cached:>13}  {text}")


def last_lines(printed: str, count: int = 3) -> str:
    return " | ".join(line for line in printed.strip().splitlines()[-count:] if line.strip())


if __name__ == "__main__":
    main()
