"""A prefixd daemon in a subprocess, and a raw msgpack-RPC connection to it.

``DaemonProcess`` runs ``python -m prefixd.daemon`` with its socket in a
short directory (AF_UNIX paths are limited to about 107 bytes), keeps its
stderr (JSON log lines) in a file, waits until the socket answers ``ping``,
and stops it with SIGTERM, checking that it exits 0. ``RawConnection`` speaks
msgpack-RPC with plain ``msgpack`` and ``socket`` and nothing of prefixd, so
the end-to-end tests see exactly the bytes a client in another language sees.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

import msgpack

SOCKET_NAME = "prefixd.sock"
MAX_SOCKET_PATH_BYTES = 100  # sun_path holds 108 bytes on Linux, 104 on macOS, NUL included
REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2


def short_socket_path(preferred_dir: Path) -> tuple[Path, Path | None]:
    """A socket path in ``preferred_dir`` if it fits, else in a new short dir under /tmp.

    Returns (socket path, the temp dir to remove afterwards or None).
    """
    preferred = preferred_dir / SOCKET_NAME
    if len(os.fsencode(preferred)) <= MAX_SOCKET_PATH_BYTES:
        return preferred, None
    short_dir = Path(tempfile.mkdtemp(prefix="pfx-", dir="/tmp"))
    return short_dir / SOCKET_NAME, short_dir


def daemon_env(workdir: Path) -> dict[str, str]:
    """The environment of a test daemon: offline, and blind to the developer's own prefixd settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFIXD_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        XDG_CONFIG_HOME=str(workdir / "config"),  # no config file
        XDG_CACHE_HOME=str(workdir / "cache"),
    )
    return env


def daemon_command(model_dirs: Iterable[Path], socket_path: Path, extra_args: Iterable[str] = ()) -> list[str]:
    models = [arg for model in model_dirs for arg in ("--model", str(model))]
    return [sys.executable, "-m", "prefixd.daemon", *models, "--socket", str(socket_path),
            "--log-format", "json", *extra_args]


