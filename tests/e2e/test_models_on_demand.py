"""Models on demand, through the real daemon and socket (two tiny models: llama 11.5 MB, lfm2 17.3 MB of weights).

- Only the first (default) model loads at start; another loads on its first request.
- ``keep_alive`` 0 unloads a model once its request is done; a short keep_alive unloads it when idle.
- The prefix store keeps an unloaded model's entries: the same prompt after a reload is an exact hit
  with the same greedy answer.
- ``--max-model-memory`` unloads the least recently used idle model to make room, never one serving a
  request: a request for another model waits until that request ends.
- A model that cannot load fails its request with MODEL_LOAD_FAILED; the daemon serves on.
"""

from __future__ import annotations

import shutil
import time

import pytest

from tests.e2e.daemon_process import RawConnection

MODEL_LOAD_FAILED = -32010
CHAT = [{"role": "system", "content": "You answer questions about caches in one line."},
        {"role": "user", "content": "What does a prefix cache keep between two turns of a chat?"}]


def residency(conn: RawConnection) -> dict[str, dict]:
    return {model["name"]: model for model in conn.result("models")["models"]}


def ask(conn: RawConnection, model: str, **extra) -> dict:
    return conn.result("generate", {"model": model, "messages": CHAT, "max_tokens": 8, **extra}, timeout=120)


def held_beyond_the_store(conn: RawConnection) -> int:
    """What MLX holds now besides the prefix store: the loaded weights (nothing runs between requests)."""
    stats = conn.result("stats")
    return stats["process"]["mlx_active_bytes"] - stats["cache"]["total"]["num_bytes"]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def test_load_on_first_use_keep_alive_zero_and_idle_unload_and_a_warm_reload(start_daemon, tiny_llama_dir, tiny_lfm2_dir):
    daemon = start_daemon(models=[tiny_llama_dir, tiny_lfm2_dir])
    with RawConnection(daemon.socket_path) as conn:
        models = residency(conn)
        assert models["llama"]["loaded"] and models["llama"]["resident_bytes"] > 0
        assert not models["lfm2"]["loaded"] and models["lfm2"]["resident_bytes"] == 0
        assert models["lfm2"]["weight_bytes"] > 0 and models["lfm2"]["loaded_at"] is None
        assert conn.result("stats")["residency"]["resident_bytes"] == models["llama"]["resident_bytes"]

        before = time.time()
        first = ask(conn, "lfm2")  # loads it
        models = residency(conn)
        assert models["lfm2"]["loaded"] and before <= models["lfm2"]["loaded_at"] <= time.time()
        assert models["lfm2"]["expires_at"] is None and models["lfm2"]["keep_alive"] == "forever"  # the daemon's default
        held_with_both = held_beyond_the_store(conn)

        again = ask(conn, "lfm2", keep_alive=0)  # unloaded as soon as it is done
        assert again["text"] == first["text"]
        assert not residency(conn)["lfm2"]["loaded"]
        stored = conn.result("stats")["cache"]["per_model"]["lfm2"]
        assert stored["num_bytes"] > 0  # the store kept its entries across the unload
        freed = held_with_both - held_beyond_the_store(conn)
        assert freed >= 0.95 * models["lfm2"]["resident_bytes"], f"{freed} bytes freed by unloading lfm2"

        reloaded = ask(conn, "lfm2")
        assert reloaded["cache"]["hit"] == "exact" and reloaded["cache"]["reused_tokens"] > 0
        assert reloaded["text"] == first["text"]
        assert residency(conn)["lfm2"]["loaded"]

        ask(conn, "llama", keep_alive="1s")
        llama = residency(conn)["llama"]
        assert llama["keep_alive"] == "1s" and llama["expires_at"] is not None
        assert llama["expires_at"] - time.time() <= 1.0
        wait_until(lambda: not residency(conn)["llama"]["loaded"], 10, "llama unloads after its 1 s keep_alive")
        assert residency(conn)["lfm2"]["loaded"]  # the other model's keep_alive is its own

        bad = conn.error("generate", {"model": "lfm2", "prompt": "x", "keep_alive": "soon"})
        assert bad["code"] == -32602 and "keep_alive" in bad["message"]
    unloads = daemon.events("model_unloaded")
    assert [(e["model"], e["reason"]) for e in unloads] == [("lfm2", "idle"), ("llama", "idle")]


