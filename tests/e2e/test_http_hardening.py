"""Hostile HTTP bodies get a 400 in OpenAI's error shape that says what is wrong, never a 500.

Through the real daemon's HTTP front: an integer of 5,000 digits, JSON nested
100,000 deep, and a lone surrogate escape ("\\ud800", valid JSON but not
Unicode text, which used to reach the tokenizer). The daemon keeps serving.
"""

from __future__ import annotations

import pytest

try:  # the HTTP library the installed openai uses: httpx2 in recent releases, httpx before
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

from tests.support.live_daemon import LiveDaemon, free_tcp_port  # noqa: E402

TOKEN = "hardening-token"
MESSAGES = '[{"role": "user", "content": "Say hi."}]'


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hardening")
    token_file = workdir / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_tcp_port()
    with LiveDaemon(tiny_llama_dir, workdir, ["--http", f"127.0.0.1:{port}", "--http-token-file", str(token_file)]) as live:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            _wait_until_up(client, live)
            client.daemon = live
            yield client


def _wait_until_up(client, live: LiveDaemon) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if client.get("/models").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the HTTP front did not answer:\n{live.log_text()}")


def post_raw(http, path: str, body: str):
    return http.post(path, content=body.encode(), headers={"Content-Type": "application/json"})


def assert_bad_request(response, *fragments: str) -> dict:
    assert response.status_code == 400, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and set(error) >= {"message", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", '{"model": "llama", "messages": ' + MESSAGES + ', "max_tokens": ' + "9" * 5000 + "}"),
    ("/completions", '{"model": "llama", "prompt": [1, 2, ' + "7" * 5000 + "]}"),
], ids=["chat-max-tokens", "completion-token-ids"])
def test_an_integer_of_5000_digits(http, path, body):
    assert_bad_request(post_raw(http, path, body), "an integer of 5000 digits", "at most 100")


@pytest.mark.parametrize("body", [
    "[" * 100_000 + "]" * 100_000,
    '{"model": "llama", "messages": ' + MESSAGES + ', "metadata": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}",
], ids=["array", "object-in-a-field"])
def test_json_nested_100k_deep(http, body):
    assert_bad_request(post_raw(http, "/chat/completions", body), "nested too deeply")


@pytest.mark.parametrize("path, body, where, param", [
    ("/chat/completions", '{"model": "llama", "messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content", "messages"),
    ("/completions", '{"model": "llama", "prompt": "def f(): \\udfff", "max_tokens": 4}', "prompt", "prompt"),
], ids=["chat-content", "completion-prompt"])
def test_a_lone_surrogate_escape(http, path, body, where, param):
    error = assert_bad_request(post_raw(http, path, body), where, "lone surrogate", "not valid Unicode")
    assert error["param"] == param


def test_a_surrogate_pair_is_fine_and_the_daemon_still_serves(http):
    body = '{"model": "llama", "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], "max_tokens": 4}'
    reply = post_raw(http, "/chat/completions", body)
    assert reply.status_code == 200, reply.text[:500]
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    assert not http.daemon.log_events("http_handler_failed")  # none of the bodies above was a 500
