"""The three systems bench/compare.py runs side by side, behind one small interface.

Each peer is a subprocess on the same model directory: ``start()``, ``client()`` (one per
thread for the concurrent workload), ``client.generate(request) -> result``, ``peak_kb()``
(VmHWM of the serving process) and ``stop()``. A result is a dict with ``ttft_ms`` and
``total_ms`` (measured at the client, except for in-process mlx-lm: inside the worker),
``prompt_tokens``, ``prefilled_tokens`` (prompt tokens the system actually ran),
``completion_tokens`` and ``text``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from harness import BenchError, Daemon, connect, decode_window, free_port, timed_generate

BENCH = Path(__file__).resolve().parent


def openblas_path() -> str | None:
    """Absolute path of libopenblas.so.0 from the loader cache, for LD_PRELOAD of a child."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return None
    match = re.search(r"libopenblas\.so\.0 \(libc6,x86-64\) => (\S+)", listing)
    return match.group(1) if match else None


def vmhwm_kb(pid: int) -> int:
    """Peak resident memory of a live process (kB), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def stop_process(proc: subprocess.Popen | None, name: str) -> None:
    """SIGTERM, then SIGKILL after 30 s; only ever the process we started."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        print(f"  ({name} pid {proc.pid} ignored SIGTERM for 30 s: killing it)", file=sys.stderr)
        proc.kill()
        proc.wait()


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Peer:
    """What every peer shares: the serving process's peak memory."""

    pid: int

    def peak_kb(self) -> int:
        return vmhwm_kb(self.pid)


# -- prefixd --------------------------------------------------------------------------------------


class PrefixdPeer(_Peer):
    """prefixd through its real Unix socket and its own client (bench/harness.py)."""

    name, concurrent = "prefixd", True

    def __init__(self, model_dir: Path, workdir: Path):
        self.daemon = Daemon(model_dir, workdir)
        chunk = os.environ.get("PREFIXD_PREFILL_CHUNK", "by device: 512 on a CPU, 2048 on a GPU")
        attention = os.environ.get("PREFIXD_ATTENTION", "auto: matmul form for short tails on CUDA, fused elsewhere")
        self.settings = (f"defaults (--dtype auto: float32 on a CPU, as stored on a GPU; --prefill-chunk {chunk}; "
                         f"--attention {attention}); OpenBLAS loaded by the daemon itself on a CPU")

    def start(self) -> None:
        self.daemon.start()

    @property
    def pid(self) -> int:
        return self.daemon.proc.pid

    def client(self) -> PrefixdClient:
        return PrefixdClient(self.daemon.socket_path)

    def log_tail(self) -> str:
        return self.daemon.log_tail()

    def stop(self) -> None:
        self.daemon.stop()


class PrefixdClient:
    def __init__(self, socket_path: Path):
        self.conn = connect(socket_path)

    def generate(self, request) -> dict:
        reply = timed_generate(self.conn, messages=request.messages, max_tokens=request.max_tokens, temperature=0)
        cache = reply["cache"]
        return {"ttft_ms": reply["client_ttft_ms"], "total_ms": reply["client_total_ms"],
                "prompt_tokens": cache["prompt_tokens"], "prefilled_tokens": cache["prefilled_tokens"],
                "completion_tokens": reply["usage"]["completion_tokens"], "text": reply["text"],
                "finish_reason": reply["finish_reason"], "hit": cache["hit"], "reused_tokens": cache["reused_tokens"],
                "server_timings": reply["timings"], "decode_window": reply["decode_window"]}

    def close(self) -> None:
        self.conn.close()


# -- mlx-lm's server --------------------------------------------------------------------------------


