"""The wire protocol as docs/protocol.md states it, seen through plain msgpack and a socket.

No prefixd code sits between these tests and the bytes: what passes here is
what a client written in another language from the docs would see.
"""

from __future__ import annotations

import os
import time

import msgpack

from tests.e2e.daemon_process import NOTIFICATION, REQUEST, RESPONSE, RawConnection

CACHE_KEYS = {
    "prompt_tokens", "reused_tokens", "prefilled_tokens", "stored_tokens", "hit", "checkpoint", "age_s",
    "saved_ms_est", "source", "kv", "in_place_tokens", "miss_reason", "diverged_at", "diverged_message",
}
TIMING_KEYS = {"queue_ms", "encode_ms", "lookup_ms", "ttft_ms", "prefill_ms", "decode_ms", "total_ms", "decode_tokens_per_s"}
STORE_STAT_KEYS = {
    "num_nodes", "num_sequences", "num_bytes", "max_bytes", "pinned_bytes", "max_pinned_bytes", "num_hits",
    "num_partial_hits", "num_misses", "num_reused_tokens", "num_lookup_tokens", "num_evictions",
    "recent_hit_rate", "recent_reuse_ratio",
}


def test_ping_is_answered_with_the_documented_bytes_and_shape(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        conn.send_bytes(bytes.fromhex("94 00 01 a4 70 69 6e 67 91 80"))  # the worked example of docs/protocol.md
        first = conn.read()
        conn.send_bytes(bytes.fromhex("94 00 02 a4 70 69 6e 67 90"))  # params [] is as good as [{}]
        second = conn.read()
    for msgid, response in ((1, first), (2, second)):
        assert response[:3] == [RESPONSE, msgid, None]
        assert response[3]["pong"] is True
        assert abs(response[3]["time"] - time.time()) < 60


def test_hello_reports_protocol_models_and_limits(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        hello = conn.result("hello")
    assert hello["protocol_version"] == 1
    assert isinstance(hello["daemon_version"], str) and hello["daemon_version"]
    assert hello["models"] == ["llama", "lfm2"]
    assert hello["default_model"] == "llama"  # the first --model
    assert {"stream", "cancel", "prefix-cache", "messages", "tokens"} <= set(hello["capabilities"])
    assert hello["pid"] == shared_daemon.pid
    assert hello["max_message_bytes"] == 16 * 1024 * 1024


def test_models_describe_both_tiny_models(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        models = {model["name"]: model for model in conn.result("models")["models"]}
    assert set(models) == {"llama", "lfm2"}
    llama, lfm2 = models["llama"], models["lfm2"]
    assert llama["default"] is True and lfm2["default"] is False
    assert llama["hybrid"] is False and lfm2["hybrid"] is True  # lfm2 has conv layers
    assert llama["cache_layers"] == {"kvcache": 4, "rotating": 0, "arrays": 0, "other": 0}
    assert lfm2["cache_layers"]["arrays"] > 0 and lfm2["cache_layers"]["kvcache"] > 0
    for model in models.values():
        assert model["context_length"] == 8192
        assert os.path.isdir(model["path"])
        assert isinstance(model["fingerprint"], str) and model["fingerprint"]
        assert isinstance(model["dtype"], str)
    assert llama["fingerprint"] != lfm2["fingerprint"]


def test_tokenize_text_messages_and_tokens(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        text = conn.result("tokenize", {"prompt": "def add(a, b):\n    return a + b\n"})
        chat = conn.result("tokenize", {"messages": [{"role": "user", "content": "hi there"}], "model": "lfm2"})
        ids = conn.result("tokenize", {"tokens": text["tokens"]})
    assert text["model"] == "llama" and text["num_tokens"] == len(text["tokens"]) > 3
    assert all(type(token) is int for token in text["tokens"])
    assert text["text"] == "def add(a, b):\n    return a + b\n"
    assert chat["model"] == "lfm2"
    assert chat["text"] == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"  # the ChatML template
    assert ids["tokens"] == text["tokens"] and ids["text"] is None


def test_generate_result_has_the_documented_maps(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        msgid = conn.request("generate", {"prompt": "wire shapes: the quick brown fox", "max_tokens": 5, "session": "s-1"})
        chunks, response = conn.reply(msgid)
    assert chunks == []  # no stream asked for
    assert response[:3] == [RESPONSE, msgid, None]
    result = response[3]
    assert set(result) == {"model", "session", "text", "finish_reason", "usage", "cache", "timings"}
    assert result["model"] == "llama" and result["session"] == "s-1"
    assert isinstance(result["text"], str)
    assert result["finish_reason"] in ("length", "stop")
    usage = result["usage"]
    assert usage["prompt_tokens"] > 3 and 1 <= usage["completion_tokens"] <= 5
    if result["finish_reason"] == "length":
        assert usage["completion_tokens"] == 5
    cache = result["cache"]
    assert set(cache) == CACHE_KEYS
    assert cache["prompt_tokens"] == usage["prompt_tokens"]
    assert cache["prefilled_tokens"] == cache["prompt_tokens"] - cache["reused_tokens"]
    assert cache["hit"] in ("exact", "partial", "miss", "off")
    assert cache["source"] == ("memory" if cache["reused_tokens"] else None)
    assert set(result["timings"]) == TIMING_KEYS
    assert all(isinstance(value, float) for value in result["timings"].values())
    timings = result["timings"]
    assert 0 <= timings["queue_ms"] <= timings["ttft_ms"] <= timings["total_ms"]
    assert 0 < timings["encode_ms"] <= timings["queue_ms"]  # encoded on a worker thread before admission
    assert 0 <= timings["lookup_ms"] <= timings["prefill_ms"]


def test_a_stop_string_that_ends_the_answer_is_named_in_the_result(shared_daemon):
    params = {"prompt": "wire stops: the quick brown fox", "max_tokens": 12}
    with RawConnection(shared_daemon.socket_path) as conn:
        said = conn.reply(conn.request("generate", params))[1][3]["text"]  # greedy: the same text again below
        assert len(said) > 4 and "stop" not in conn.reply(conn.request("generate", {**params, "stop": ["\u0000"]}))[1][3]
        stop = said[2:4]
        result = conn.reply(conn.request("generate", {**params, "stop": ["\u0001", stop]}))[1][3]
    assert result["stop"] == stop and result["finish_reason"] == "stop"
    assert result["text"] == said[: said.find(stop)]


def test_streaming_sends_chunks_before_the_response_and_they_add_up(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        msgid = conn.request("generate", {"prompt": "stream me: once upon a time", "max_tokens": 24, "stream": True})
        arrived = []
        while not arrived or arrived[-1][0] != RESPONSE:
            arrived.append(conn.read())
    *notifications, response = arrived
    assert response[:3] == [RESPONSE, msgid, None]
    assert notifications, "no generate.chunk before the response"
    for notification in notifications:
        assert notification[0] == NOTIFICATION and notification[1] == "generate.chunk"
        assert len(notification[2]) == 1 and set(notification[2][0]) == {"id", "text", "tokens", "index"}
    chunks = [notification[2][0] for notification in notifications]
    assert [chunk["id"] for chunk in chunks] == [msgid] * len(chunks)
    assert [chunk["index"] for chunk in chunks] == list(range(len(chunks)))
    assert all(isinstance(token, int) for chunk in chunks for token in chunk["tokens"])
    result = response[3]
    assert "".join(chunk["text"] for chunk in chunks) == result["text"] != ""
    assert sum(len(chunk["tokens"]) for chunk in chunks) == result["usage"]["completion_tokens"]


def test_pipelined_requests_in_one_write_all_get_answers(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        conn.send(
            [REQUEST, 7, "generate", [{"prompt": "pipelined: a long answer", "max_tokens": 64}]],
            [REQUEST, 8, "ping", [{}]],
            [REQUEST, 9, "tokenize", [{"prompt": "pipelined"}]],
        )
        responses = [conn.read() for _ in range(3)]
    by_msgid = {response[1]: response for response in responses}
    assert set(by_msgid) == {7, 8, 9}
    assert all(response[0] == RESPONSE and response[2] is None for response in responses)
    assert by_msgid[7][3]["usage"]["completion_tokens"] >= 1
    assert by_msgid[8][3]["pong"] is True
    assert by_msgid[9][3]["num_tokens"] >= 1
    # Answers come as requests finish, not in order: the ping does not wait for the generation.
    assert [response[1] for response in responses].index(8) < [response[1] for response in responses].index(7)


def test_client_notifications_are_ignored(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        conn.send([NOTIFICATION, "nvim_error_event", [0, "x"]])
        conn.send([NOTIFICATION, "generate", [{"prompt": "a notification is not a request"}]],
                  [REQUEST, 3, "ping", [{}]])
        first = conn.read()
    assert first[:3] == [RESPONSE, 3, None]  # nothing came back for the notifications
    assert first[3]["pong"] is True


def test_chunks_of_two_streams_on_one_connection_carry_their_own_ids(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        first = conn.request("generate", {"prompt": "first stream", "max_tokens": 12, "stream": True})
        second = conn.request("generate", {"prompt": "second stream", "max_tokens": 12, "stream": True})
        first_chunks, first_response = conn.reply(first)
        second_chunks, second_response = conn.reply(second)
    assert "".join(chunk["text"] for chunk in first_chunks) == first_response[3]["text"]
    assert "".join(chunk["text"] for chunk in second_chunks) == second_response[3]["text"]
    assert first_chunks and second_chunks


def test_stats_has_request_counters_cache_and_model_maps(shared_daemon):
    with RawConnection(shared_daemon.socket_path) as conn:
        before = conn.result("stats")
        conn.result("generate", {"prompt": "stats shapes", "max_tokens": 2})
        after = conn.result("stats")
    assert isinstance(after["uptime_s"], float) and after["uptime_s"] >= before["uptime_s"]
    requests = after["requests"]
    assert {"completed", "cancelled", "failed", "active", "waiting", "prefilling", "decoding", "kv_reserved_bytes",
            "queued", "queued_per_client", "active_per_client"} <= set(requests)
    assert requests["completed"] == before["requests"]["completed"] + 1
    assert STORE_STAT_KEYS <= set(after["cache"]["total"])
    assert STORE_STAT_KEYS <= set(after["cache"]["per_model"]["llama"])
    assert "llama" in after["models"] and set(after["models"]) <= {"llama", "lfm2"}  # the loaded ones (lfm2 on demand)
    assert after["residency"]["resident_bytes"] == sum(m["weight_bytes"] for m in after["models"].values())
    assert after["process"]["peak_rss_bytes"] > 50 << 20  # MLX and the default model are loaded
    assert after["models"]["llama"]["prefill_tokens_per_s"] >= 0


def test_replies_use_msgpack_str_for_strings(shared_daemon):
    """Strings travel as msgpack str, so a strict client (raw=True) sees no bin-typed text."""
    with RawConnection(shared_daemon.socket_path) as conn:
        conn.request("hello", msgid=5)
        conn.sock.settimeout(30)
        unpacker = msgpack.Unpacker(raw=True)
        response = None
        while response is None:
            unpacker.feed(conn.sock.recv(1 << 16))
            response = next(iter(unpacker), None)
    assert response[0] == RESPONSE and response[1] == 5
    assert b"protocol_version" in response[3]  # keys decode as str-typed bytes, not bin
    assert isinstance(response[3][b"daemon_version"], bytes)