def test_memory_limit_evicts_the_least_recently_used_idle_model_never_a_serving_one(start_daemon, tiny_llama_dir,
                                                                                    tiny_lfm2_dir):
    # 24 MiB holds either model (11.5 or 17.3 MB of weights), not both.
    daemon = start_daemon(models=[tiny_llama_dir, tiny_lfm2_dir], extra_args=["--max-model-memory", "24M"])
    with RawConnection(daemon.socket_path) as conn, RawConnection(daemon.socket_path) as other:
        long_one = conn.request("generate", {"model": "llama", "prompt": "count: one two three", "max_tokens": 8000,
                                             "stream": True})
        wait_until(lambda: conn.read(timeout=60) is not None, 60, "llama streams")  # its first chunk: it runs
        waiting = other.request("generate", {"model": "lfm2", "messages": CHAT, "max_tokens": 4})
        time.sleep(1.5)
        with RawConnection(daemon.socket_path) as watcher:
            models = residency(watcher)
            assert models["llama"]["loaded"] and models["llama"]["active_jobs"] == 1
            assert not models["lfm2"]["loaded"] and models["lfm2"]["active_jobs"] == 1
            assert watcher.result("stats")["residency"]["waiting_for_room"] == 1
        assert not [m for m in other.inbox if m[0] == 1 and m[1] == waiting], "lfm2 answered while llama served"
        conn.request("cancel", {"id": long_one})
        _, response = conn.reply(long_one, timeout=60)
        assert response[2] is None and response[3]["finish_reason"] == "cancelled"  # llama was never evicted under it
        _, response = other.reply(waiting, timeout=120)
        assert response[2] is None, response[2]
        models = residency(other)
        assert models["lfm2"]["loaded"] and not models["llama"]["loaded"]

        ask(other, "llama")  # lfm2 is idle now: the least recently used goes
        models = residency(other)
        assert models["llama"]["loaded"] and not models["lfm2"]["loaded"]
        assert other.result("stats")["residency"]["resident_bytes"] <= 24 << 20
    reasons = [(e["model"], e["reason"], e["for_model"]) for e in daemon.events("model_unloaded")]
    assert reasons == [("llama", "room", "lfm2"), ("lfm2", "room", "llama")]


def test_a_request_waiting_for_room_is_served_before_later_requests_for_the_busy_model(start_daemon, tiny_llama_dir,
                                                                                      tiny_lfm2_dir):
    # Without first come, first served across models, a stream of llama requests would keep llama
    # pinned and the lfm2 request waiting for as long as that stream lasts.
    daemon = start_daemon(models=[tiny_llama_dir, tiny_lfm2_dir], extra_args=["--max-model-memory", "24M"])
    with RawConnection(daemon.socket_path) as conn, RawConnection(daemon.socket_path) as other:
        long_one = conn.request("generate", {"model": "llama", "prompt": "count: one two three", "max_tokens": 8000,
                                             "stream": True})
        wait_until(lambda: conn.read(timeout=60) is not None, 60, "llama streams")
        waiting = other.request("generate", {"model": "lfm2", "messages": CHAT, "max_tokens": 4})
        with RawConnection(daemon.socket_path) as watcher, RawConnection(daemon.socket_path) as latecomer:
            wait_until(lambda: watcher.result("stats")["residency"]["waiting_for_room"] == 1, 30, "lfm2 waits for room")
            later = latecomer.request("generate", {"model": "llama", "messages": CHAT, "max_tokens": 4})
            with pytest.raises(TimeoutError):  # llama is loaded, but the later request waits behind lfm2's
                latecomer.read(timeout=1.5)
            conn.request("cancel", {"id": long_one})
            conn.reply(long_one, timeout=60)  # read: its reply must go out before llama is idle
            _, first = other.reply(waiting, timeout=120)
            _, second = latecomer.reply(later, timeout=120)
            assert first[2] is None and second[2] is None, (first[2], second[2])
    loads = [(e["model"], e["reason"]) for e in daemon.events("model_unloaded")]
    assert loads[:2] == [("llama", "room"), ("lfm2", "room")]  # lfm2 in its turn, then llama back for the later one


