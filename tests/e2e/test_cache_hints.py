"""Cache hints as an editor uses them (docs/editors.md, "Cache hints for editors"), on the msgpack socket.

cache.warm: prefill the context while the user types, so the request that
follows is a warm hit and says how much prefill time it saved.
cache.pin: keep a project's system prompt resident while other work churns
the cache.
"""

from __future__ import annotations

import pytest

from prefixd.client import Client
from tests.support.live_daemon import LiveDaemon

SYSTEM = {"role": "system", "content": "You are the coding assistant of project alpha. " + "Prefer small pure functions. " * 10}
FILE_CONTEXT = "".join(f"def helper_{i}(value):\n    return value * {i}\n\n" for i in range(12))


@pytest.fixture(scope="module")
def daemon(tiny_llama_dir, tmp_path_factory):
    with LiveDaemon(tiny_llama_dir, tmp_path_factory.mktemp("hints")) as live:
        yield live


def test_warm_then_generate_is_an_exact_hit_that_saved_time(daemon):
    messages = [SYSTEM, {"role": "user", "content": "Here is my file:\n" + FILE_CONTEXT + "\nWhat does helper_3 return?"}]
    with Client(daemon.socket_path, timeout=60) as client:
        warmed = client.cache_warm(messages=messages)  # while the user is still looking at the file
        reply = client.generate(messages=messages, max_tokens=8)
    assert warmed["cache"]["prefilled_tokens"] == warmed["cache"]["prompt_tokens"] > 100
    cache = reply["cache"]
    assert cache["hit"] == "exact"
    # The warm ran the prompt's last token too and kept its logits: the reply runs nothing before its first token.
    assert cache["reused_tokens"] == cache["prompt_tokens"] and cache["prefilled_tokens"] == 0
    assert cache["saved_ms_est"] > 0  # the prefill time the warm took off this request
    assert reply["timings"]["prefill_ms"] < warmed["timings"]["prefill_ms"]


def test_warm_while_typing_leaves_only_the_new_text_to_prefill(daemon):
    typed_so_far = FILE_CONTEXT + "def total(values):\n"
    with Client(daemon.socket_path, timeout=60) as client:
        warmed = client.cache_warm(prompt=typed_so_far)  # on an idle moment, before completion is asked
        reply = client.generate(prompt=typed_so_far + "    result = 0\n    for", max_tokens=4)  # typed on, then asked
    cache = reply["cache"]
    assert cache["reused_tokens"] >= warmed["cache"]["prompt_tokens"] - 2  # up to the last warmed token or so
    assert cache["prefilled_tokens"] <= cache["prompt_tokens"] - cache["reused_tokens"] and cache["prefilled_tokens"] < 15
    assert cache["saved_ms_est"] > 0


def test_pin_keeps_a_project_system_prompt_resident(tiny_llama_dir, tmp_path):
    other = {"role": "system", "content": "You are the assistant of project beta. " + "Prefer classes with invariants. " * 10}
    question = {"role": "user", "content": "How should I name this function?"}
    # A small store, so that unrelated work evicts what is not pinned.
    with LiveDaemon(tiny_llama_dir, tmp_path, ["--cache-bytes", "12M", "--pinned-bytes", "2M"]) as live, \
            Client(live.socket_path, timeout=60) as client:
        client.cache_warm(messages=[SYSTEM], add_generation_prompt=False)
        pinned = client.cache_pin(messages=[SYSTEM], add_generation_prompt=False)
        client.cache_warm(messages=[other], add_generation_prompt=False)  # warmed, not pinned
        for i in range(20):  # other files, other prompts: the store churns
            client.generate(prompt=f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(200)), max_tokens=2)
        assert client.stats()["cache"]["total"]["num_evictions"] > 0
        kept = client.generate(messages=[SYSTEM, question], max_tokens=4)["cache"]
        lost = client.generate(messages=[other, question], max_tokens=4)["cache"]
    assert pinned["pinned_tokens"] > 100
    assert kept["reused_tokens"] >= pinned["pinned_tokens"]  # the whole system message came from the cache
    assert kept["saved_ms_est"] > 0
    assert lost["reused_tokens"] < 20  # the unpinned one was evicted: only a few template tokens in common
