"""The real coding agents against a real daemon: Codex CLI, Claude Code, opencode and the OpenAI Agents SDK.

Each completes a two-turn task as a user would run it (no stdin, its own
home, nothing but the daemon to talk to), on a tiny model whose 64k context
holds their prompts (12-33k tokens of instructions and tool specifications)
and whose answer ends by itself (tests/support/agent_model.py). What a user
would notice is asserted: the exit code, the answer printed, the second
turn's prompt reusing the whole first turn (prompt and answer) in the
daemon's cache map, and the client's own cached-token figure saying so. A
prompt longer than the context (the same model with a 2k context) must come
back as an error the client shows as such, at once.

Each test skips, naming what is missing, where its client is not installed
(``./run test`` installs the pinned npm clients into .agents/; the Agents
SDK is in the test extra).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.agent_clients import (CLIENTS, FIRST_PROMPT, SECOND_PROMPT, AgentClient, Endpoint, agents_sdk_turns,
                                         find_client)
from tests.support.agent_model import ANSWER, LONG_CONTEXT, SHORT_CONTEXT, agent_model_name, ensure_agent_model
from tests.support.http_daemon import HttpDaemon, http_daemon

TOO_LONG = re.compile(r"context|too long", re.IGNORECASE)
TOO_LONG_TIMEOUT_S = 60.0  # the error must come at once, not after retries
COMPACTING_CLIENT_S = 15.0  # opencode's first try and its error fit in this (~5 s here)


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tiny_models_root, tmp_path_factory) -> Iterator[HttpDaemon]:
    models = [ensure_agent_model(tiny_llama_dir, tiny_models_root, context) for context in (LONG_CONTEXT, SHORT_CONTEXT)]
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("agents-daemon"), model_dirs=models) as running:
        yield running


def endpoint(daemon: HttpDaemon, context: int = LONG_CONTEXT) -> Endpoint:
    return Endpoint(daemon.base_url, daemon.token, agent_model_name(context), context)


def generate_lines(daemon: HttpDaemon, model: str) -> list[dict[str, Any]]:
    return daemon.events("generate", model=model)


def main_request(new_lines: list[dict[str, Any]]) -> dict[str, Any]:
    """A turn's agent request: the longest prompt of the turn (a client may also ask for a title, say)."""
    assert new_lines, "the client's turn reached the daemon with no generate request"
    return max(new_lines, key=lambda line: line["prompt_tokens"])


def client_or_skip(name: str, tmp_path: Path) -> AgentClient:
    client = CLIENTS[name](tmp_path / "home", tmp_path / "project")
    if find_client(client.binary) is None:
        pytest.skip(f"{client.binary} is not installed (./run test installs it into .agents/ with npm; npm is missing?)")
    return client


def assert_whole_first_turn_reused(first: dict[str, Any], second: dict[str, Any], client_cached: int | None) -> None:
    whole_first_turn = first["prompt_tokens"] + first["completion_tokens"]
    assert second["reused_tokens"] >= whole_first_turn, (first, second)
    assert second["cache_hit"] == "partial" and second["prefilled_tokens"] < 64, second
    assert client_cached is not None and client_cached >= whole_first_turn, (client_cached, first)


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_a_cli_agent_runs_two_turns_and_the_second_reuses_the_whole_first(name, daemon, tmp_path):
    client = client_or_skip(name, tmp_path)
    target = endpoint(daemon)
    client.configure(target)
    turns, requests = [], []
    for prompt, follow_up in ((FIRST_PROMPT, False), (SECOND_PROMPT, True)):
        before = len(generate_lines(daemon, target.model))
        turn = client.run(prompt, target, follow_up=follow_up)
        assert turn.returncode == 0, f"{name} exited {turn.returncode}:\n{turn.printed[-3000:]}\n{daemon.log_tail()}"
        assert turn.answer == ANSWER, turn.printed[-3000:]
        turns.append(turn)
        requests.append(main_request(generate_lines(daemon, target.model)[before:]))
    assert requests[0]["prompt_tokens"] > 5000  # the agent's real instructions and tools, not a toy prompt
    assert requests[1]["prompt_tokens"] > requests[0]["prompt_tokens"]
    assert_whole_first_turn_reused(requests[0], requests[1], turns[1].cached_tokens)


def test_the_agents_sdk_runs_two_turns_and_the_second_reuses_the_whole_first(daemon):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, in the test extra) is not installed")
    target = endpoint(daemon)
    before = len(generate_lines(daemon, target.model))
    first, second = agents_sdk_turns(target)
    assert first.final_output == ANSWER and second.final_output == ANSWER
    requests = generate_lines(daemon, target.model)[before:]
    assert [line["path"] for line in requests] == ["/v1/responses", "/v1/responses"]
    usage = second.raw_responses[-1].usage
    assert usage.input_tokens == requests[1]["prompt_tokens"]
    assert_whole_first_turn_reused(requests[0], requests[1], usage.input_tokens_details.cached_tokens)


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_a_cli_agent_shows_a_prompt_longer_than_the_context_as_such(name, daemon, tmp_path):
    client = client_or_skip(name, tmp_path)
    target = endpoint(daemon, SHORT_CONTEXT)
    client.configure(target)
    if client.compacts_without_end:  # it shows the error, compacts, sends again, shows it again...: stop it
        turn = client.run(FIRST_PROMPT, target, as_json=False, timeout=COMPACTING_CLIENT_S, stop_at_timeout=True)
    else:
        turn = client.run(FIRST_PROMPT, target, as_json=False, timeout=TOO_LONG_TIMEOUT_S)
        assert turn.returncode != 0, turn.printed[-3000:]
    assert TOO_LONG.search(turn.printed), f"{name} did not say the prompt is too long:\n{turn.printed[-3000:]}"
    if not client.compacts_without_end:  # (opencode prints its compactions' summaries, written by the model)
        assert ANSWER not in turn.printed


def test_the_agents_sdk_shows_a_prompt_longer_than_the_context_as_such(daemon):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, in the test extra) is not installed")
    import openai

    with pytest.raises(openai.BadRequestError) as too_long:
        agents_sdk_turns(endpoint(daemon, SHORT_CONTEXT), prompts=("word " * 3000,))
    assert too_long.value.code == "context_length_exceeded" and TOO_LONG.search(str(too_long.value))