class DaemonProcess:
    """One daemon subprocess; ``start()`` returns once it answers ping."""

    def __init__(self, model_dirs: Iterable[Path], workdir: Path, extra_args: Iterable[str] = (),
                 socket_path: Path | None = None, env: dict[str, str] | None = None):
        self.workdir = workdir
        self.extra_env = dict(env or {})
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._socket_dir_to_remove: Path | None = None
        if socket_path is None:
            socket_path, self._socket_dir_to_remove = short_socket_path(workdir)
        assert len(os.fsencode(socket_path)) <= MAX_SOCKET_PATH_BYTES, f"socket path too long for AF_UNIX: {socket_path}"
        self.socket_path = socket_path
        self.log_path = workdir / "daemon.stderr.log"
        self.stdout_path = workdir / "daemon.stdout.log"
        self.args = daemon_command(model_dirs, socket_path, extra_args)
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def __enter__(self) -> DaemonProcess:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the daemon was never started"
        return self.proc.pid

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log_path, "ab") as stderr, open(self.stdout_path, "ab") as stdout:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                         env=daemon_env(self.workdir) | self.extra_env, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while not self.answers_ping():
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                raise RuntimeError(f"the daemon exited with code {self.returncode} before answering ping "
                                   f"on {self.socket_path}; stderr tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the daemon did not answer ping on {self.socket_path} within {timeout:.0f} s "
                                   f"(model load stuck? wrong --socket?); stderr tail:\n{self.log_tail()}")
            time.sleep(0.05)

    def answers_ping(self) -> bool:
        try:
            with RawConnection(self.socket_path, timeout=2.0) as conn:
                return conn.result("ping").get("pong") is True
        except (OSError, EOFError, AssertionError):
            return False

    def terminate(self) -> None:
        """Send SIGTERM without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for the exit code; kill the daemon and fail if it takes longer than ``timeout``."""
        assert self.proc is not None, "the daemon was never started"
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the daemon did not exit within {timeout:.0f} s; stderr tail:\n{self.log_tail()}") from None
        return self.returncode

    def stop(self, timeout: float = 30.0, expect_code: int | None = 0) -> int | None:
        """SIGTERM, wait, and check the exit code (a no-op once stopped)."""
        if self.proc is None:
            self._remove_socket_dir()
            return None
        already_stopped = self.proc.poll() is not None and self.returncode is not None
        self.terminate()
        code = self.wait(timeout)
        self._remove_socket_dir()
        if expect_code is not None and not already_stopped:
            assert code == expect_code, f"the daemon exited with {code}, expected {expect_code}; stderr tail:\n{self.log_tail()}"
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.returncode = self.proc.wait()
        self._remove_socket_dir()

    def _remove_socket_dir(self) -> None:
        if self._socket_dir_to_remove is not None:
            shutil.rmtree(self._socket_dir_to_remove, ignore_errors=True)
            self._socket_dir_to_remove = None

    # -- the log ------------------------------------------------------------------------

    def stderr_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.stderr_text().splitlines()[-num_lines:]) or "(empty)"

    def log_lines(self) -> list[dict[str, Any]]:
        """Every complete stderr line that parses as a JSON object, in order."""
        text = self.stderr_text()
        complete = text[: text.rfind("\n") + 1]  # the daemon may be writing the last one
        lines = []
        for line in complete.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                lines.append(entry)
        return lines

    def events(self, event: str, **fields: Any) -> list[dict[str, Any]]:
        """Log lines of ``event`` whose fields equal those given."""
        return [entry for entry in self.log_lines()
                if entry.get("event") == event and all(entry.get(key) == value for key, value in fields.items())]

    def wait_for_event(self, event: str, timeout: float = 15.0, **fields: Any) -> dict[str, Any]:
        """The first log line of ``event`` with these fields, waiting up to ``timeout`` for it."""
        deadline = time.monotonic() + timeout
        while not (found := self.events(event, **fields)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {event!r} log line with {fields} within {timeout:.0f} s; stderr tail:\n{self.log_tail()}")
            time.sleep(0.05)
        return found[0]


class RawConnection:
    """msgpack-RPC over a Unix socket with nothing but ``msgpack`` and ``socket``.

    Messages are read in order into ``self.inbox``; ``reply(msgid)`` takes the
    response for one msgid (and its ``generate.chunk`` notifications) out of
    it and leaves everything else for later reads.
    """

    def __init__(self, socket_path: Path, timeout: float = 30.0):
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(socket_path))
        except OSError:
            self.sock.close()
            raise
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=64 << 20)
        self.inbox: deque[Any] = deque()
        self.at_eof = False
        self._next_msgid = 1

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    # -- sending ------------------------------------------------------------------------

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, *messages: Any) -> None:
        """Send wire arrays back to back in one write."""
        self.sock.sendall(b"".join(msgpack.packb(message, use_bin_type=True) for message in messages))

    def take_msgid(self) -> int:
        msgid, self._next_msgid = self._next_msgid, self._next_msgid + 1
        return msgid

    def request(self, method: str, params: dict[str, Any] | None = None, msgid: int | None = None) -> int:
        msgid = self.take_msgid() if msgid is None else msgid
        self.send([REQUEST, msgid, method, [params if params is not None else {}]])
        return msgid

    # -- receiving ------------------------------------------------------------------------

    def _receive(self, deadline: float) -> None:
        """Read once more from the socket into the inbox; EOFError at the end of the stream."""
        if self.at_eof:
            raise EOFError("the daemon closed the connection")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no message from the daemon within {self.timeout} s")
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(1 << 16)
        except ConnectionResetError:
            data = b""  # AF_UNIX reports ECONNRESET after the data when the daemon closed with bytes unread
        except socket.timeout:
            raise TimeoutError(f"no message from the daemon within {self.timeout} s") from None
        if not data:
            self.at_eof = True
            raise EOFError("the daemon closed the connection")
        self.unpacker.feed(data)
        self.inbox.extend(self.unpacker)

    def read(self, timeout: float | None = None) -> Any:
        """The next message in arrival order."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self.inbox:
            self._receive(deadline)
        return self.inbox.popleft()

    def reply(self, msgid: int | None, timeout: float | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
        """(chunk maps of msgid in order, the response [1, msgid, error, result])."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        chunks: list[dict[str, Any]] = []
        scanned = 0
        while True:
            while scanned < len(self.inbox):
                message = self.inbox[scanned]
                if message[0] == RESPONSE and message[1] == msgid:
                    del self.inbox[scanned]
                    return chunks, message
                if message[0] == NOTIFICATION and message[1] == "generate.chunk" and message[2][0].get("id") == msgid:
                    del self.inbox[scanned]
                    chunks.append(message[2][0])
                    continue
                scanned += 1
            self._receive(deadline)

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> list[Any]:
        """Send a request and return its response array."""
        return self.reply(self.request(method, params), timeout)[1]

    def result(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """The result of a call that must succeed."""
        response = self.call(method, params, timeout)
        assert response[2] is None, f"{method} failed: {response[2]}"
        return response[3]

    def error(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """The error map of a call that must fail."""
        response = self.call(method, params, timeout)
        assert response[2] is not None, f"{method} succeeded but should have failed: {response[3]}"
        return response[2]

    def read_until_closed(self, timeout: float | None = None) -> list[Any]:
        """Every message until the daemon closes the connection."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            try:
                self._receive(deadline)
            except EOFError:
                messages = list(self.inbox)
                self.inbox.clear()
                return messages
