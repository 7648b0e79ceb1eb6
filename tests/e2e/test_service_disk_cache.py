"""The prefix cache survives restarts: the real daemon, stopped (SIGTERM or kill -9) and started again."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
