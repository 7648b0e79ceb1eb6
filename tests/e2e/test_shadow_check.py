"""The shadow check: cache hits re-run without the cache, compared, counted, and acted on.

Healthy tiny models (a KV-only llama and the hybrid lfm2) and SmolLM2 must
match on every check; a store entry damaged on its way in (the
``corrupt_segment`` fault point) must be caught, counted and logged with what
was reused, and with ``--shadow-action stop-reuse`` no longer reused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from prometheus_client import parser as prometheus_parser

from prefixd.client import Client
from prefixd.client.errors import PrefixdError
from prefixd.protocol.errors import ErrorCode
from tests.support.live_daemon import free_tcp_port

DOCUMENT = " ".join(f"Line {i}: the shadow check re-runs cached prompts and compares tokens." for i in range(40))


def _wait_until_checked(client: Client, timeout: float = 60.0) -> dict:
    """The stats' shadow map once no sampled hit waits for its check."""
    deadline = time.monotonic() + timeout
    while True:
        shadow = client.stats()["shadow"]
        if shadow["pending"] == 0:
            return shadow
        assert time.monotonic() < deadline, f"shadow checks still pending after {timeout:.0f} s: {shadow}"
        time.sleep(0.1)


def _cache_hits(client: Client, model: str, tag: str) -> int:
    """An exact repeat, partial hits and a chat's next turn; returns how many replies reused the cache."""
    prompt = f"[{tag}] {DOCUMENT}"
    replies = [client.generate(prompt=prompt, model=model, max_tokens=6) for _ in range(2)]
    replies += [client.generate(prompt=prompt[: len(prompt) * share // 4] + " Question?", model=model, max_tokens=6)
                for share in (1, 2, 3)]
    messages = [{"role": "system", "content": f"[{tag}] Be brief."}, {"role": "user", "content": "Hello there."}]
    first = client.generate(messages=messages, model=model, max_tokens=6)
    replies.append(client.generate(messages=messages + [{"role": "assistant", "content": first["text"]},
                                                        {"role": "user", "content": "Again?"}], model=model, max_tokens=6))
    return sum(reply["cache"]["reused_tokens"] > 0 for reply in replies)


def test_every_shadow_check_matches_on_healthy_models_and_metrics_count_them(start_daemon, tiny_llama_dir, tiny_lfm2_dir):
    port = free_tcp_port()
    daemon = start_daemon([tiny_llama_dir, tiny_lfm2_dir], ["--shadow-rate", "1", "--http", f"127.0.0.1:{port}"])
    with Client(daemon.socket_path, timeout=60) as client:
        reused = {model: _cache_hits(client, model, f"healthy {model}") for model in ("llama", "lfm2")}
        shadow = _wait_until_checked(client)
    assert shadow["longest_pass_ms"] > 0  # the passes ran, and were timed
    for model in ("llama", "lfm2"):
        counts = shadow["per_model"][model]
        assert reused[model] >= 3 and counts["mismatch"] == 0 and counts["failed"] == 0, (model, shadow)
        # Every reuse was sampled at rate 1; none was dropped on an idle engine.
        assert counts["match"] == reused[model], (model, reused, shadow)
    assert daemon.events("shadow_mismatch") == []

    import urllib.request

    token = (daemon.workdir / "config" / "prefixd" / "http-token").read_text().strip()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    samples = [s for family in prometheus_parser.text_string_to_metric_families(text) for s in family.samples]
    checks = {(s.labels["model"], s.labels["result"]): s.value for s in samples if s.name == "prefixd_shadow_checks_total"}
    assert checks[("llama", "match")] == reused["llama"] and checks[("lfm2", "mismatch")] == 0
    assert [s.value for s in samples if s.name == "prefixd_shadow_pending"] == [0]


def test_a_corrupted_store_entry_is_caught_counted_and_logged(start_daemon):
    # The first segment stored (the first prompt's KV) is damaged on its way into the store.
    daemon = start_daemon(extra_args=["--shadow-rate", "1"], env={"PREFIXD_FAULTS": "corrupt_segment:1"})
    prompt = f"[corrupted] {DOCUMENT}"
    with Client(daemon.socket_path, timeout=60) as client:
        client.generate(prompt=prompt, max_tokens=6)
        # A prompt running on past the stored one: its tail attends over the damaged KV. (An exact repeat
        # would take its first token from the logits stored with the prompt, computed before the damage.)
        repeat = client.generate(prompt=prompt + " Once more.", max_tokens=6)
        assert repeat["cache"]["hit"] == "partial" and repeat["cache"]["reused_tokens"] > 0
        shadow = _wait_until_checked(client)
    assert shadow["per_model"]["llama"]["mismatch"] == 1, shadow
    (line,) = daemon.events("shadow_mismatch")
    assert line["request_id"] and line["model"] == "llama" and line["level"] == "error"
    assert line["checkpoint"] == repeat["cache"]["checkpoint"] and line["reused_tokens"] == repeat["cache"]["reused_tokens"]
    assert line["source"] == "memory" and line["max_logprob_difference"] > line["tolerance"]
    if line["first_difference"] is not None:  # the damage changed a token, not only the log-probabilities
        assert line["cached_token"] != line["uncached_token"]


def test_stop_reuse_turns_off_the_distrusted_checkpoint_kind_until_restart(start_daemon):
    daemon = start_daemon(extra_args=["--shadow-rate", "1", "--shadow-action", "stop-reuse"],
                          env={"PREFIXD_FAULTS": "corrupt_segment:1"})
    prompt = f"[stop-reuse] {DOCUMENT}"
    with Client(daemon.socket_path, timeout=60) as client:
        client.generate(prompt=prompt, max_tokens=6)
        verified = client.generate(prompt=prompt + " Once more.", max_tokens=6, cache={"verify": True})  # over the damage
        assert verified["verify"]["status"] == "mismatch" and verified["verify"]["checkpoint"] == verified["cache"]["checkpoint"]
        kind = verified["cache"]["checkpoint"]
        assert client.stats()["shadow"]["distrusted"] == {"llama": [kind]}
        after = client.generate(prompt=prompt, max_tokens=6)
        assert after["cache"]["hit"] == "off" and after["cache"]["miss_reason"] == "distrusted"
        assert after["cache"]["reused_tokens"] == 0
        # The uncached answer is the right one: it is what a cache-less request gives.
        uncached = client.generate(prompt=prompt, max_tokens=6, cache={"use": False, "store": False})
        assert after["text"] == uncached["text"]
    daemon.wait_for_event("shadow_stop_reuse", model="llama", checkpoint=kind)


def test_verify_requests_carry_the_comparison_in_their_reply(shared_daemon):
    prompt = f"[verify reply] {DOCUMENT}"
    with Client(shared_daemon.socket_path, timeout=60) as client:
        fresh = client.generate(prompt=prompt, max_tokens=6, cache={"verify": True})
        assert fresh["verify"]["status"] == "not-checked" and "nothing was reused" in fresh["verify"]["reason"]
        for model in ("llama", "lfm2"):
            client.generate(prompt=prompt, max_tokens=6, model=model)
            repeat = client.generate(prompt=prompt, max_tokens=6, model=model, cache={"verify": True})
            verify = repeat["verify"]
            assert verify["status"] == "match", verify
            assert verify["compared_tokens"] >= repeat["usage"]["completion_tokens"] >= 1  # every answer token (+ an end token)
            assert verify["reused_tokens"] == repeat["cache"]["reused_tokens"] > 0
            assert verify["max_logprob_difference"] <= verify["tolerance"]
        with pytest.raises(PrefixdError) as err:
            client.generate(prompt=prompt, max_tokens=6, temperature=0.7, cache={"verify": True})
        assert err.value.code == ErrorCode.INVALID_PARAMS and "temperature 0" in str(err.value)
        assert client.ping()["pong"] is True


def test_prefixd_verify_prints_a_table_and_fails_on_a_mismatch(start_daemon, tiny_llama_dir, tiny_lfm2_dir, tmp_path):
    def verify(daemon, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "prefixd.client.cli", "--socket", str(daemon.socket_path),
                               "--timeout", "120", "verify", *args], capture_output=True, text=True, timeout=300)

    healthy = start_daemon([tiny_llama_dir, tiny_lfm2_dir])
    for model in ("llama", "lfm2"):
        done = verify(healthy, "--model", model)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "no mismatch" in done.stdout and "checkpoint" in done.stdout.splitlines()[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("A prompt from a file, sent twice.") + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "A chat from a file."}]}) + "\n")
    done = verify(healthy, "--prompts", str(prompts), "--json")
    checks = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and [c["status"] for c in checks] == ["match", "match"], done.stdout + done.stderr

    damaged = start_daemon(env={"PREFIXD_FAULTS": "corrupt_segment:1"})
    done = verify(damaged)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "first mismatch: repeat" in done.stdout


def test_smollm2_cache_hits_match_their_uncached_runs(start_daemon, smollm2_dir):
    daemon = start_daemon([smollm2_dir], ["--shadow-rate", "1"])
    with Client(daemon.socket_path, timeout=120) as client:
        (model,) = [m["name"] for m in client.models()["models"]]
        reused = _cache_hits(client, model, "smollm2")
        shadow = _wait_until_checked(client, timeout=120)
    counts = shadow["per_model"][model]
    assert reused >= 3 and counts["match"] == reused and counts["mismatch"] == 0, shadow
