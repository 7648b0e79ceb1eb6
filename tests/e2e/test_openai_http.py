"""The OpenAI-compatible HTTP front, driven by the official ``openai`` package against a real daemon.

Over TCP every request carries the daemon's bearer token (made once in
$XDG_CONFIG_HOME/prefixd/http-token when none is given), which OpenAI clients
send as their API key; over the Unix socket the peer's uid is checked instead.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
try:  # the HTTP library the installed openai uses: httpx2 in recent releases, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx

from tests.support.live_daemon import LiveDaemon, free_tcp_port  # noqa: E402

CHAT = [
    {"role": "system", "content": "You are a terse assistant for the prefixd project. Answer in one line."},
    {"role": "user", "content": "What does a prefix cache keep between requests?"},
]


def default_token_file(workdir: Path) -> Path:
    """Where a test daemon in ``workdir`` keeps its default token (daemon_env sets XDG_CONFIG_HOME=workdir/config)."""
    return workdir / "config" / "prefixd" / "http-token"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_for_http(client: httpx.Client, daemon: LiveDaemon, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.get("/models").status_code in (200, 401):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the HTTP front did not answer:\n{daemon.log_text()}")


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("openai")
    port = free_tcp_port()
    args = ["--http", f"127.0.0.1:{port}", "--http-socket", str(workdir / "http.sock")]
    with LiveDaemon(tiny_llama_dir, workdir, args) as live:
        live.base_url = f"http://127.0.0.1:{port}/v1"
        live.http_socket = workdir / "http.sock"
        with httpx.Client(base_url=live.base_url) as probe:
            wait_for_http(probe, live)
        live.token = default_token_file(workdir).read_text().strip()
        yield live


@pytest.fixture
def client(daemon):
    with openai.OpenAI(base_url=daemon.base_url, api_key=daemon.token, max_retries=0, timeout=60) as client:
        yield client


def test_models_lists_the_loaded_model(client):
    assert [model.id for model in client.models.list()] == ["llama"]
    assert client.models.retrieve("llama").owned_by == "prefixd"
    assert client.models.retrieve("llama").model_extra["prefixd_tools"] == "generic"  # its ChatML template reads no tools
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_repeat_reports_cached_tokens(client):
    first = client.chat.completions.create(model="llama", messages=CHAT, max_tokens=8)
    second = client.chat.completions.create(model="llama", messages=CHAT, max_tokens=8)
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content  # the tiny model's gibberish, but text
    assert first.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.content == first.choices[0].message.content  # greedy, cached or not
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens
    cache = second.model_extra["prefixd_cache"]
    assert cache["hit"] == "exact"
    assert second.usage.prompt_tokens_details.cached_tokens == cache["reused_tokens"] == second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens


def test_chat_stream_matches_the_whole_reply(client):
    messages = [{"role": "user", "content": "Stream me a few words about radix trees."}]
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=12)
    stream = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    closing = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert len(closing) == 1 and closing[0].model_extra["prefixd_cache"]["hit"] == "exact"
    usage = chunks[-1].usage  # include_usage: a last chunk without choices
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens  # its first token from stored logits


def test_completion_stream_and_not(client):
    prompt = "def fibonacci(n):\n    "
    whole = client.completions.create(model="llama", prompt=prompt, max_tokens=10)
    assert whole.object == "text_completion" and whole.choices[0].text
    streamed = list(client.completions.create(model="llama", prompt=prompt, max_tokens=10, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert streamed[-1].model_extra["prefixd_cache"]["reused_tokens"] > 0  # the same prompt again


def test_prefixd_extras_pass_through_extra_body(client):
    reply = client.chat.completions.create(
        model="llama", messages=CHAT, max_tokens=4, extra_body={"cache": {"use": False, "store": False}, "session": "ed"}
    )
    assert reply.model_extra["prefixd_cache"]["hit"] == "off"
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_bad_requests_get_openai_error_shapes(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llama", messages=CHAT, max_tokens=0)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "invalid_request_error" and "max_tokens" in bad.value.body["message"]
    assert bad.value.body["param"] == "max_tokens"

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    assert missing.value.body["code"] == "model_not_found" and "llama" in missing.value.body["message"]

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model="llama", prompt="word " * 9000, max_tokens=4, stream=stream)
        assert too_long.value.body["code"] == "context_length_exceeded"

    with pytest.raises(openai.BadRequestError) as multi:
        client.chat.completions.create(model="llama", messages=CHAT, max_tokens=4, n=2)
    assert multi.value.body["param"] == "n"


def test_raw_errors_are_json_too(daemon):
    with httpx.Client(base_url=daemon.base_url, headers=bearer(daemon.token)) as http:
        not_json = http.post("/chat/completions", content=b"{nope", headers={"Content-Type": "application/json"})
        assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
        assert http.get("/nowhere").json()["error"]["message"].startswith("no route GET /v1/nowhere on prefixd")


def test_http_over_a_unix_socket(daemon):
    transport = httpx.HTTPTransport(uds=str(daemon.http_socket))
    with httpx.Client(transport=transport) as http_client:
        # No token here: the kernel names the peer, and the daemon checks its uid instead.
        client = openai.OpenAI(base_url="http://prefixd/v1", api_key="unused", http_client=http_client, max_retries=0)
        reply = client.chat.completions.create(model="llama", messages=CHAT, max_tokens=8)
    assert reply.choices[0].message.content
    assert daemon.http_socket.stat().st_mode & 0o777 == 0o600


def test_client_disconnect_cancels_the_job(client, daemon):
    stream = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Go on forever."}], max_tokens=6000, stream=True
    )
    next(iter(stream))
    stream.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished = [e for e in daemon.log_events("generate") if e["request_id"].startswith("http:")]
        if finished and finished[-1]["finish_reason"] == "cancelled":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the job was not cancelled:\n{daemon.log_text()[-3000:]}")
    assert finished[-1]["completion_tokens"] < 6000
    assert finished[-1]["pid"] is None and finished[-1]["uid"] is None  # TCP: no peer credentials


def test_bearer_token_is_required_once_set(tiny_llama_dir, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    port = free_tcp_port()
    http_socket = tmp_path / "http.sock"
    args = ["--http", f"127.0.0.1:{port}", "--http-token-file", str(token_file), "--http-socket", str(http_socket)]
    with LiveDaemon(tiny_llama_dir, tmp_path / "d", args) as live:
        base_url = f"http://127.0.0.1:{port}/v1"
        with httpx.Client(base_url=base_url) as probe:
            wait_for_http(probe, live)
            assert probe.get("/models").status_code == 401
        wrong = openai.OpenAI(base_url=base_url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as denied:
            wrong.models.list()
        assert denied.value.body["code"] == "invalid_api_key"
        right = openai.OpenAI(base_url=base_url, api_key="s3cret-token", max_retries=0)
        assert [m.id for m in right.models.list()] == ["llama"]
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(http_socket))) as over_unix:
            assert over_unix.get("http://prefixd/v1/models").status_code == 200  # the peer's uid is the guard there
        assert not default_token_file(tmp_path / "d").exists()  # a given token: no default file
    assert live.proc.returncode == 0  # SIGTERM: a clean stop, HTTP front included
    assert not http_socket.exists()


def test_tcp_without_the_token_gets_401_in_openai_shape(daemon):
    with httpx.Client(base_url=daemon.base_url) as http:
        for headers in ({}, bearer("guess"), {"Authorization": daemon.token}):
            refused = http.post("/chat/completions", json={"model": "llama", "messages": CHAT, "max_tokens": 4}, headers=headers)
            assert refused.status_code == 401, headers
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["param"] is None
            assert "bearer token is required" in error["message"]
    with openai.OpenAI(base_url=daemon.base_url, api_key="guess", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="llama", messages=CHAT, max_tokens=4)


def test_the_default_token_file_is_made_0600_and_reused_on_restart(tiny_llama_dir, tmp_path):
    token_file = default_token_file(tmp_path)
    tokens = []
    for run in range(2):
        port = free_tcp_port()
        with LiveDaemon(tiny_llama_dir, tmp_path, ["--http", f"127.0.0.1:{port}"]) as live:
            base_url = f"http://127.0.0.1:{port}/v1"
            with httpx.Client(base_url=base_url) as probe:
                wait_for_http(probe, live)
                assert probe.get("/models").status_code == 401
            tokens.append(token_file.read_text().strip())
            with openai.OpenAI(base_url=base_url, api_key=tokens[-1], max_retries=0) as client:
                assert [m.id for m in client.models.list()] == ["llama"]
            logged = live.log_events("http_token")  # the log file holds both runs
            assert [(entry["file"], entry["created"]) for entry in logged] == [(str(token_file), True), (str(token_file), False)][: run + 1]
            assert tokens[-1] not in live.log_text()  # where the token is, never the token
        assert stat.S_IMODE(os.lstat(token_file).st_mode) == 0o600
    assert tokens[0] == tokens[1] and len(tokens[0]) >= 32


def test_the_no_token_opt_out(tiny_llama_dir, tmp_path):
    port = free_tcp_port()
    with LiveDaemon(tiny_llama_dir, tmp_path, ["--http", f"127.0.0.1:{port}"], env={"PREFIXD_HTTP_NO_TOKEN": "true"}) as live:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1") as http:
            wait_for_http(http, live)
            assert http.get("/models").status_code == 200
        assert live.log_events("http_without_token")
    assert not default_token_file(tmp_path).exists()


def test_non_loopback_http_needs_a_token(tiny_llama_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "prefixd.daemon", "--model", str(tiny_llama_dir), "--socket", str(tmp_path / "s"),
         "--http", "0.0.0.0:8080"],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PREFIXD_BLAS": "none"},
    )
    assert proc.returncode == 2
    assert "not a loopback address" in proc.stderr and "--http-token-file" in proc.stderr
    assert not (tmp_path / "s").exists()
