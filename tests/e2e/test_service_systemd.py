"""The daemon under systemd's socket activation, for real, with Debian's systemd-socket-activate.

systemd-socket-activate listens on the socket path and execs the daemon at the
first connection with LISTEN_FDS=1 / LISTEN_PID and the socket on fd 3: what a
.socket unit does. A datagram socket bound as NOTIFY_SOCKET receives what the
daemon tells systemd (READY=1, STATUS=, WATCHDOG=1, STOPPING=1).
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefixd.client import Client

SOCKET_ACTIVATE = shutil.which("systemd-socket-activate")
pytestmark = pytest.mark.skipif(
    SOCKET_ACTIVATE is None,
    reason="systemd-socket-activate is not installed (Debian package 'systemd'; ./run installs it when run as root)",
)


class NotifyListener:
    """The service manager's end of sd_notify: collects datagrams in a thread."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            self.messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def wait_for(self, key: str, timeout: float = 60.0, matching: str = "") -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in list(self.messages):
                if key in message and matching in message[key]:
                    return message
            time.sleep(0.02)
        raise AssertionError(f"no {key}= ({matching!r}) within {timeout} s; received: {self.messages}")

    def count(self, key: str) -> int:
        return sum(key in message for message in list(self.messages))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def activated(tmp_path, tiny_llama_dir):
    """systemd-socket-activate holding the socket, ready to start the daemon on the first connection."""
    notify = NotifyListener(tmp_path / "notify.sock")
    socket_path = tmp_path / "prefixd.sock"
    log_path = tmp_path / "daemon.log"
    command = [
        SOCKET_ACTIVATE, "-l", str(socket_path),
        # systemd-socket-activate passes only HOME, PATH, TERM and what -E names.
        "-E", f"NOTIFY_SOCKET={notify.path}", "-E", "WATCHDOG_USEC=1000000",
        "-E", "HF_HUB_OFFLINE=1", "-E", "TRANSFORMERS_VERBOSITY=error", "-E", f"XDG_CONFIG_HOME={tmp_path}",
        sys.executable, "-m", "prefixd.daemon", "--model", str(tiny_llama_dir),
        "--log-format", "json", "--status-interval", "0.5",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while not socket_path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.02)
    try:
        yield proc, socket_path, notify, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def log_events(log_path: Path) -> list[dict]:
    events = []
    for line in log_path.read_text().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def test_socket_activation_readiness_status_watchdog_and_stop(activated):
    proc, socket_path, notify, log_path = activated
    time.sleep(0.3)
    assert notify.messages == []  # nothing runs until a client connects

    with Client(socket_path, timeout=60) as client:  # this connection starts the daemon
        assert client.ping()["pong"] is True
        result = client.generate(prompt="Hello there", max_tokens=4)
    assert result["usage"]["completion_tokens"] == 4

    ready = notify.wait_for("READY")
    assert ready["READY"] == "1" and ready["MAINPID"] == str(proc.pid)
    assert "serving llama" in ready["STATUS"]
    status = notify.wait_for("STATUS", matching="completed")
    assert "cache " in status["STATUS"] and "1 completed" in status["STATUS"]
    notify.wait_for("WATCHDOG")
    time.sleep(1.2)
    assert notify.count("WATCHDOG") >= 2  # every half WATCHDOG_USEC

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log_path.read_text()
    notify.wait_for("STOPPING", timeout=5)
    assert socket_path.exists()  # the service manager's socket: never removed by the daemon
    started = next(e for e in log_events(log_path) if e.get("event") == "daemon_started")
    assert started["activation"] == "systemd" and started["socket"] == str(socket_path)


def test_sigterm_lets_a_running_request_finish(activated):
    proc, socket_path, notify, log_path = activated
    with Client(socket_path, timeout=60) as client:
        with client.stream(prompt="Tell me a long story", max_tokens=120) as stream:
            chunks = iter(stream)
            first = next(chunks)
            proc.send_signal(signal.SIGTERM)
            notify.wait_for("STOPPING", timeout=10)
            text = first.get("text", "") + "".join(chunk.get("text", "") for chunk in chunks)
        result = stream.result
    assert result["finish_reason"] in ("length", "stop"), result
    assert result["text"] == text
    assert proc.wait(30) == 0, log_path.read_text()