def wait_for_models(port: int, proc: subprocess.Popen, tail: Callable[[], str], timeout: float = 60.0) -> None:
    """Until the OpenAI-compatible server on ``port`` lists its models; BenchError if it exits or stays silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"the server exited with code {proc.returncode}:\n{tail()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise BenchError(f"no answer on port {port} within {timeout:.0f} s:\n{tail()}")


class MlxServerPeer(_Peer):
    """``python -m mlx_lm.server``: OpenAI-compatible HTTP, streaming, its LRU prompt cache."""

    name, concurrent = "mlx-lm server", True

    def __init__(self, model_dir: Path, workdir: Path):
        self.port = free_port()
        self.log_path = workdir / "mlx_lm_server.log"
        blas = openblas_path()
        # Same fast path as prefixd: OpenBLAS must be in the process before mlx.core loads.
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                    **({"LD_PRELOAD": blas} if blas else {})}
        self.args = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(self.port),
                     "--log-level", "WARNING"]
        self.settings = (f"defaults (prompt-cache-size 10, prefill-step-size 2048), weights as stored (float32); "
                         f"LD_PRELOAD={blas or 'none: bundled reference BLAS!'}")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env)
        wait_for_models(self.port, self.proc, self.log_tail, timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self) -> MlxServerClient:
        return MlxServerClient(self.port)

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def stop(self) -> None:
        stop_process(self.proc, "mlx_lm.server")


class MlxServerClient:
    """Plain http.client: nothing between the clock and the socket but a JSON parse per chunk."""

    def __init__(self, port: int):
        self.port = port

    def generate(self, request) -> dict:
        body = json.dumps({"messages": request.messages, "max_tokens": request.max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
        started = time.perf_counter()
        # The server answers a stream without Content-Length and closes: one connection per request.
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1800)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise BenchError(f"mlx_lm.server answered {response.status}: {response.read()[:300]!r}")
        first_at, last_at, num_chunks, text, usage, finish = None, None, 0, "", None, None
        for event in _sse_data(response):
            for choice in event.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    last_at = time.perf_counter()
                    num_chunks += 1
                if content and first_at is None:
                    first_at = last_at  # TTFT: the first chunk carrying content
                text += content or ""
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
        done = time.perf_counter()
        conn.close()
        if usage is None:
            raise BenchError("mlx_lm.server sent no usage chunk")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"ttft_ms": ((first_at or done) - started) * 1000, "total_ms": (done - started) * 1000,
                "prompt_tokens": usage["prompt_tokens"], "prefilled_tokens": usage["prompt_tokens"] - cached,
                "completion_tokens": usage["completion_tokens"], "text": text, "finish_reason": finish,
                "reused_tokens": cached, "decode_window": decode_window(first_at, last_at, num_chunks)}

    def close(self) -> None:
        pass


def _sse_data(response):
    """The JSON payloads of ``data:`` lines; keepalive comments (``: keepalive n/m``) skipped."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[6:]
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


# -- in-process mlx-lm ------------------------------------------------------------------------------


class InProcessPeer(_Peer):
    """``mlx_lm.stream_generate`` in a worker subprocess (bench/inproc_worker.py); cold every time."""

    name, concurrent = "in-process mlx-lm", False  # one MLX thread: concurrent requests run in turn

    def __init__(self, model_dir: Path, workdir: Path):
        self.model_dir = model_dir
        self.log_path = workdir / "inproc_worker.log"
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.settings = "stream_generate defaults (prefill_step_size 2048), no prompt_cache; OpenBLAS via preload_blas()"

    def start(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(BENCH / "inproc_worker.py"), str(self.model_dir)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise BenchError(f"the in-process worker exited during startup:\n{self.log_tail()}")
        self.info = json.loads(ready)

    def ask(self, message: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"the in-process worker died:\n{self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise BenchError(f"in-process worker: {answer['error']}")
        return answer

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self) -> InProcessClient:
        return InProcessClient(self)

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # the worker exits at EOF; SIGTERM (then SIGKILL) if it does not
            stop_process(self.proc, "in-process worker")


class InProcessClient:
    def __init__(self, peer: InProcessPeer):
        self.peer = peer

    def generate(self, request) -> dict:
        return self.peer.ask({"op": "generate", "messages": request.messages, "max_tokens": request.max_tokens})

    def close(self) -> None:
        pass
