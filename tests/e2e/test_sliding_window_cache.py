"""Sliding-window models (Gemma 3's RotatingKVCache layers) reuse the prefix store exactly, through the daemon.

The tiny gemma3 slides a window of 32 positions on four of its six layers.
Prompts of 1.5-3x the window, fed in passes shorter and longer than the
window (--prefill-chunk 24 and the CPU default 512), give greedy answers
identical to uncached runs: exact repeats, partial hits at any depth, a
warmed prefix, the next turns of a chat, answers longer than the window,
sessions decoded together in one batch. Each reply's cache map shows the reuse.
"""

from __future__ import annotations

import threading

import pytest

from prefixd.client.sync_client import Client
from tests.support.tiny_models import TINY_WINDOW

W = TINY_WINDOW
SOURCE_TEXT = __import__("inspect").getsource(__import__("textwrap"))


@pytest.fixture(scope="module", params=[24, 512], ids=["chunk24", "chunk512"])
def daemon(request, tiny_gemma3_dir, tmp_path_factory):
    from tests.e2e.daemon_process import DaemonProcess

    process = DaemonProcess([tiny_gemma3_dir], tmp_path_factory.mktemp("gemma3"), ["--prefill-chunk", str(request.param)])
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def source_tokens(daemon):
    with Client(daemon.socket_path, timeout=60) as client:
        tokens = client.tokenize(prompt=SOURCE_TEXT)["tokens"]
    assert len(tokens) > 2000
    return tokens


def generate(client, tokens=None, max_tokens=12, cache=True, **options):
    return client.generate(tokens=list(tokens) if tokens is not None else None, max_tokens=max_tokens,
                           temperature=0, cache=cache, **options)


def test_models_describe_the_sliding_window_layers(daemon):
    with Client(daemon.socket_path, timeout=60) as client:
        (model,) = client.models()["models"]
    assert model["cache_layers"] == {"kvcache": 2, "rotating": 4, "arrays": 0, "other": 0}
    assert model["hybrid"] is False


