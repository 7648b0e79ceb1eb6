"""prefixd daemons behind an existing cache-aware router: Shepherd Model Gateway (smg), unchanged.

The first tests need no router: the routes a router reads (``/health``,
``/v1/loads``, ``/server_info``) on one daemon. The others start two daemons
and smg in front (bench/router_fleet.py, the fleet of bench/router_workload.py)
and see, from each reply's cache map and the router's ``x-smg-routed-worker-id``
header, requests with a shared prefix land on the daemon that holds it (by the
request text, or by the tenant's key), and a daemon killed under load fail over,
then serve again warm from its disk cache.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.router_client import TENANT_KEY_HEADER, TENANT_NAMES, stream_chat, system_prompt
from bench.router_fleet import ROUTED_WORKER_HEADER, Fleet, find_smg
from tests.support.http_daemon import http_daemon

needs_smg = pytest.mark.skipif(
    find_smg() is None,
    reason="smg (Shepherd Model Gateway) is not installed: the test extra has it on Linux x86_64 and macOS arm64 "
           "(pip install -e '.[test]'); it has no wheel for this platform")
MIB = 1 << 20


def _get(url: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _chat(fleet: Fleet, tenant: int, question: str, max_tokens: int = 4, timeout: float = 60,
          key: str | None = None) -> tuple[int, dict, str]:
    """A non-streamed chat through the router (naming its routing ``key``, if any): status, body, the daemon."""
    body = {"model": "llama", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system_prompt(tenant, 120)}, {"role": "user", "content": question}]}
    headers = {"Authorization": f"Bearer {fleet.token}", "Content-Type": "application/json"}
    if key is not None:
        headers[TENANT_KEY_HEADER] = key
    request = urllib.request.Request(fleet.router.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), response.headers.get(ROUTED_WORKER_HEADER)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers.get(ROUTED_WORKER_HEADER)


def _wait_until_answering(fleet: Fleet, threads: list[threading.Thread], timeout: float = 30) -> None:
    """Until the daemons run one request for each of ``threads`` not yet done, as the router has seen them start."""
    deadline = time.monotonic() + timeout
    while sum(_in_flight(d.loads()) for d in fleet.daemons) < sum(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, "a request never started"
        time.sleep(0.02)


def _in_flight(loads: dict) -> int:
    return loads["loads"][0]["num_running_reqs"] + loads["loads"][0]["num_waiting_reqs"]


# -- the routes a router reads, on one daemon ---------------------------------------------------------------------


def test_health_answers_without_the_token_and_the_other_router_routes_need_it(tiny_llama_dir, tmp_path):
    with http_daemon(tiny_llama_dir, tmp_path, model_dirs=[tiny_llama_dir]) as daemon:
        assert _get(daemon.base_url + "/health") == (200, {"status": "ok"})  # smg's first probe carries no key
        for path in ("/health_generate", "/v1/loads", "/server_info", "/model_info"):
            assert _get(daemon.base_url + path)[0] == 401, path
        assert _get(daemon.base_url + "/health_generate", daemon.token) == (200, {"status": "ok"})
        status, info = _get(daemon.base_url + "/server_info", daemon.token)
        assert status == 200 and info["served_model_name"] == "llama" and info["context_length"] > 0
        status, loads = _get(daemon.base_url + "/v1/loads", daemon.token)
        assert status == 200 and loads["dp_rank_count"] == 1
        assert loads["loads"][0]["num_running_reqs"] == 0 and loads["loads"][0]["token_usage"] == 0


def test_loads_count_a_running_request_and_its_kv(tiny_llama_dir, tmp_path):
    with http_daemon(tiny_llama_dir, tmp_path, model_dirs=[tiny_llama_dir]) as daemon:
        body = {"model": "llama", "max_tokens": 800, "temperature": 0, "messages": [{"role": "user", "content": "Go on."}]}
        long_one = threading.Thread(target=daemon.post, args=("/v1/chat/completions", body))
        long_one.start()
        deadline, load = time.monotonic() + 20, {}
        while time.monotonic() < deadline:
            load = _get(daemon.base_url + "/v1/loads", daemon.token)[1]["loads"][0]
            if load["num_running_reqs"]:
                break
            time.sleep(0.05)
        assert load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 0
        assert load["token_usage"] > 0  # its KV, reserved up to prompt + max_tokens, holds part of --cache-bytes
        long_one.join(60)


# -- two daemons behind smg ---------------------------------------------------------------------------------------


@needs_smg
def test_a_shared_prefix_lands_on_the_daemon_that_holds_it(tiny_llama_dir, tmp_path):
    with Fleet(tiny_llama_dir, tmp_path, 2, "cache_aware", 256 * MIB) as fleet:
        # Four tenants arrive one after another, each while the one before is still answering: smg places a prefix
        # nobody holds on the daemon with the least load (the requests it sent there and has not seen end, and the
        # loads it polls), ties to the first daemon. Sent all at once, they would race smg's own count: under load
        # every one of them could see both daemons idle and go to the first (CI saw that once).
        firsts: list = [None] * 4
        answering = []
        for tenant in range(4):
            def first_question(tenant=tenant):
                firsts[tenant] = _chat(fleet, tenant, f"First question of tenant {tenant}?", 300)
            answering.append(threading.Thread(target=first_question))
            answering[-1].start()
            _wait_until_answering(fleet, answering)
        for thread in answering:
            thread.join(120)
        home: dict[int, str] = {}
        for tenant, (status, reply, worker) in enumerate(firsts):
            assert status == 200, reply
            # Nobody held this tenant's system prompt: at most the chat template's head was reused.
            assert reply["prefixd_cache"]["reused_tokens"] < 0.1 * reply["prefixd_cache"]["prompt_tokens"], reply
            home[tenant] = worker
        assert set(home.values()) == {d.url for d in fleet.daemons}, home
        for session in range(1, 3):
            for tenant in range(4):  # interleaved, as sessions arrive
                status, reply, worker = _chat(fleet, tenant, f"Question {session} of tenant {tenant}?")
                assert status == 200, reply
                cache = reply["prefixd_cache"]
                # The router sent it where the prefix lives, and that daemon reused it: the system prompt and the
                # chat template's head, all but the question.
                assert worker == home[tenant], (tenant, session)
                assert cache["hit"] == "partial" and cache["reused_tokens"] >= 0.8 * cache["prompt_tokens"], cache
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == cache["reused_tokens"]


@needs_smg
def test_a_tenant_key_goes_where_fewest_keys_are_in_flight_then_stays(tiny_llama_dir, tmp_path):
    with Fleet(tiny_llama_dir, tmp_path, 2, "manual", 256 * MIB) as fleet:
        # Tenant 0's long answer is in flight on one daemon when tenant 1's first request comes: smg's min_group
        # sends a new key to the daemon with the fewest distinct keys in flight, the other one.
        long_answer: list = []
        first = threading.Thread(target=lambda: long_answer.append(
            _chat(fleet, 0, "Talk at length.", max_tokens=1500, key=TENANT_NAMES[0])))
        first.start()
        deadline = time.monotonic() + 30
        while not any(d.loads()["loads"][0]["num_running_reqs"] for d in fleet.daemons):
            assert time.monotonic() < deadline, "tenant 0's request never started"
            time.sleep(0.05)
        status, reply, home_of_1 = _chat(fleet, 1, "First question?", key=TENANT_NAMES[1])
        first.join(60)
        status_0, reply_0, home_of_0 = long_answer[0]
        assert status == 200 and status_0 == 200, (reply, reply_0)
        assert home_of_0 != home_of_1
        # Every later request of a key follows it, and finds its tenant's prefix there.
        for turn, (tenant, home) in enumerate(((0, home_of_0), (1, home_of_1), (0, home_of_0), (1, home_of_1))):
            status, reply, worker = _chat(fleet, tenant, f"Question {turn}?", key=TENANT_NAMES[tenant])
            cache = reply["prefixd_cache"]
            assert status == 200 and worker == home, (tenant, reply)
            assert cache["hit"] == "partial" and cache["reused_tokens"] >= 0.8 * cache["prompt_tokens"], cache
        # A client that names no key is still served.
        status, reply, worker = _chat(fleet, 0, "No key?")
        assert status == 200 and worker in (home_of_0, home_of_1), reply


@needs_smg
def test_a_killed_daemon_fails_over_then_serves_again_warm_from_its_disk_cache(tiny_llama_dir, tmp_path):
    daemon_args = ["--disk-cache-bytes", "256M", "--disk-save-interval", "1"]
    with Fleet(tiny_llama_dir, tmp_path, 2, "cache_aware", 256 * MIB, daemon_args) as fleet:
        homes = {tenant: _chat(fleet, tenant, "Hello?")[2] for tenant in range(2)}
        victim = fleet.daemons[fleet.daemon_at(homes[0])]
        _wait_for_a_disk_save(victim.log_path)

        # One streamed and one plain request of a few seconds in flight on the victim when it is killed.
        streamed: dict = {}
        body = {"model": "llama", "max_tokens": 1500, "temperature": 0,
                "messages": [{"role": "system", "content": system_prompt(0, 120)}, {"role": "user", "content": "Talk."}]}
        stream_thread = threading.Thread(target=lambda: streamed.update(stream_chat(fleet.router.url, fleet.token, body, 60)))
        plain: list = []
        plain_thread = threading.Thread(target=lambda: plain.append(_chat(fleet, 0, "Talk at length.", 1500)))
        stream_thread.start(), plain_thread.start()
        time.sleep(0.5)
        victim.kill()

        # While it is down, its tenant is served by the other daemon.
        for attempt in range(3):
            status, reply, worker = _chat(fleet, 0, f"Still there? {attempt}")
            assert status == 200 and worker != victim.url, reply

        # Nothing hangs: each request that was on it ends with an answer (retried on the other daemon) or a clear
        # error (a stream already under way cannot be retried: the router ends it with an error event).
        victim.start()  # as its service manager would, at once, on the same port
        restarted_at = time.monotonic()
        stream_thread.join(60), plain_thread.join(60)
        assert not stream_thread.is_alive() and not plain_thread.is_alive(), "a request hung on the killed daemon"
        assert streamed["ok"] or "error" in streamed["error"].lower(), streamed
        status, reply, _ = plain[0]
        assert status == 200 or reply.get("error", {}).get("message"), plain[0]

        # The router sends it its tenant's first question again, and it answers from the prefixes its disk kept.
        # (smg's tree matches request text: text that grew on the other daemon during the outage, as "Still
        # there?" did, stays there, where it is cached now; "Hello?" matches both daemons equally, and either may
        # get it until the restarted one is picked.)
        while time.monotonic() < restarted_at + 60:
            status, reply, worker = _chat(fleet, 0, "Hello?")
            assert status == 200, reply
            if worker == victim.url:
                break
            time.sleep(0.3)
        assert worker == victim.url, "the restarted daemon got none of its tenant's requests within 60 s"
        cache = reply["prefixd_cache"]
        assert cache["source"] == "disk" and cache["reused_tokens"] >= 0.8 * cache["prompt_tokens"], cache


def _wait_for_a_disk_save(log_path: Path, timeout: float = 15.0) -> None:
    """Until a periodic save (every second) has written what the daemon stored so far.

    A save logs only when it writes: once one has, a save that began after
    this call (2.5 s later, at the latest) had everything stored before it.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any('"disk_cache_saved"' in line for line in log_path.read_text(errors="replace").splitlines()):
            time.sleep(2.5)
            return
        time.sleep(0.2)
    raise AssertionError(f"no disk save within {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")
