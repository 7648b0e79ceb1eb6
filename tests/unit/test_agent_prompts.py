"""Claude Code's billing line leaves the prompt (unless kept), and Anthropic's hint fields follow the policy."""

from __future__ import annotations

import json

import pytest

from prefixd.daemon.front import http_options
from prefixd.daemon.front.agent_prompts import ANTHROPIC_BILLING_HEADER, PromptNormalizer, strip_billing_header
from prefixd.daemon.front.anthropic_shapes import messages_request
from prefixd.daemon.service import main as daemon_main
from prefixd.daemon.service.config import explicit_flags, load_config
from prefixd.protocol.errors import RpcError
from tests.support.claude_code_requests import fitted, load_headers, load_request

LINE = "x-anthropic-billing-header: cc_version=2.1.197.683; cc_entrypoint=sdk-cli;"


@pytest.mark.parametrize("system, expected", [
    ([{"type": "text", "text": LINE}, {"type": "text", "text": "You are terse."}], [{"type": "text", "text": "You are terse."}]),
    ([{"type": "text", "text": LINE + "\nYou are terse.", "cache_control": {"type": "ephemeral"}}],
     [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]),
    (LINE + "\nYou are terse.", "You are terse."),
])
def test_the_billing_line_is_taken_out_of_a_system_prompt(system, expected):
    assert strip_billing_header(system) == (expected, LINE)


@pytest.mark.parametrize("system", [
    "You are terse.",
    [{"type": "text", "text": "You are terse."}, {"type": "text", "text": LINE}],  # only a first line is a billing line
    "You are terse.\n" + LINE,
    [{"type": "image", "source": {}}],
])
def test_anything_else_stays_as_it_is(system):
    assert strip_billing_header(system) == (system, None)


def test_the_normalizer_counts_logs_once_and_can_be_switched_off():
    normalizer = PromptNormalizer()
    system = load_request("first_turn")["system"]
    for _ in range(3):
        stripped, names = normalizer.anthropic_system(system, "claude-cli/2.1.197")
        assert names == [ANTHROPIC_BILLING_HEADER] and stripped == system[1:]
    assert normalizer.counts == {ANTHROPIC_BILLING_HEADER: 3}
    assert not normalizer.first_time("claude-cli/2.1.197", ANTHROPIC_BILLING_HEADER)  # told at its first request
    kept = PromptNormalizer(keep_billing_header=True)
    assert kept.anthropic_system(system, "claude-cli/2.1.197") == (system, []) and not kept.counts


def test_keep_billing_header_is_a_flag_an_environment_variable_and_a_setting(tmp_path):
    args = daemon_main.build_parser().parse_args(["--http", "127.0.0.1:8080", "--http-no-token", "--keep-billing-header"])
    assert http_options.http_settings(args, {}).keep_billing_header is True
    environ = {"XDG_CONFIG_HOME": str(tmp_path), "PREFIXD_KEEP_BILLING_HEADER": "true"}
    assert load_config(explicit_flags(daemon_main.build_parser, []), environ).values["keep_billing_header"] is True
    assert load_config(explicit_flags(daemon_main.build_parser, ["--keep-billing-header"]),
                       {"XDG_CONFIG_HOME": str(tmp_path)}).values["keep_billing_header"] is True


def test_claude_codes_request_is_accepted_with_each_hint_named():
    body = load_request("first_turn")
    normalizer = PromptNormalizer()
    parsed = messages_request(body, "m", load_headers()["anthropic-beta"],
                              lambda system: normalizer.anthropic_system(system, "claude-cli/2.1.197"))
    named = {note.split(" ", 1)[0].rstrip(":") for note in parsed.notes}
    assert named == {"thinking", "context_management", "output_config.effort", "anthropic-beta", "cache_control",
                     "metadata.user_id"}
    assert parsed.normalized == [ANTHROPIC_BILLING_HEADER] and parsed.system_in_messages
    messages = parsed.params.prompt.messages
    assert [m["role"] for m in messages] == ["system", "user", "system"]
    assert not messages[0]["content"].startswith("x-anthropic") and len(parsed.params.prompt.tools) == 25
    assert parsed.params.max_tokens == 32000


def test_the_title_request_asks_for_its_schema():
    parsed = messages_request(fitted(load_request("title_request")), "m")
    schema = load_request("title_request")["output_config"]["format"]["schema"]
    assert parsed.params.constraint.kind == "json_schema" and json.loads(parsed.params.constraint.source) == schema


@pytest.mark.parametrize("extra, field", [
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "budget": 3}}, "thinking.budget"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits[0].type"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"output_config": {"task_budget": {"type": "tokens", "total": 100}}}, "output_config.task_budget"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x", "output_config": {"format": {}}}]},
     "messages[1].output_config.format"),
])
def test_what_would_change_the_answer_is_refused_by_name(extra, field):
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(RpcError) as err:
        messages_request(body, "m")
    assert err.value.data == {"param": field}, err.value.message
