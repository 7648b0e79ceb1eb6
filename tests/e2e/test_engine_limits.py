"""Limits a user relies on, through a real daemon: memory, sampling, queue places, prompt size.

- ``--cache-bytes`` bounds the prefix store and the running sequences' KV
  together, at every moment, and what MLX holds after the requests is the
  weights and the store (no batch kept alive by a stored snapshot).
- A seed gives the same text whatever runs beside it; a temperature too small
  to divide by is greedy; ``max_tokens`` is cut to what the context holds.
- Cancelled requests give their queue places back at once.
- A prompt that cannot fit is refused before it is tokenized, and a chat of
  many messages is encoded off the engine thread.
"""

from __future__ import annotations

import threading
import time

from tests.e2e.daemon_process import RawConnection

OVERLOADED, CANCELLED, PROMPT_TOO_LONG = -32003, -32004, -32002
MIB = 1 << 20


def long_prompt(tag: str, num_words: int = 300) -> str:
    return f"{tag}: " + " ".join(f"{tag}{i % 37} word{i}" for i in range(num_words))


def test_store_and_running_kv_stay_within_cache_bytes(start_daemon, tiny_lfm2_dir):
    budget = 6 * MIB
    daemon = start_daemon(models=[tiny_lfm2_dir], extra_args=["--cache-bytes", str(budget), "--prefill-chunk", "64"])
    samples: list[int] = []
    done = threading.Event()

    def watch() -> None:
        with RawConnection(daemon.socket_path) as conn:
            while not done.is_set():
                stats = conn.result("stats")
                samples.append(stats["cache"]["total"]["num_bytes"] + stats["requests"]["kv_reserved_bytes"])

    def ask(index: int) -> None:
        with RawConnection(daemon.socket_path, timeout=120) as conn:
            conn.result("generate", {"prompt": long_prompt(f"s{index}"), "max_tokens": 12}, timeout=120)

    watcher = threading.Thread(target=watch)
    watcher.start()
    askers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in askers:
        thread.start()
    for thread in askers:
        thread.join(180)
    done.set()
    watcher.join(30)
    assert samples and max(samples) <= budget, f"store + reserved KV reached {max(samples)} > {budget}"
    with RawConnection(daemon.socket_path) as conn:
        stats = conn.result("stats")
    held = stats["process"]["mlx_active_bytes"] - stats["models"]["lfm2"]["weight_bytes"]
    stored = stats["cache"]["total"]["num_bytes"]
    assert stored > 0
    # Nothing runs now: MLX holds the weights and the store (and a little change), no finished batch.
    assert held <= stored + 2 * MIB, f"MLX holds {held} bytes beyond the weights; the store {stored}"


def test_a_seed_gives_the_same_text_whatever_runs_beside_it(shared_daemon):
    seeded = {"prompt": "a seeded story about rivers", "max_tokens": 16, "temperature": 1.0, "seed": 7,
              "cache": {"use": False, "store": False}}
    with RawConnection(shared_daemon.socket_path) as conn, RawConnection(shared_daemon.socket_path) as other:
        alone = conn.result("generate", seeded)["text"]
        neighbours = [other.request("generate", {"prompt": f"an unseeded neighbour {i}", "max_tokens": 16,
                                                 "temperature": 1.0}) for i in range(2)]
        together = conn.result("generate", seeded)["text"]
        for msgid in neighbours:
            assert other.reply(msgid)[1][2] is None
    assert together == alone


def test_a_temperature_too_small_to_divide_by_is_greedy(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        base = {"prompt": "the temperature question", "max_tokens": 12, "cache": {"use": False, "store": False}}
        greedy = conn.result("generate", base)["text"]
        tiny = conn.result("generate", {**base, "temperature": 1e-300})["text"]
    assert tiny == greedy


def test_max_tokens_is_cut_to_what_the_context_holds(start_daemon):
    # 2**20 new tokens would need far more KV than this budget; the context (8192) needs far less.
    daemon = start_daemon(extra_args=["--cache-bytes", str(512 * MIB)])
    with RawConnection(daemon.socket_path) as conn:
        msgid = conn.request("generate", {"prompt": "count forever", "max_tokens": 1 << 20, "stream": True})
        first = conn.read()
        assert first[0] == 2, f"expected a stream chunk, got {first}"  # admitted, not OVERLOADED
        reserved = conn.result("stats")["requests"]["kv_reserved_bytes"]
        assert conn.result("cancel", {"id": msgid}) == {"cancelled": True}
        _, response = conn.reply(msgid)
    assert response[3]["finish_reason"] == "cancelled"
    assert 0 < reserved < 512 * MIB


def test_cancelled_requests_give_their_queue_places_back(start_daemon):
    daemon = start_daemon(extra_args=["--max-active", "1", "--max-queued-per-client", "2"])
    with RawConnection(daemon.socket_path) as conn:
        running = conn.request("generate", {"prompt": "holds the only slot", "max_tokens": 4000, "stream": True})
        assert conn.read()[0] == 2  # it is running
        queued = [conn.request("generate", {"prompt": f"queued {i}", "max_tokens": 2}) for i in range(2)]
        for msgid in queued:
            assert conn.result("cancel", {"id": msgid}) == {"cancelled": True}
        for msgid in queued:
            assert conn.reply(msgid)[1][2]["code"] == CANCELLED
        again = [conn.request("generate", {"prompt": f"queued again {i}", "max_tokens": 2}) for i in range(2)]
        assert conn.result("stats")["requests"]["queued"] == 2  # both accepted: the cancelled ones left
        conn.result("cancel", {"id": running})
        for msgid in again:
            assert conn.reply(msgid)[1][2] is None


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(shared_daemon):
    huge = "x" * (15 << 20)  # 15 MiB of text: far more tokens than any context here
    with RawConnection(shared_daemon.socket_path, timeout=60) as conn:
        started = time.monotonic()
        error = conn.error("generate", {"prompt": huge, "max_tokens": 1})
        refused_after = time.monotonic() - started
        assert conn.result("ping")["pong"] is True
    assert error["code"] == PROMPT_TOO_LONG and "at least" in error["message"]
    assert error["data"]["context_length"] > 0
    print(f"15 MiB prompt refused after {refused_after:.2f} s")


def test_a_chat_of_a_thousand_messages_is_answered_and_others_are_served_meanwhile(shared_daemon):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": ""} for i in range(999)]
    messages.append({"role": "user", "content": "and now, a real question"})
    with RawConnection(shared_daemon.socket_path, timeout=120) as chat, \
            RawConnection(shared_daemon.socket_path) as bystander:
        expected = bystander.result("generate", {"prompt": "the bystander", "max_tokens": 6,
                                                 "cache": {"use": False, "store": False}})["text"]
        msgid = chat.request("generate", {"messages": messages, "max_tokens": 2})
        text = bystander.result("generate", {"prompt": "the bystander", "max_tokens": 6,
                                             "cache": {"use": False, "store": False}})["text"]
        _, response = chat.reply(msgid)
    assert text == expected
    if response[2] is not None:
        assert response[2]["code"] == PROMPT_TOO_LONG
    else:
        cache = response[3]["cache"]
        assert cache["prompt_tokens"] > 1000
