"""N prefixd daemons on loopback TCP behind Shepherd Model Gateway (smg): start, watch, kill, stop.

bench/router_workload.py and tests/e2e/test_router.py run this fleet;
contrib/router/serve_many.sh is the command for users, with the same router
flags (``router_command`` below says why each is set). Every daemon gets the
same bearer token from one file; the router sends it as its ``--api-key`` and asks
its own clients for it too.
The router answers which daemon served each request in the response header
``x-smg-routed-worker-id`` (the daemon's URL).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
SMG_VERSION = "1.13.0"  # the version tried; pyproject's test extra pins it


class FleetError(RuntimeError):
    """A daemon or the router did not start or stop as it should; the message says which and shows its log."""


def find_smg() -> str | None:
    """The smg executable: beside this Python (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def router_command(smg: str, policy: str, port: int, worker_urls: list[str], token: str, metrics_port: int) -> list[str]:
    """The router's command line: the cache-aware configuration of docs/scaling.md, *Many daemons behind a router*."""
    return [
        smg, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,  # cache_aware: an approximate radix tree of request text per daemon
        # A prefix the tree has not seen goes to the lowest expected wait, read from each daemon's /v1/loads
        # plus what the router sent it since: polled every 10 s by default, a snapshot older than the
        # requests it is meant to spread, so new tenants land by chance. Every second keeps it current.
        "--load-monitor-interval", "1",
        *policy_flags(policy),
        # Sent to every daemon as its bearer token (load polls, requests), and asked of the router's own clients.
        f"--api-key={token}",  # one word: a token may begin with "-", which argparse would take for a flag
        # Its own Prometheus page binds 0.0.0.0:29000 unless told otherwise.
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        # Probe every 5 s rather than every 60 s, so a daemon that died while idle is out, and one that
        # came back is in, within seconds.
        "--health-check-interval-secs", "5",
        # A daemon's circuit opens after 10 failures; retry it after 10 s rather than 60 s (a restart
        # from the disk cache takes a few seconds).
        "--cb-timeout-duration-secs", "10",
        "--shutdown-grace-period-secs", "5",
        "--log-level", "warn",
    ]


def policy_flags(policy: str) -> list[str]:
    """Flags one policy needs beside the shared ones."""
    if policy == "manual":
        # Sticky keys: the first request of a key (the tenant, in the header the client sends) goes to the
        # daemon with the fewest distinct keys in flight, and every later one follows it; a request with no
        # key goes to a daemon drawn at random.
        return ["--assignment-mode", "min_group"]
    return []


def _get(url: str, token: str | None, timeout: float = 5.0) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class _Process:
    """A subprocess with its output in a log file; ``stop()`` terminates it and waits."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name, self.args, self.log_path, self.env = name, args, log_path, env
        self.proc: subprocess.Popen | None = None

    def launch(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last save, connections cut mid-reply."""
        if self.running:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        if not self.running:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"  ({self.name} pid {self.proc.pid} ignored SIGTERM for {timeout:.0f} s: killing it)", file=sys.stderr)
            self.kill()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_until(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise FleetError(f"{self.name} exited with code {self.proc.returncode} before {what}:\n{self.log_tail()}")
            try:
                if ready():
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        raise FleetError(f"{self.name}: not {what} within {timeout:.0f} s:\n{self.log_tail()}")


class Daemon(_Process):
    """One prefixd daemon: its HTTP front on 127.0.0.1, its socket and XDG folders in ``workdir``."""

    def __init__(self, index: int, model_dir: Path, workdir: Path, token_file: Path, cache_bytes: int,
                 extra_args: list[str] = ()):
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token_file.read_text().strip()
        env = {key: value for key, value in os.environ.items() if not key.startswith("PREFIXD_")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                   XDG_CONFIG_HOME=str(workdir / "config"), XDG_CACHE_HOME=str(workdir / "cache"))
        args = [sys.executable, "-m", "prefixd.daemon", "--model", str(model_dir), "--socket", str(workdir / "prefixd.sock"),
                "--http", f"127.0.0.1:{self.port}", "--http-token-file", str(token_file),
                "--cache-bytes", str(cache_bytes), "--log-format", "json", *extra_args]
        super().__init__(f"daemon {index} ({self.url})", args, workdir / "daemon.log", env)

    def start(self, timeout: float = 180.0) -> None:
        self.launch()
        self.wait_until(lambda: _get(self.url + "/health", self.token)[0] == 200, "healthy", timeout)

    def loads(self) -> dict[str, Any]:
        """This daemon's /v1/loads: its running requests and their KV share, and its prefix store."""
        status, body = _get(self.url + "/v1/loads", self.token)
        if status != 200:
            raise FleetError(f"{self.name}: /v1/loads answered {status}")
        return json.loads(body)

    def store(self) -> dict[str, Any]:
        """This daemon's prefix store as its /v1/loads reports it: bytes held, budget, evictions, recent reuse."""
        return self.loads()["prefixd_cache"]

    def counters(self) -> dict[str, float]:
        """This daemon's request and token counters from /metrics, summed over models and outcomes."""
        status, body = _get(self.url + "/metrics", self.token)
        if status != 200:
            raise FleetError(f"{self.name}: /metrics answered {status}")
        totals = {"requests": 0.0, "prompt_tokens": 0.0, "reused_tokens": 0.0}
        for line in body.decode().splitlines():
            for key in totals:
                if line.startswith(f"prefixd_{key}_total{{"):
                    totals[key] += float(line.rsplit(" ", 1)[1])
        return totals


class Router(_Process):
    """smg in front of ``worker_urls`` with one routing policy."""

    def __init__(self, smg: str, policy: str, worker_urls: list[str], token: str, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_workers = len(worker_urls)
        self.token = token  # smg asks its own clients for its --api-key too
        args = router_command(smg, policy, self.port, worker_urls, token, free_port())
        super().__init__(f"smg ({policy})", args, workdir / f"smg-{policy}.log")

    def start(self, timeout: float = 60.0) -> None:
        self.launch()
        self.wait_until(lambda: self.num_healthy() == self.num_workers, f"routing to {self.num_workers} daemons", timeout)

    def num_healthy(self) -> int:
        status, body = _get(self.url + "/readiness", self.token)
        return json.loads(body).get("healthy_workers", 0) if status == 200 else 0

    def workers(self) -> list[dict[str, Any]]:
        """The router's view of each daemon (/workers): health, its load as polled, its circuit."""
        return json.loads(_get(self.url + "/workers", self.token)[1])["workers"]


class Fleet:
    """``num_daemons`` daemons and the router in front; ``with Fleet(...) as fleet: fleet.router.url``."""

    def __init__(self, model_dir: Path, workdir: Path, num_daemons: int, policy: str, cache_bytes_each: int,
                 daemon_args: list[str] = (), smg: str | None = None):
        smg = smg or find_smg()
        if smg is None:
            raise FleetError("smg is not installed: pip install smg (the test extra has it)")
        workdir.mkdir(parents=True, exist_ok=True)
        token_file = workdir / "http-token"
        if not token_file.exists():
            token_file.write_text(secrets.token_urlsafe(24) + "\n")
            token_file.chmod(0o600)
        self.token = token_file.read_text().strip()
        self.daemons = [Daemon(i, model_dir, workdir / f"daemon{i}", token_file, cache_bytes_each, list(daemon_args))
                        for i in range(num_daemons)]
        self.router = Router(smg, policy, [d.url for d in self.daemons], self.token, workdir)

    def __enter__(self) -> Fleet:
        try:
            for daemon in self.daemons:
                daemon.start()
            self.router.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        self.router.stop()
        for daemon in self.daemons:
            daemon.stop()

    def daemon_at(self, url: str) -> int:
        """The index of the daemon the router names by ``url`` (its routed-worker header)."""
        return next(i for i, d in enumerate(self.daemons) if d.url == url.rstrip("/"))


class LoadSampler(threading.Thread):
    """Each daemon's /v1/loads every ``interval`` seconds while the thread runs: when its store filled and evicted.

    ``samples[i]`` is daemon i's list of ``(seconds since start, stored bytes,
    bytes its running requests reserve, evictions so far)``.
    """

    def __init__(self, daemons: list[Daemon], cache_bytes_each: int, interval: float = 1.0):
        super().__init__(daemon=True)
        self.daemons, self.cache_bytes_each, self.interval = daemons, cache_bytes_each, interval
        self.samples: list[list[tuple[float, int, int, int]]] = [[] for _ in daemons]
        self._stop_event = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self._stop_event.is_set():
            for daemon, samples in zip(self.daemons, self.samples):
                try:
                    loads = daemon.loads()
                except (OSError, FleetError):
                    continue  # a daemon that is down has nothing to say
                store = loads["prefixd_cache"]
                reserved = round(loads["loads"][0]["token_usage"] * self.cache_bytes_each)
                samples.append((round(time.monotonic() - started, 1), store["num_bytes"], reserved,
                                store["num_evictions"]))
            self._stop_event.wait(self.interval)

    def stop(self) -> list[list[tuple[float, int, int, int]]]:
        self._stop_event.set()
        self.join()
        return self.samples
