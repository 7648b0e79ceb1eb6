"""What the HTTP front answers and logs around the requests themselves: probes, unknown routes, refusals, hints.

What the agent and editor clients met (issue 29): Claude Code's unauthenticated ``HEAD /`` at every start, a
refused request that left no log line, a 404 that did not say the route is missing, llama.vim's llama.cpp fields
on /v1/chat/completions, an /infill answer cut by the indentation rule logged as "cancelled".
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from tests.support.http_daemon import http_daemon


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with http_daemon(tiny_llama_dir, tmp_path_factory.mktemp("front")) as live:
        yield live


def unauthenticated(daemon, method: str, path: str) -> int:
    request = urllib.request.Request(daemon.base_url + path, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_probe_of_an_agent_is_answered_without_a_token_or_a_warning(daemon):
    assert unauthenticated(daemon, "HEAD", "/") == 200
    assert not daemon.events("http_unauthorized", path="/")
    assert unauthenticated(daemon, "GET", "/") == 401  # only the probe: anything else still needs the token
    daemon.wait_for_event("http_unauthorized", path="/")


def test_an_unknown_route_says_it_does_not_exist_and_is_logged(daemon):
    status, reply = daemon.post_json("/v1/foo", {})
    assert status == 404
    message = reply["error"]["message"]
    assert message.startswith("no route POST /v1/foo on prefixd; its routes: ") and "/v1/messages" in message
    line = daemon.wait_for_event("http_refused", path="/v1/foo")
    assert line["status"] == 404 and line["level"] == "info" and line["error"] == message and "exception" not in line


def test_a_refused_request_leaves_one_line_with_its_status_and_message(daemon):
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 3}
    status, reply = daemon.post_json("/v1/chat/completions", body)
    assert status == 400
    daemon.wait_for_event("http_refused", path="/v1/chat/completions")
    lines = [line for line in daemon.events("http_refused", path="/v1/chat/completions") if line["status"] == 400]
    assert [line["error"] for line in lines] == [reply["error"]["message"]] and "exception" not in lines[0]


def test_llama_vims_fields_on_chat_completions_are_hints(daemon):
    # llama.vim's instruction mode sends llama.cpp's own fields to /v1/chat/completions.
    body = {"model": "llama", "messages": [{"role": "user", "content": "Say hello to llama.vim."}], "max_tokens": 2,
            "cache_prompt": True, "id_slot": 0, "samplers": ["top_k", "top_p"]}
    status, reply = daemon.post_json("/v1/chat/completions", body)
    assert status == 200, reply
    assert [note.split(":")[0] for note in reply["prefixd_notes"]] == ["cache_prompt", "id_slot", "samplers"]
    status, again = daemon.post_json("/v1/chat/completions", {**body, "cache_prompt": False})
    assert status == 200 and again["prefixd_cache"]["hit"] == "off"  # false is honoured: nothing cached is reused


def test_stream_options_must_be_an_object(daemon):
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "usage"}
    status, reply = daemon.post_json("/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] == "stream_options"


def test_an_infill_answer_cut_by_the_indent_rule_is_logged_as_a_stop(daemon):
    # Random weights: sample until an answer holds a newline, which n_indent 100 cuts at the next line.
    body = {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "prompt": "", "n_predict": 64, "n_indent": 100,
            "temperature": 2.0, "model": "llama-fim"}
    for seed in range(20):
        status, reply = daemon.post_json("/infill", {**body, "seed": seed})
        assert status == 200, reply
        if reply["tokens_predicted"] < 64:
            break
    else:
        pytest.fail("no sampled answer held a newline")
    line = daemon.wait_for_event("generate", model="llama-fim", stopped_by_front="n_indent")
    assert line["finish_reason"] == "stop"
    assert not [line for line in daemon.events("generate", model="llama-fim") if line["finish_reason"] == "cancelled"]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/messages", {"model": "llama", "max_tokens": 4, "temperature": "hot", "messages": [{"role": "user", "content": "hi"}]},
     "temperature"),
    ("/api/chat", {"model": "llama", "options": {"temperature": [1]}, "messages": [{"role": "user", "content": "hi"}]},
     "options.temperature"),
    ("/api/generate", {"model": "llama", "prompt": "hi", "options": {"temperature": "hot"}}, "options.temperature"),
    ("/v1/chat/completions", {"model": "llama", "temperature": "hot", "messages": [{"role": "user", "content": "hi"}]},
     "temperature"),
    ("/v1/responses", {"model": "llama", "temperature": {"x": 1}, "input": "hi"}, "temperature"),
])
def test_a_wrongly_typed_temperature_is_a_400_naming_it_on_every_api(daemon, path, body, field):
    status, reply = daemon.post_json(path, body)
    assert status == 400, reply
    assert f"'{field}' must be a number" in str(reply)
    assert not daemon.events("http_handler_failed")
