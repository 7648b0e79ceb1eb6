"""The command line against the fake daemon: output, the cache line, exit codes."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import pytest

from prefixd.client.cli import _split_passthrough, main
from prefixd.client.display import format_cache_line, format_stats
from tests.support.fake_daemon import CACHE, TIMINGS, FakeDaemon, make_result


@pytest.fixture
def daemon():
    with tempfile.TemporaryDirectory(prefix="prefixd-test-") as directory:
        with FakeDaemon(Path(directory) / "d.sock") as fake:
            yield fake


def run(daemon, capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["--socket", str(daemon.path), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cache_line_reads_like_a_sentence():
    assert format_cache_line(make_result("x")) == (
        "cache: partial hit, reused 1,204 of 1,310 prompt tokens (prefilled 106, stored 131)"
        " · diverged at token 1204, message 3 (user) · ttft 0.21 s · 38.5 tok/s"
    )
    exact = dict(CACHE, hit="exact", reused_tokens=1310, prefilled_tokens=0, miss_reason=None, diverged_at=None)
    assert "diverged" not in format_cache_line({"cache": exact, "timings": TIMINGS})
    empty = dict(CACHE, hit="miss", reused_tokens=0, miss_reason="empty", diverged_at=None, diverged_message=None)
    assert "cache: miss, reused 0 of 1,310" in format_cache_line({"cache": empty})
    assert "nothing stored yet" in format_cache_line({"cache": empty})
    next_turn = dict(CACHE, miss_reason="extends", diverged_at=1204)
    assert "went past the stored prompt at token 1204, message 3 (user)" in format_cache_line({"cache": next_turn})
    assert format_cache_line({}).startswith("cache: unknown")  # an odd reply still prints something
    after_restart = dict(exact, source="disk")
    assert "from the disk cache" in format_cache_line({"cache": after_restart})
    assert "disk" not in format_cache_line(make_result("x"))


def test_stats_are_flattened():
    text = format_stats({"uptime_s": 12.5, "cache": {"bytes": 3 << 20, "hits": 1200}})
    assert text.splitlines() == ["uptime_s: 12.5", "cache.bytes: 3.0 MiB", "cache.hits: 1,200"]


def test_generate_streams_text_and_prints_the_cache_line(daemon, capsys):
    code, out, err = run(daemon, capsys, "generate", "hi", "--max-tokens", "5", "--stop", "a", "--stop", "b")
    assert code == 0 and out == "Hello\n"
    assert err.startswith("cache: partial hit, reused 1,204 of 1,310 prompt tokens")
    params = daemon.requests[0][2]
    assert params == {"prompt": "hi", "max_tokens": 5, "stop": ["a", "b"], "stream": True}


def test_generate_chat_sends_messages(daemon, capsys):
    code, out, _ = run(daemon, capsys, "generate", "hi", "--system", "be brief", "--no-stream")
    assert code == 0 and out == "echo:\n"  # the fake echoes 'prompt', which a chat request has not
    assert daemon.requests[0][2]["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
    ]


def test_generate_json_prints_the_whole_result(daemon, capsys):
    code, out, err = run(daemon, capsys, "generate", "hi", "--json", "--no-cache")
    assert code == 0 and err == ""
    assert json.loads(out)["finish_reason"] == "stop"
    assert daemon.requests[0][2]["cache"] == {"use": False, "store": False}


def test_chat_keeps_the_history_across_turns(daemon, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nagain\n/exit\nnever sent\n"))
    code, out, err = run(daemon, capsys, "chat", "--system", "sys", "--session", "s1")
    assert code == 0 and out == "Hello\nHello\n"
    assert err.count("cache: partial hit") == 2
    turns = [params for _, method, params in daemon.requests if method == "generate"]
    assert len(turns) == 2
    assert turns[1]["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again"},
    ]
    assert turns[1]["session"] == "s1"


def test_ping_and_daemon_errors(daemon, capsys):
    code, out, _ = run(daemon, capsys, "ping")
    assert code == 0 and out.startswith("pong from")
    code, out, err = run(daemon, capsys, "generate", "hi", "--model", "nope")
    assert code == 1 and out == ""
    assert err == "prefixd: no model named 'nope' [MODEL_NOT_FOUND]\n"


def test_no_daemon_exits_2_with_the_hint(capsys, tmp_path):
    code = main(["--socket", str(tmp_path / "none.sock"), "stats"])
    assert code == 2
    assert "prefixd serve --model DIR" in capsys.readouterr().err


def test_serve_and_setup_pass_everything_through():
    assert _split_passthrough(["serve", "--model", "M", "--help"]) == (["serve"], ["--model", "M", "--help"])
    assert _split_passthrough(["--socket", "/s", "setup", "--models-dir", "d"]) == (
        ["--socket", "/s", "setup"], ["--models-dir", "d"],
    )
    assert _split_passthrough(["generate", "serve"]) == (["generate", "serve"], [])


def test_config_prints_the_effective_configuration_with_sources(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("PREFIXD_MAX_ACTIVE", "4")
    assert main(["config", "--prefill-chunk", "256"]) == 0
    out = capsys.readouterr().out
    assert "prefill_chunk = 256" in out and "flag --prefill-chunk" in out
    assert "max_active = 4" in out and "env PREFIXD_MAX_ACTIVE" in out
    assert main(["config", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["settings"]["max_active"] == {"value": 4, "source": "env PREFIXD_MAX_ACTIVE"}
    monkeypatch.setenv("PREFIXD_MAX_ACTIVE", "0")
    assert main(["config"]) == 2
    assert "max_active" in capsys.readouterr().err
