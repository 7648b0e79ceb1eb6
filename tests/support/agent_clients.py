"""The real coding-agent clients, driven non-interactively against a prefixd HTTP front.

Codex CLI (``codex exec`` through a custom provider on the Responses API),
Claude Code (``claude -p`` with ``ANTHROPIC_BASE_URL``) and opencode
(``opencode run`` through an openai-compatible provider) each get a home of
their own (a temporary ``HOME`` holding their configuration), so neither the
developer's settings nor their sessions leak in, and nothing is sent anywhere
but the daemon. A turn runs the client as a user would, with no stdin, and
keeps what it printed; its ``--json``-style output gives the answer and the
client's own figure of cached prompt tokens (each API's native field, as the
client reads it).

Used by tests/e2e/test_agent_clients.py and bench/probes/agent_clients.py. The
clients come from the project's ``.agents`` folder (``./run test`` installs
pinned versions there with npm), else from ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
AGENTS_BIN = REPO / ".agents" / "node_modules" / ".bin"
FIRST_PROMPT = "say hi"
SECOND_PROMPT = "and once more"
TURN_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon's HTTP front listens, its bearer token, and the model to ask for."""

    base_url: str  # http://127.0.0.1:PORT, no path
    token: str
    model: str
    context: int  # the model's context, for the clients that want to know it
    max_output_tokens: int | None = None  # a cap on answers for the clients that send one (None: theirs)


@dataclass
class Turn:
    """One run of a client: its exit code, what it printed, and what its output says of the answer."""

    returncode: int | None  # None: still running at the timeout, and stopped (only when asked for)
    stdout: str
    stderr: str
    answer: str | None  # the answer as the client reports it
    cached_tokens: int | None  # the client's own figure of prompt tokens read from the cache, this turn
    error: str | None = None  # the error the client reports, where its output has one

    @property
    def printed(self) -> str:
        return self.stdout + self.stderr


def find_client(binary: str) -> Path | None:
    """The client's executable: the project's pinned install first, then PATH."""
    local = AGENTS_BIN / binary
    if local.exists():
        return local
    found = shutil.which(binary)
    return Path(found) if found else None