def test_a_model_that_cannot_load_fails_its_request_and_the_daemon_serves_on(start_daemon, tiny_llama_dir,
                                                                            tiny_lfm2_dir, tmp_path):
    vanishing = tmp_path / "vanishing"
    shutil.copytree(tiny_llama_dir, vanishing)
    # 16 MiB: llama (11.5 MB) or its copy fits, lfm2 (17.3 MB) never does.
    daemon = start_daemon(models=[tiny_llama_dir, vanishing, tiny_lfm2_dir], extra_args=["--max-model-memory", "16M"])
    (vanishing / "model.safetensors").unlink()  # after start: described, but its weights are gone
    with RawConnection(daemon.socket_path) as conn:
        too_large = conn.error("generate", {"model": "lfm2", "prompt": "hello", "max_tokens": 2})
        assert too_large["code"] == MODEL_LOAD_FAILED and "--max-model-memory" in too_large["message"]
        gone = conn.error("generate", {"model": "vanishing", "prompt": "hello", "max_tokens": 2})
        assert gone["code"] == MODEL_LOAD_FAILED and "vanishing" in gone["message"]
        assert not residency(conn)["vanishing"]["loaded"]
        assert ask(conn, "llama")["usage"]["completion_tokens"] > 0  # loads again (it made room for the copy)


def test_a_models_dir_serves_every_model_in_it_on_demand(start_daemon, tiny_llama_dir, tiny_lfm2_dir, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "llama").symlink_to(tiny_llama_dir)
    (folder / "lfm2").symlink_to(tiny_lfm2_dir)
    (folder / "notes").mkdir()  # not a model directory: passed over
    unservable = folder / "unknown-arch"
    shutil.copytree(tiny_llama_dir, unservable)
    config = (unservable / "config.json").read_text().replace('"llama"', '"no_such_architecture"')
    (unservable / "config.json").write_text(config)
    daemon = start_daemon(models=[tiny_lfm2_dir], extra_args=["--models-dir", str(folder)])
    with RawConnection(daemon.socket_path) as conn:
        models = residency(conn)
        assert list(models) == ["lfm2", "llama"]  # --model first (the default); the folder's lfm2 is the same model
        assert models["lfm2"]["default"] and models["lfm2"]["loaded"] and not models["llama"]["loaded"]
        assert ask(conn, "llama")["usage"]["completion_tokens"] > 0
        assert residency(conn)["llama"]["loaded"]
    (skipped,) = daemon.events("model_skipped")
    assert skipped["path"].endswith("unknown-arch") and "no_such_architecture" in skipped["error"]


def test_with_warm_up_on_both_loads_warm_up_and_store_nothing_of_their_own(start_daemon, tiny_llama_dir, tiny_lfm2_dir):
    """``--warm-up on`` (the default on a GPU only): the start's whole load and a request's load in steps both
    fork made-up prefixes before serving, the store holds none of it, and the answers are the same as without."""
    plain = start_daemon(models=[tiny_llama_dir, tiny_lfm2_dir], extra_args=["--warm-up", "off"])
    with RawConnection(plain.socket_path) as conn:
        expected = {model: ask(conn, model)["text"] for model in ("llama", "lfm2")}
    assert plain.wait_for_event("model_loaded", model="llama")["warm_up_s"] is None
    plain.stop()

    daemon = start_daemon(models=[tiny_llama_dir, tiny_lfm2_dir], extra_args=["--warm-up", "on"])
    assert daemon.wait_for_event("model_loaded", model="llama")["warm_up_s"] > 0
    with RawConnection(daemon.socket_path) as conn:
        assert conn.result("stats")["cache"]["total"]["num_bytes"] == 0
        for model in ("llama", "lfm2"):  # lfm2 loads in steps, its warm-up among them
            first = ask(conn, model)
            assert first["cache"]["hit"] == "miss" and first["cache"]["reused_tokens"] == 0
            assert first["text"] == expected[model]
            assert ask(conn, model)["cache"]["hit"] == "exact"
    assert daemon.wait_for_event("model_loaded", model="lfm2")["warm_up_s"] > 0


def test_a_failed_warm_up_is_logged_and_the_model_serves_without_it(start_daemon, tiny_llama_dir, tiny_lfm2_dir):
    daemon = start_daemon(models=[tiny_llama_dir, tiny_lfm2_dir], extra_args=["--warm-up", "on"],
                          env={"PREFIXD_FAULTS": "warm_up:*"})
    with RawConnection(daemon.socket_path) as conn:
        for model in ("llama", "lfm2"):  # a whole load at start, a load in steps on first use
            assert ask(conn, model)["usage"]["completion_tokens"] > 0
            assert ask(conn, model)["cache"]["hit"] == "exact"
    for model in ("llama", "lfm2"):
        assert daemon.wait_for_event("warm_up_failed", model=model)["action"] == "serving without it"
        assert daemon.wait_for_event("model_loaded", model=model)["warm_up_s"] is None