@pytest.mark.parametrize("length", [3 * W // 2, 2 * W, 3 * W])
def test_exact_repeat_is_a_hit_with_the_uncached_answer(daemon, source_tokens, length):
    tokens = source_tokens[100 + length : 100 + 2 * length]  # a prompt of its own per length
    with Client(daemon.socket_path, timeout=120) as client:
        cold = generate(client, tokens, cache=False)
        first = generate(client, tokens)
        repeat = generate(client, tokens, cache={"verify": True})
    assert first["text"] == cold["text"] == repeat["text"]
    assert first["cache"]["reused_tokens"] == 0 and first["cache"]["stored_tokens"] > 0
    cache = repeat["cache"]
    # The first request stored its last token and the logits it gave: the repeat runs nothing before its first token.
    assert cache["hit"] == "exact" and cache["reused_tokens"] == length and cache["prefilled_tokens"] == 0
    assert repeat["verify"]["status"] == "match", repeat["verify"]


def test_partial_hits_at_any_depth_match_uncached_runs(daemon, source_tokens):
    stored = source_tokens[600 : 600 + 3 * W]
    tail = source_tokens[900:920]
    with Client(daemon.socket_path, timeout=120) as client:
        client.cache_warm(tokens=stored)
        for split in (5, W - 1, W, W + 1, W + 15, 2 * W + 7, 3 * W - 2):
            prompt = stored[:split] + tail  # shares exactly `split` tokens with what is stored
            cached = generate(client, prompt, cache={"store": False})
            plain = generate(client, prompt, cache=False)
            assert cached["text"] == plain["text"], split
            assert cached["cache"]["reused_tokens"] == split, (split, cached["cache"])


def test_a_warmed_prefix_is_a_checkpoint_the_longer_prompt_resumes_from(daemon, source_tokens):
    prefix = source_tokens[1000 : 1000 + 2 * W + 5]
    prompt = prefix + source_tokens[1200 : 1200 + W]  # 2.8x the window
    with Client(daemon.socket_path, timeout=120) as client:
        warmed = client.cache_warm(tokens=prefix)
        cached = generate(client, prompt, cache={"verify": True})
        plain = generate(client, prompt, cache=False)
    assert warmed["cache"]["stored_tokens"] > 0
    cache = cached["cache"]
    assert cache["reused_tokens"] >= len(prefix) - 1 and cache["checkpoint"] is not None, cache
    assert cached["text"] == plain["text"] and cached["verify"]["status"] == "match"


def test_a_chat_reuses_every_turn_and_matches_uncached(daemon):
    messages = [{"role": "system", "content": SOURCE_TEXT[2000:2400]}]
    with Client(daemon.socket_path, timeout=120) as client:
        previous_prompt = 0
        for turn, answer_tokens in enumerate([10, 12, 2 * W, 10]):  # the third answer is longer than the window
            messages.append({"role": "user", "content": f"Question {turn}: what does line {turn * 7} do?"})
            cached = client.generate(messages=messages, max_tokens=answer_tokens, temperature=0)
            plain = client.generate(messages=messages, max_tokens=answer_tokens, temperature=0, cache=False)
            assert cached["text"] == plain["text"], turn
            cache = cached["cache"]
            assert cache["prompt_tokens"] > 3 * W // 2
            if turn > 0:  # the previous prompt and the previous answer (even the one longer than the window)
                assert cache["reused_tokens"] >= previous_prompt - 1, (turn, cache)
            if answer_tokens > W:  # decoded alone, the answer longer than the window was stored whole
                assert cached["usage"]["completion_tokens"] == answer_tokens
                assert cache["stored_tokens"] >= cache["prefilled_tokens"] + answer_tokens - 2, cache
            previous_prompt = cache["prompt_tokens"]
            messages.append({"role": "assistant", "content": cached["text"]})


def test_answers_longer_than_the_window_match_and_their_prompts_stay_reusable(daemon, source_tokens):
    prompt = source_tokens[1400 : 1400 + 2 * W]
    with Client(daemon.socket_path, timeout=120) as client:
        cold = generate(client, prompt, max_tokens=3 * W, cache=False)
        first = generate(client, prompt, max_tokens=3 * W)
        repeat = generate(client, prompt, max_tokens=3 * W)
        extended = generate(client, prompt + source_tokens[1500:1510], max_tokens=3 * W)
        reference = generate(client, prompt + source_tokens[1500:1510], max_tokens=3 * W, cache=False)
    assert first["text"] == cold["text"] == repeat["text"]
    assert first["usage"]["completion_tokens"] == 3 * W  # no end token: the answer outgrew the window twice
    # Decoded alone (the solo path), the answer was kept whole beside its window and stored with the prompt.
    assert first["cache"]["stored_tokens"] >= len(prompt) - 1 + 3 * W - 1, first["cache"]
    assert repeat["cache"]["hit"] == "exact" and repeat["cache"]["reused_tokens"] == len(prompt)
    assert extended["text"] == reference["text"] and extended["cache"]["reused_tokens"] >= len(prompt) - 1


def test_short_answers_are_stored_and_the_next_prompt_reuses_them(daemon, source_tokens):
    prompt = source_tokens[1600 : 1600 + 2 * W]
    with Client(daemon.socket_path, timeout=120) as client:
        first = generate(client, prompt, max_tokens=W // 2, cache={"store": True})
        answer = client.tokenize(prompt=first["text"])["tokens"]
        follow = prompt + answer + source_tokens[1700:1710]
        cached = generate(client, follow)
        plain = generate(client, follow, cache=False)
    assert cached["text"] == plain["text"]
    # The answer was stored with the prompt (it fit the window), so the reuse runs past the prompt's end
    # when the answer's text tokenizes back to the same ids.
    if follow[: len(prompt) + len(answer)] == prompt + answer[: len(follow) - len(prompt)]:
        assert cached["cache"]["reused_tokens"] > len(prompt), cached["cache"]


def test_sessions_decoded_together_match_solo_uncached_runs(daemon, source_tokens):
    system = source_tokens[1800 : 1800 + 2 * W]  # shared by every session
    prompts = [system + source_tokens[1900 + 13 * n : 1910 + 13 * n] for n in range(3)]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def session(n: int) -> None:
        try:
            with Client(daemon.socket_path, timeout=180) as client:
                results[n] = generate(client, prompts[n], max_tokens=W + 8)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with Client(daemon.socket_path, timeout=180) as client:
        client.cache_warm(tokens=system)
        threads = [threading.Thread(target=session, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not errors, errors
        solo = [generate(client, p, max_tokens=W + 8, cache=False) for p in prompts]
        stats = client.stats()
    for n in range(3):
        assert results[n]["text"] == solo[n]["text"], n
        assert results[n]["cache"]["reused_tokens"] >= len(system) - 1, results[n]["cache"]
    assert stats  # the daemon is still well after the batch


def test_answers_decoded_together_past_the_window_are_stored_whole(daemon, source_tokens):
    """Two sessions (fewer than the scheduler hands over as batched tails): each row keeps its record in the batch."""
    prompts = [source_tokens[2100 + 70 * n : 2100 + 70 * n + 2 * W] for n in range(2)]
    results: dict[int, dict] = {}

    def session(n: int) -> None:
        with Client(daemon.socket_path, timeout=180) as client:
            results[n] = generate(client, prompts[n], max_tokens=2 * W)

    threads = [threading.Thread(target=session, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    with Client(daemon.socket_path, timeout=180) as client:
        solo = [generate(client, p, max_tokens=2 * W, cache=False) for p in prompts]
    for n in range(2):
        cache, usage = results[n]["cache"], results[n]["usage"]
        assert results[n]["text"] == solo[n]["text"] and usage["completion_tokens"] == 2 * W
        assert cache["stored_tokens"] >= cache["prefilled_tokens"] + 2 * W - 2, cache


def test_window_layers_round_trip_through_the_disk_cache(tiny_gemma3_dir, tmp_path):
    """Stored with every position, window layers are plain KV in the entry files: a restart reuses them exactly."""
    from tests.e2e.test_service_disk_cache import PROMPT, running

    cache_dir = tmp_path / "kv"
    partial = PROMPT[: len(PROMPT) // 2] + " and then something else entirely, at a depth of its own."
    with running(tiny_gemma3_dir, tmp_path / "run1", cache_dir) as first:
        cold = first.call("generate", {"prompt": PROMPT, "max_tokens": 12})
        cold_partial = first.call("generate", {"prompt": partial, "max_tokens": 12, "cache": {"use": False, "store": False}})
    assert cold["cache"]["prompt_tokens"] > 3 * W and list(cache_dir.glob("*/*.kv"))
    with running(tiny_gemma3_dir, tmp_path / "run2", cache_dir) as second:
        warm = second.call("generate", {"prompt": PROMPT, "max_tokens": 12})
        warm_partial = second.call("generate", {"prompt": partial, "max_tokens": 12})
    assert warm["cache"]["hit"] == "exact" and warm["cache"]["source"] == "disk"
    assert warm["cache"]["reused_tokens"] == warm["cache"]["prompt_tokens"] - 1 and warm["text"] == cold["text"]
    assert warm_partial["cache"]["reused_tokens"] > 3 * W and warm_partial["text"] == cold_partial["text"]
