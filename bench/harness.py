"""Benchmark plumbing: the real daemon in a subprocess, a client on its socket, timed streams.

Used by bench/prefix_cache.py. The client is prefixd's own blocking client
when it imports; otherwise a minimal raw msgpack-RPC client below (same
subset: tokenize, models, stats, ping, stream).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the kernel picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class BenchError(RuntimeError):
    """A benchmark step failed; the message says which and why."""


class Daemon:
    """``python -m prefixd.daemon`` on a socket in ``workdir``; always stopped by ``stop()``."""

    def __init__(self, model_dir: Path, workdir: Path, extra_args: list[str] = ()):
        self.socket_path = workdir / "prefixd.sock"
        self.log_path = workdir / f"daemon-{Path(model_dir).name}.log"
        self.args = [sys.executable, "-m", "prefixd.daemon", "--model", str(model_dir),
                     "--socket", str(self.socket_path), "--log-format", "json", *extra_args]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Daemon:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> None:
        self.socket_path.unlink(missing_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env, cwd=REPO)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"the daemon exited with code {self.proc.returncode} during startup:\n{self.log_tail()}")
            if self.socket_path.exists():
                try:
                    with connect(self.socket_path, timeout=10) as conn:
                        conn.ping()
                    return
                except (OSError, BenchError):
                    pass
            time.sleep(0.2)
        raise BenchError(f"the daemon did not answer a ping within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            print(f"  (daemon pid {self.proc.pid} ignored SIGTERM for 30 s: killing it)", file=sys.stderr)
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"


# -- clients -----------------------------------------------------------------------------------


def connect(socket_path: Path, timeout: float | None = 600.0):
    """prefixd's blocking Client if it imports (and PREFIXD_BENCH_RAW is unset), else RawClient."""
    if os.environ.get("PREFIXD_BENCH_RAW"):
        return RawClient(socket_path, timeout)
    try:
        from prefixd.client.sync_client import Client
    except Exception:  # noqa: BLE001 - the client is optional for the bench
        return RawClient(socket_path, timeout)
    return Client(socket_path, timeout=timeout)


class RawClient:
    """Just enough msgpack-RPC for the bench: one request at a time on one connection."""

    def __init__(self, socket_path: Path, timeout: float | None):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(str(socket_path))
        self._unpacker = msgpack.Unpacker(raw=False)
        self._msgid = 0

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def _send(self, method: str, params: dict) -> int:
        self._msgid += 1
        self._sock.sendall(msgpack.packb([0, self._msgid, method, [params]]))
        return self._msgid

    def _messages(self):
        while True:
            for message in self._unpacker:
                yield message
            data = self._sock.recv(65536)
            if not data:
                raise BenchError("the daemon closed the connection")
            self._unpacker.feed(data)

    def _call(self, method: str, params: dict) -> Any:
        msgid = self._send(method, params)
        for message in self._messages():
            if message[0] == 1 and message[1] in (msgid, None):
                return _result(message)

    def ping(self) -> dict:
        return self._call("ping", {})

    def models(self) -> dict:
        return self._call("models", {})

    def stats(self) -> dict:
        return self._call("stats", {})

    def tokenize(self, prompt=None, messages=None, **kw) -> dict:
        params = {"prompt": prompt} if prompt is not None else {"messages": messages}
        return self._call("tokenize", {**params, **kw})

    def stream(self, prompt=None, **options) -> _RawStream:
        params = ({"prompt": prompt} if prompt is not None else {}) | options | {"stream": True}
        return _RawStream(self, self._send("generate", params))


class _RawStream:
    def __init__(self, client: RawClient, msgid: int):
        self.result = None
        self._client, self._msgid = client, msgid

    def __iter__(self):
        for message in self._client._messages():
            if message[0] == 2 and message[1] == "generate.chunk" and message[2][0].get("id") == self._msgid:
                yield message[2][0]
            elif message[0] == 1 and message[1] in (self._msgid, None):
                self.result = _result(message)
                return


def _result(response: list) -> Any:
    if response[2] is not None:
        raise BenchError(f"daemon error {response[2].get('code')}: {response[2].get('message')}")
    return response[3]


def run_at_once(session: Callable[[int], None], num_sessions: int) -> float:
    """``session(i)`` on a thread each, started together; returns the wall time until the last ends."""
    threads = [threading.Thread(target=session, args=(i,)) for i in range(num_sessions)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def timed_generate(conn, **params) -> dict[str, Any]:
    """One streamed generate; TTFT is measured here, at the client: request sent -> first chunk.

    Returns the reply plus ``client_ttft_ms`` (time to the response itself when no chunk came,
    e.g. an immediate end token: then ``first_chunk`` is False), ``client_total_ms`` and the
    first generated token id.
    """
    started = time.perf_counter()
    stream = conn.stream(**params)
    first_at, first_token, last_at, num_chunks = None, None, None, 0
    for chunk in stream:
        last_at = time.perf_counter()
        num_chunks += 1
        if first_at is None:
            first_at = last_at
            first_token = (chunk.get("tokens") or [None])[0]
    done = time.perf_counter()
    if stream.result is None:
        raise BenchError("the stream ended without a final result")
    return {**stream.result, "client_ttft_ms": ((first_at or done) - started) * 1000,
            "client_total_ms": (done - started) * 1000, "first_chunk": first_at is not None, "first_token": first_token,
            "decode_window": decode_window(first_at, last_at, num_chunks)}


def decode_window(first_at: float | None, last_at: float | None, num_chunks: int) -> dict[str, float] | None:
    """Decode steps only: the chunks after the first and the seconds from the first chunk to the last.

    Every system's figure is taken the same way (one streamed chunk per token that adds text), so it
    leaves out what comes before the first token and after the last: prefill, storing the answer.
    """
    if first_at is None or num_chunks < 2 or last_at <= first_at:
        return None
    return {"steps": num_chunks - 1, "seconds": last_at - first_at}
