"""The daemon harness of the editor, HTTP and disk-cache tests: DaemonProcess plus one-shot calls.

``LiveDaemon(model_dir, workdir, extra_args, env)`` is tests/e2e/daemon_process.py's
``DaemonProcess`` for one model with debug logging, plus ``call()`` (one
msgpack-RPC call on a fresh connection, through prefixd's own codec) and
``log_events()`` / ``log_text()`` under the names these tests use.
"""

from __future__ import annotations

import socket
from pathlib import Path

from prefixd.protocol import Request, Response, StreamDecoder, encode
from tests.e2e.daemon_process import DaemonProcess


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveDaemon(DaemonProcess):
    def __init__(self, model_dir: Path, workdir: Path, extra_args: list[str] = (), env: dict[str, str] | None = None):
        super().__init__([model_dir], workdir, ["--log-level", "debug", *extra_args], env=env)

    def stop(self, timeout: float = 30.0, expect_code: int | None = 0) -> int | None:
        if self.proc is not None and self.proc.poll() is not None and self.returncode is None:
            self.returncode = self.proc.returncode  # killed by the test itself (kill -9): not a failed stop
        return super().stop(timeout, expect_code)

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
        raise RuntimeError(f"the daemon closed the connection during {method}:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.stderr_text()

    def log_events(self, event: str | None = None) -> list[dict]:
        return [entry for entry in self.log_lines() if event is None or entry.get("event") == event]
