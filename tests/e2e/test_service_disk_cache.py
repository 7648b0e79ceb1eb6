"""The prefix cache survives restarts: the real daemon, stopped (SIGTERM or kill -9) and started again."""

from __future__ import annotations

import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from prefixd.daemon.front.handlers import Handlers
from prefixd.daemon.persist.format import encode_entry, entry_id, read_header, read_payload, token_digest
from prefixd.daemon.service.server import DaemonServer
from tests.support.live_daemon import LiveDaemon

PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))


@contextmanager
def running(model_dir: Path, workdir: Path, cache_dir: Path) -> Iterator[LiveDaemon]:
    """A daemon with the disk cache on, once it has read what the disk holds."""
    daemon = LiveDaemon(
        model_dir, workdir,
        ["--disk-cache-bytes", "256M", "--cache-dir", str(cache_dir), "--disk-save-interval", "1"],
        env={"XDG_CONFIG_HOME": str(workdir / "no-config")},
    )
    with daemon:
        wait_for(daemon, "disk_cache_loaded")
        yield daemon


def wait_for(daemon: LiveDaemon, event: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events := daemon.log_events(event):
            return events[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {event} within {timeout} s:\n{daemon.log_text()}")


def ask(daemon: LiveDaemon) -> dict:
    return daemon.call("generate", {"prompt": PROMPT, "max_tokens": 8})


def test_a_restart_after_sigterm_reuses_the_prompt_from_disk(tiny_llama_dir, tmp_path):
    cache_dir = tmp_path / "kv"
    with running(tiny_llama_dir, tmp_path / "run1", cache_dir) as first:
        cold = ask(first)
    assert cold["cache"]["hit"] == "miss" and cold["cache"]["reused_tokens"] == 0
    assert list(cache_dir.glob("*/*.kv"))  # written at shutdown

    with running(tiny_llama_dir, tmp_path / "run2", cache_dir) as second:
        assert wait_for(second, "disk_cache_loaded")["imported"] > 0
        warm = ask(second)
    prompt_tokens = warm["cache"]["prompt_tokens"]
    assert warm["cache"]["hit"] == "exact" and warm["cache"]["reused_tokens"] == prompt_tokens - 1
    assert warm["text"] == cold["text"]  # the same greedy tokens


def test_kill_9_keeps_what_the_last_periodic_save_wrote(tiny_llama_dir, tmp_path):
    cache_dir = tmp_path / "kv"
    with running(tiny_llama_dir, tmp_path / "run1", cache_dir) as first:
        cold = ask(first)
        num_nodes = first.call("stats")["cache"]["total"]["num_nodes"]
        # A save may have run while the prompt was being prefilled: wait for one that has it all.
        deadline = time.monotonic() + 30
        while not any(e["kept"] == num_nodes for e in first.log_events("disk_cache_saved")):
            assert time.monotonic() < deadline, f"no save of all {num_nodes} entries:\n{first.log_tail()}"
            time.sleep(0.05)
        first.proc.kill()  # no shutdown save: only the periodic one counts
        first.proc.wait()
    with running(tiny_llama_dir, tmp_path / "run2", cache_dir) as second:
        warm = ask(second)
    assert warm["cache"]["hit"] == "exact" and warm["text"] == cold["text"], (cold["cache"], warm["cache"])


def test_corrupted_files_are_a_miss_and_one_log_line_each(tiny_llama_dir, tmp_path):
    cache_dir = tmp_path / "kv"
    with running(tiny_llama_dir, tmp_path / "run1", cache_dir) as first:
        cold = ask(first)
    files = sorted(cache_dir.glob("*/*.kv"))
    for index, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if index % 2:
            data = data[: len(data) * 2 // 3]  # truncated
        else:
            data[len(data) // 2] ^= 0x40  # a flipped bit
        path.write_bytes(bytes(data))

    with running(tiny_llama_dir, tmp_path / "run2", cache_dir) as second:
        again = ask(second)
        skipped = second.log_events("disk_cache_entry_skipped")
    assert again["cache"]["hit"] == "miss" and again["cache"]["reused_tokens"] == 0
    assert again["text"] == cold["text"]
    assert sorted(Path(e["file"]) for e in skipped) == files  # one line per bad file, no more


def test_the_reply_says_the_prefix_came_from_disk(tiny_llama_dir, tmp_path):
    cache_dir = tmp_path / "kv"
    with running(tiny_llama_dir, tmp_path / "run1", cache_dir) as first:
        ask(first)
    with running(tiny_llama_dir, tmp_path / "run2", cache_dir) as second:
        assert ask(second)["cache"]["source"] == "disk"
        assert ask(second)["cache"]["source"] == "disk"  # still the disk's KV, now resident


def filler_entries(cache_dir: Path, num_fillers: int, avoid_first_token: int) -> int:
    """Root-edge entries of other prompts beside the stored ones; returns the bytes written.

    Each reuses the payload of the stored prompt's first entry under other
    tokens (valid files: the load imports every one), and sorts with it in the
    load's order (start 0, the same length), so the load has all of them to
    read, verify and import before it reaches the prompt's deeper entries.
    """
    first = min((read_header(path) for path in cache_dir.glob("*/*.kv")), key=lambda h: (h.start, h.depth))
    payload = read_payload(first)
    rng = random.Random(7)
    root_sha = token_digest(()).hexdigest()
    written = 0
    for _ in range(num_fillers):
        key = [rng.randrange(3, 2000) for _ in first.key]
        key[0] = avoid_first_token + 1 + rng.randrange(1000) if key[0] == avoid_first_token else key[0]
        first.key, first.start_sha, first.kind = key, root_sha, "chunk"
        depth_sha = token_digest(key).hexdigest()
        path = first.path.parent / f"{entry_id(first.fingerprint, depth_sha, 0, 'chunk', False)}.kv"
        data = encode_entry(first, payload)
        path.write_bytes(data)
        written += len(data)
    return written


def wired_to_prefetch() -> bool:
    """Whether the daemon calls Persistence.prefetch before queueing a request (Handlers.prefetch, set by the server)."""
    return "prefetch" in Handlers.__init__.__code__.co_names and "prefetch" in DaemonServer.run.__code__.co_names


@pytest.mark.skipif(not wired_to_prefetch(), reason="the daemon does not call Persistence.prefetch yet: "
                    "Handlers.prefetch must exist and daemon/service/server.py must set it when the disk cache is on")
def test_a_stored_prompt_sent_right_after_a_restart_is_warm_from_disk(tiny_llama_dir, tmp_path):
    cache_dir = tmp_path / "kv"
    with running(tiny_llama_dir, tmp_path / "run1", cache_dir) as first:
        cold = ask(first)
        prompt_first_token = first.call("tokenize", {"prompt": PROMPT})["tokens"][0]
    filler_bytes = filler_entries(cache_dir, num_fillers=120, avoid_first_token=prompt_first_token)
    num_files = len(list(cache_dir.glob("*/*.kv")))

    daemon = LiveDaemon(
        tiny_llama_dir, tmp_path / "run2",
        ["--disk-cache-bytes", "2G", "--cache-dir", str(cache_dir), "--disk-save-interval", "3600"],
        env={"XDG_CONFIG_HOME": str(tmp_path / "no-config")},
    )
    with daemon:  # returns once it answers ping: the load has only just begun
        warm = ask(daemon)
        loaded = wait_for(daemon, "disk_cache_loaded")
        order = [e["event"] for e in daemon.log_events() if e["event"] in ("generate", "disk_cache_loaded")]
    assert order == ["generate", "disk_cache_loaded"], (
        f"the load ({filler_bytes >> 20} MiB) was over before the request: this proves nothing", loaded)
    prompt_tokens = warm["cache"]["prompt_tokens"]
    assert warm["cache"]["source"] == "disk", warm["cache"]
    assert warm["cache"]["hit"] == "exact" and warm["cache"]["reused_tokens"] == prompt_tokens - 1, warm["cache"]
    assert warm["text"] == cold["text"]
    assert (loaded["imported"], loaded["skipped"], loaded["orphans"]) == (num_files, 0, 0)  # each counted once
