"""A daemon with the HTTP front on, for the Ollama, Anthropic, infill and metrics tests.

Two models: the tiny llama (``llama``, the default, no FIM tokens) and its copy
with FIM tokens (``llama-fim``, tests/support/fim_model.py). Over TCP every
request carries the daemon's bearer token, as a real client configured for it
would (read from the default token file the daemon made).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from tests.e2e.daemon_process import DaemonProcess
from tests.support.fim_model import ensure_fim_model
from tests.support.live_daemon import free_tcp_port


class HttpDaemon(DaemonProcess):
    base_url: str  # http://127.0.0.1:PORT, no path
    token: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        """A raw POST (what the official clients' typed replies drop, such as prefixd_cache, stays visible)."""
        request = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={**self.headers(), "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        status, data = self.post(path, body)
        return status, json.loads(data)

    def get_text(self, path: str) -> str:
        request = urllib.request.Request(self.base_url + path, headers=self.headers())
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read().decode()


@contextmanager
def http_daemon(tiny_llama_dir: Path, workdir: Path, model_dirs: list[Path] | None = None,
                extra_args: Iterable[str] = ()) -> Iterator[HttpDaemon]:
    """``model_dirs``: the models to serve, the first the default (the tiny llama and its FIM copy when None)."""
    if model_dirs is None:
        model_dirs = [tiny_llama_dir, ensure_fim_model(tiny_llama_dir, tiny_llama_dir.parent)]
    port = free_tcp_port()
    daemon = HttpDaemon(model_dirs, workdir, ["--log-level", "debug", "--http", f"127.0.0.1:{port}", *extra_args])
    with daemon:
        daemon.base_url = f"http://127.0.0.1:{port}"
        _wait_for_http(daemon)
        daemon.token = (workdir / "config" / "prefixd" / "http-token").read_text().strip()
        yield daemon


def _wait_for_http(daemon: DaemonProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(daemon.base_url + "/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # 401: it answers
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"the HTTP front did not answer:\n{daemon.log_tail()}")
