"""A real prefixd daemon in a subprocess, for end-to-end tests.

``LiveDaemon(model_dir, workdir, extra_args)`` starts ``python -m
prefixd.daemon.main`` on a socket in ``workdir``, waits until it answers a
ping, and stops it with SIGTERM. Its JSON log lines are kept in
``workdir/daemon.log``; ``log_events()`` parses them, and failures quote them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from prefixd.protocol import Request, Response, StreamDecoder, encode


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveDaemon:
    def __init__(self, model_dir: Path, workdir: Path, extra_args: list[str] = (), env: dict[str, str] | None = None):
        self.workdir = workdir
        self.socket_path = workdir / "prefixd.sock"
        self.log_path = workdir / "daemon.log"
        self.args = [
            sys.executable, "-m", "prefixd.daemon.main", "--model", str(model_dir), "--socket", str(self.socket_path),
            "--log-format", "json", "--log-level", "debug", *extra_args,
        ]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LiveDaemon:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            if self.socket_path.exists() and self.call("ping").get("pong"):
                return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the daemon did not answer within {timeout} s:\n{self.log_text()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def call(self, method: str, params: dict | None = None, timeout: float = 60.0) -> dict:
        """One msgpack-RPC call on a fresh connection; raises RuntimeError on an error reply."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError):
                return {}
            sock.sendall(encode(Request(1, method, [params or {}])))
            decoder = StreamDecoder()
            while data := sock.recv(65536):
                decoder.feed(data)
                for message in decoder:
                    if isinstance(message, Response) and message.msgid == 1:
                        if message.error is not None:
                            raise RuntimeError(f"{method} failed: {message.error}")
                        return message.result
        raise RuntimeError(f"the daemon closed the connection during {method}:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else "(no log)"

    def log_events(self, event: str | None = None) -> list[dict]:
        events = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if event is None or entry.get("event") == event:
                    events.append(entry)
        return events
