"""Claude Code's own requests (tests/fixtures/claude_code), replayed against a real daemon: accepted, and cached.

The bodies are cut to fit a tiny model's context (tests/support/claude_code_requests.py) and keep every field,
block, role and marker Claude Code sent. The model is the tiny llama with a Hermes tools template.
"""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.daemon_process import RawConnection
from tests.support.claude_code_requests import billing_line, fitted, load_headers, load_request, with_billing_line
from tests.support.http_daemon import http_daemon

anthropic = pytest.importorskip("anthropic")

# A template that, like Gemma's or Mistral's, takes system text only as the first message.
STRICT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and not loop.first -%}{{ raise_exception('system text only comes first') }}{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tiny_tools_dir, tmp_path_factory):
    strict = tmp_path_factory.mktemp("models") / "llama-strict"
    shutil.copytree(tiny_llama_dir, strict)
    (strict / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("claude-code"), [tiny_tools_dir, strict]) as live:
        yield live


def send(daemon, body: dict, max_tokens: int = 3) -> dict:
    status, reply = daemon.post_json("/v1/messages", {**body, "stream": False, "max_tokens": max_tokens})
    assert status == 200, reply
    return reply


def test_the_billing_line_is_left_out_so_the_next_task_reuses_the_prompt(daemon):
    first = fitted(load_request("first_turn"), model="llama-tools")
    # The same request from another task: Claude Code changes only the billing line's suffix.
    again = with_billing_line(first, billing_line(load_request("tool_loop_turn1")))
    assert billing_line(again) != billing_line(first)
    one, two = send(daemon, first), send(daemon, again)
    assert one["prefixd_cache"]["normalized"] == two["prefixd_cache"]["normalized"] == ["anthropic_billing_header"]
    prompt_tokens = two["prefixd_cache"]["prompt_tokens"]
    assert prompt_tokens > 1500 and two["prefixd_cache"]["hit"] == "exact"
    assert two["usage"]["cache_read_input_tokens"] == two["prefixd_cache"]["reused_tokens"] >= prompt_tokens - 1
    assert two["usage"]["input_tokens"] <= 1


def test_another_task_reuses_everything_before_its_prompt(daemon):
    send(daemon, fitted(load_request("first_turn"), model="llama-tools"))
    other = send(daemon, fitted(load_request("tool_loop_turn1"), model="llama-tools"))
    cache = other["prefixd_cache"]
    # Instructions, tools and the date reminder are shared; the tasks part at the user's own words.
    assert cache["diverged_message"] == {"index": 1, "role": "user"}
    assert cache["reused_tokens"] > 0.8 * cache["prompt_tokens"]


def test_the_next_turn_of_a_tool_loop_reuses_the_whole_first_turn(daemon):
    turn1, turn2 = (fitted(load_request(name), model="llama-tools") for name in ("tool_loop_turn1", "tool_loop_turn2"))
    first = send(daemon, turn1)
    second = send(daemon, turn2)
    # turn2 adds the (captured) tool call and its result; the cache_control marker moved to the new last turn.
    assert second["prefixd_cache"]["reused_tokens"] >= first["prefixd_cache"]["prompt_tokens"] - 1
    assert second["prefixd_cache"]["diverged_message"]["index"] >= 3  # past the system message inside messages


def test_streamed_as_claude_code_asks_with_its_headers(daemon):
    body = fitted(load_request("first_turn"), model="llama-tools")
    headers = {name: value for name, value in load_headers().items() if name.lower().startswith(("anthropic-", "x-app"))}
    fields = {key: body[key] for key in ("model", "messages", "system", "tools", "metadata", "thinking")}
    extra = {key: body[key] for key in ("context_management", "output_config")}
    with anthropic.Anthropic(base_url=daemon.base_url, api_key=daemon.token, max_retries=0, timeout=120) as client:
        with client.messages.stream(max_tokens=4, extra_headers=headers, extra_body=extra, **fields) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.usage.cache_read_input_tokens > 1000


def test_the_title_request_answers_its_schema(daemon):
    reply = send(daemon, fitted(load_request("title_request"), model="llama-tools"), max_tokens=48)
    assert reply["stop_reason"] in ("end_turn", "max_tokens")  # a random model may write a long title
    assert reply["content"][0]["text"].startswith('{"title": "')


def test_a_template_without_late_system_text_gets_anthropics_refusal(daemon):
    # Claude Code answers this exact wording by sending the request again with the message folded into the user turn.
    body = fitted(load_request("first_turn"), model="llama-strict")
    del body["tools"]
    status, reply = daemon.post_json("/v1/messages", {**body, "stream": False, "max_tokens": 2})
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith("role 'system' is not supported on this model")
    folded = {**body, "messages": [{"role": "user", "content": body["messages"][0]["content"] + [
        {"type": "text", "text": "<system-reminder>\n" + body["messages"][1]["content"] + "\n</system-reminder>"}]}]}
    assert send(daemon, folded)["type"] == "message"


def test_the_billing_line_is_counted_and_logged_once_per_client(daemon):
    stats_before = daemon.get_text("/metrics")
    for _ in range(2):
        send(daemon, fitted(load_request("first_turn"), model="llama-tools"))
    logged = daemon.events("prompt_normalized")
    agents = [line["client_agent"] for line in logged]
    assert "Python-urllib" in " ".join(agents) and len(agents) == len(set(agents))  # one line per client, at its first
    assert all(line["removed"].startswith("x-anthropic-billing-header: cc_version=") for line in logged)
    after = daemon.get_text("/metrics")
    assert _normalized_count(after) >= _normalized_count(stats_before) + 2
    with RawConnection(daemon.socket_path) as conn:
        assert conn.result("stats")["prompts_normalized"]["anthropic_billing_header"] == _normalized_count(after)


def _normalized_count(metrics_page: str) -> float:
    for line in metrics_page.splitlines():
        if line.startswith('prefixd_prompts_normalized_total{what="anthropic_billing_header"}'):
            return float(line.split()[-1])
    return 0.0