class AgentClient:
    """A command-line agent: how to configure it for an endpoint, run a turn, and read its output."""

    name = ""
    binary = ""
    # opencode 1.18 answers a prompt too long by compacting the conversation and sending it again, without
    # end when what does not fit is its own instructions and tools (off: "compaction": {"auto": false}).
    compacts_without_end = False

    def __init__(self, home: Path, workdir: Path):
        self.home, self.workdir = home, workdir
        self.home.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cumulative_cached = 0  # for clients whose figure adds up over a conversation

    def configure(self, endpoint: Endpoint) -> None:
        raise NotImplementedError

    def arguments(self, prompt: str, endpoint: Endpoint, follow_up: bool, as_json: bool) -> list[str]:
        raise NotImplementedError

    def client_env(self, endpoint: Endpoint) -> dict[str, str]:
        return {}

    def parse(self, stdout: str) -> tuple[str | None, int | None, str | None]:
        """(answer, cached tokens, error) from the client's JSON output."""
        raise NotImplementedError

    def run(self, prompt: str, endpoint: Endpoint, follow_up: bool = False, as_json: bool = True,
            timeout: float = TURN_TIMEOUT_S, stop_at_timeout: bool = False) -> Turn:
        """One turn; past ``timeout`` the client is killed, and with ``stop_at_timeout`` what it printed kept."""
        executable = find_client(self.binary)
        assert executable is not None, f"{self.binary} is not installed"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home), "LANG": "C.UTF-8",
               "TERM": "dumb", "NO_COLOR": "1", "XDG_CONFIG_HOME": str(self.home / ".config"),
               "XDG_DATA_HOME": str(self.home / ".local/share"), "XDG_CACHE_HOME": str(self.home / ".cache"),
               "XDG_STATE_HOME": str(self.home / ".local/state"), **self.client_env(endpoint)}
        try:
            done = subprocess.run([str(executable), *self.arguments(prompt, endpoint, follow_up, as_json)],
                                  cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as stopped:
            if not stop_at_timeout:
                raise
            return Turn(None, _text(stopped.stdout), _text(stopped.stderr), None, None)
        answer, cached, error = self.parse(done.stdout) if as_json else (None, None, None)
        return Turn(done.returncode, done.stdout, done.stderr, answer, cached, error)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _json_lines(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


class Codex(AgentClient):
    """Codex CLI: ``codex exec``, a custom provider with ``wire_api = "responses"``; ``resume --last`` continues."""

    name, binary = "codex", "codex"

    def configure(self, endpoint: Endpoint) -> None:
        codex_home = self.home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(endpoint))

    def client_env(self, endpoint: Endpoint) -> dict[str, str]:
        return {"CODEX_HOME": str(self.home / ".codex"), "PREFIXD_HTTP_TOKEN": endpoint.token}

    def arguments(self, prompt: str, endpoint: Endpoint, follow_up: bool, as_json: bool) -> list[str]:
        head = ["exec", *(["--json"] if as_json else []), "--skip-git-repo-check"]
        return head + (["resume", "--last", prompt] if follow_up else [prompt])

    def parse(self, stdout: str) -> tuple[str | None, int | None, str | None]:
        events = _json_lines(stdout)
        messages = [e["item"]["text"] for e in events
                    if e.get("type") == "item.completed" and e.get("item", {}).get("type") == "agent_message"]
        answer = messages[-1] if messages else None
        failed = [e["error"].get("message") for e in events if e.get("type") == "turn.failed" and isinstance(e.get("error"), dict)]
        usage = [e["usage"] for e in events if e.get("type") == "turn.completed"]
        if not usage:
            return answer, None, failed[-1] if failed else None
        # Codex's usage adds up over the whole thread, resumed runs included: this turn's is the difference.
        total = usage[-1].get("cached_input_tokens", 0)
        cached, self.cumulative_cached = total - self.cumulative_cached, total
        return answer, cached, None


def codex_config(endpoint: Endpoint) -> str:
    """~/.codex/config.toml for prefixd (the copy in docs/agents.md)."""
    return (f'model = "{endpoint.model}"\n'
            'model_provider = "prefixd"\n'
            f"model_context_window = {endpoint.context}\n"
            "\n[model_providers.prefixd]\n"
            'name = "prefixd"\n'
            f'base_url = "{endpoint.base_url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "PREFIXD_HTTP_TOKEN"  # Codex sends this variable as its bearer token\n')


class ClaudeCode(AgentClient):
    """Claude Code: ``claude -p`` on the Anthropic front; ``--continue`` continues the folder's last session."""

    name, binary = "claude-code", "claude"

    def configure(self, endpoint: Endpoint) -> None:
        pass  # all of it is in the environment

    def client_env(self, endpoint: Endpoint) -> dict[str, str]:
        return {"ANTHROPIC_BASE_URL": endpoint.base_url, "ANTHROPIC_AUTH_TOKEN": endpoint.token,
                "ANTHROPIC_MODEL": endpoint.model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": endpoint.model,
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                **({"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(endpoint.max_output_tokens)} if endpoint.max_output_tokens else {})}

    def arguments(self, prompt: str, endpoint: Endpoint, follow_up: bool, as_json: bool) -> list[str]:
        return ["-p", prompt, *(["--continue"] if follow_up else []),
                *(["--output-format", "json"] if as_json else [])]

    def parse(self, stdout: str) -> tuple[str | None, int | None, str | None]:
        results = [e for e in _json_lines(stdout) if e.get("type") == "result"]
        if not results:
            return None, None, None
        if results[-1].get("is_error"):
            return None, None, results[-1].get("result")
        return results[-1].get("result"), results[-1].get("usage", {}).get("cache_read_input_tokens"), None


class OpenCode(AgentClient):
    """opencode: ``opencode run`` through an openai-compatible provider (project opencode.json); ``--continue``."""

    name, binary = "opencode", "opencode"
    compacts_without_end = True
    tools = True  # False: "tools": {"*": false}, for a model that cannot take them

    def configure(self, endpoint: Endpoint) -> None:
        config = opencode_config(endpoint, self.tools)
        (self.workdir / "opencode.json").write_text(json.dumps(config, indent=2) + "\n")

    def client_env(self, endpoint: Endpoint) -> dict[str, str]:
        return {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"}

    def arguments(self, prompt: str, endpoint: Endpoint, follow_up: bool, as_json: bool) -> list[str]:
        return ["run", *(["--continue"] if follow_up else []), *(["--format", "json"] if as_json else []), prompt]

    def parse(self, stdout: str) -> tuple[str | None, int | None, str | None]:
        events = _json_lines(stdout)
        texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
        steps = [e["part"]["tokens"] for e in events if e.get("type") == "step_finish"]
        cached = sum(step.get("cache", {}).get("read", 0) for step in steps) if steps else None
        errors = [e["error"] for e in events if e.get("type") == "error" and isinstance(e.get("error"), dict)]
        error = f"{errors[-1].get('name')}: {errors[-1].get('data', {}).get('message')}" if errors else None
        return ("".join(texts) if texts else None), cached, error


def opencode_config(endpoint: Endpoint, tools: bool = True) -> dict[str, Any]:
    """opencode.json for prefixd (the copy in docs/agents.md); ``tools=False`` turns every tool off."""
    config: dict[str, Any] = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"prefixd": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "prefixd",
            "options": {"baseURL": f"{endpoint.base_url}/v1", "apiKey": endpoint.token},
            "models": {endpoint.model: {"name": endpoint.model, "limit": {"context": endpoint.context,
                                                               "output": endpoint.max_output_tokens or 4096}}},
        }},
        "model": f"prefixd/{endpoint.model}",
        "small_model": f"prefixd/{endpoint.model}",
        "autoupdate": False,
    }
    if not tools:
        config["tools"] = {"*": False}
    return config


CLIENTS: dict[str, type[AgentClient]] = {client.name: client for client in (Codex, ClaudeCode, OpenCode)}


# -- the OpenAI Agents SDK, in this process -------------------------------------------------------


def agents_sdk_turns(endpoint: Endpoint, prompts: tuple[str, ...] = (FIRST_PROMPT, SECOND_PROMPT)) -> list[Any]:
    """Run an Agents SDK agent (default Responses model, one function tool) for ``prompts``, each turn
    continuing the last through ``previous_response_id``; the RunResults."""
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_default_openai_client(AsyncOpenAI(base_url=f"{endpoint.base_url}/v1", api_key=endpoint.token))
    set_tracing_disabled(True)  # traces would go to OpenAI's servers

    @function_tool
    def read_file(path: str) -> str:
        """Read a text file of the project."""
        return Path(path).read_text()

    agent = Agent(name="helper", instructions="You help with a small Python project. Be brief.",
                  tools=[read_file], model=endpoint.model)
    results: list[Any] = []
    for prompt in prompts:
        previous = results[-1].last_response_id if results else None
        results.append(Runner.run_sync(agent, prompt, previous_response_id=previous))
    return results
