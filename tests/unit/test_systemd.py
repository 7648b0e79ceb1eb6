"""systemd's protocols without systemd: socket activation (LISTEN_*) and sd_notify datagrams."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prefixd.daemon.service import systemd
from prefixd.daemon.service.socket_activation import InheritedSocketError, adopt_listening_socket
from prefixd.daemon.service.server import status_line

REPO = Path(__file__).resolve().parents[2]

# Runs in a child process, because socket activation puts the socket on fd 3.
_CHILD = """
import fcntl, json, os, socket, sys
from prefixd.daemon.service import systemd
from prefixd.daemon.service.socket_activation import take_inherited_socket
path, listen_pid, names = sys.argv[1], sys.argv[2], sys.argv[3]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen()
if server.fileno() == 3:
    os.set_inheritable(server.detach(), True)  # as systemd passes it: not close-on-exec
else:
    os.dup2(server.fileno(), 3)  # an inheritable copy
    server.close()
os.environ.update(LISTEN_PID=str(os.getpid()) if listen_pid == "self" else listen_pid, LISTEN_FDS="1")
if names:
    os.environ["LISTEN_FDNAMES"] = names
if sys.argv[4] == "take":
    taken = take_inherited_socket()
    result = None if taken is None else {"origin": taken[1], "name": taken[0].getsockname(), "fd": taken[0].fileno(),
                                          "inheritable": taken[0].get_inheritable()}
else:
    result = [list(item) for item in systemd.listen_fds_with_names()]
cloexec = bool(fcntl.fcntl(3, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
left = sorted(k for k in os.environ if k.startswith("LISTEN_"))
print(json.dumps({"result": result, "cloexec": cloexec, "env_left": left}))
"""


def run_child(tmp_path: Path, listen_pid: str = "self", names: str = "", mode: str = "fds") -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "s.sock"), listen_pid, names, mode],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_listen_fds_takes_fd_3_sets_cloexec_and_clears_the_environment(tmp_path):
    out = run_child(tmp_path, names="prefixd")
    assert out["result"] == [[3, "prefixd"]]
    assert out["cloexec"] is True
    assert out["env_left"] == []


def test_listen_fds_ignores_variables_meant_for_another_process(tmp_path):
    out = run_child(tmp_path, listen_pid="1")
    assert out["result"] == []
    assert out["cloexec"] is False  # not ours: untouched
    assert out["env_left"] == []  # but still cleared, as sd_listen_fds(1) does


def test_take_inherited_socket_serves_the_passed_socket(tmp_path):
    out = run_child(tmp_path, mode="take")
    assert out["result"] == {"origin": "systemd", "name": str(tmp_path / "s.sock"), "fd": 3, "inheritable": False}


def test_listen_fds_without_activation(monkeypatch):
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        monkeypatch.delenv(name, raising=False)
    assert systemd.listen_fds() == []
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.setenv("LISTEN_FDS", "not-a-number")
    assert systemd.listen_fds() == []
    assert "LISTEN_FDS" not in os.environ


def test_adopt_refuses_what_it_cannot_serve(tmp_path):
    datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unbound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(InheritedSocketError, match="SOCK_DGRAM"):
            adopt_listening_socket(datagram.fileno(), "systemd")
        with pytest.raises(InheritedSocketError, match="not listening"):
            adopt_listening_socket(unbound.fileno(), "systemd")
        # Refusing must not close what it was given.
        assert datagram.fileno() >= 0 and os.fstat(datagram.fileno())
    finally:
        datagram.close()
        unbound.close()
    with open(tmp_path / "file", "w") as plain:
        with pytest.raises(InheritedSocketError, match="not a socket"):
            adopt_listening_socket(plain.fileno(), "launchd")


def test_notify_sends_one_datagram_of_key_value_lines(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(path))
        listener.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert systemd.notify(READY=1, STATUS="serving llama\nsecond line")
        assert listener.recv(4096) == b"READY=1\nSTATUS=serving llama second line"


def test_notify_reaches_an_abstract_socket():
    name = f"prefixd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        listener.settimeout(5)
        notifier = systemd.Notifier("@" + name)
        assert notifier.notify(STOPPING=1)
        notifier.close()
        assert listener.recv(4096) == b"STOPPING=1"


def test_notify_does_nothing_outside_systemd(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not systemd.Notifier().enabled
    assert systemd.notify(READY=1) is False
    gone = systemd.Notifier(str(tmp_path / "nobody-listens"))
    assert gone.notify(READY=1) is False  # logged once, never raised
    assert gone.notify(STATUS="x") is False


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0


def test_status_line_names_models_cache_and_requests():
    stats = {"cache": {"total": {"num_bytes": 3 << 20, "num_sequences": 4}}, "requests": {"queued": 2, "completed": 7}}
    line = status_line(("llama", "lfm2"), stats, num_in_flight=1)
    assert line == "serving llama, lfm2 · cache 3.0 MiB in 4 sequences · 1 active requests · 2 queued · 7 completed"
    assert status_line(("llama",), {}, 0) == "serving llama · 0 active requests"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (Debian package systemd)")
def test_contrib_units_pass_systemd_analyze_verify(tmp_path):
    home, runtime = tmp_path / "home", tmp_path / "runtime"
    (home / ".local" / "bin").mkdir(parents=True)
    runtime.mkdir(mode=0o700)
    exe = home / ".local" / "bin" / "prefixd"  # the ExecStart the unit names (%h/.local/bin/prefixd)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    units = [str(REPO / "contrib" / "systemd" / name) for name in ("prefixd.socket", "prefixd.service")]
    env = {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)}
    done = subprocess.run(["systemd-analyze", "verify", "--user", *units], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    service = Path(units[1]).read_text()
    assert "Type=notify" in service and "WatchdogSec=" in service
    assert "ListenStream=%t/prefixd/prefixd.sock" in Path(units[0]).read_text()
