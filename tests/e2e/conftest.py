"""Daemons for the end-to-end tests.

``shared_daemon``: one daemon per test module serving both tiny models (llama,
the default, and the hybrid lfm2), so most tests pay no startup. Tests on it
use prompts of their own, since they share its prefix cache.
``start_daemon``: a factory for daemons of a single test (lifecycle tests that
stop, signal or race them); whatever it started is stopped afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest

from tests.e2e.daemon_process import DaemonProcess


@pytest.fixture(scope="module")
def shared_daemon(tiny_llama_dir, tiny_lfm2_dir, tmp_path_factory) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess([tiny_llama_dir, tiny_lfm2_dir], tmp_path_factory.mktemp("daemon"))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()  # fails the module's last test teardown unless the exit code is 0


@pytest.fixture
def start_daemon(tiny_llama_dir, tmp_path) -> Iterator[Callable[..., DaemonProcess]]:
    """``start_daemon(models=None, extra_args=(), socket_path=None, start=True, env=None)``; models default to tiny llama."""
    started: list[DaemonProcess] = []

    def start(models: Iterable[Path] | None = None, extra_args: Iterable[str] = (), socket_path: Path | None = None,
              start: bool = True, env: dict[str, str] | None = None) -> DaemonProcess:
        workdir = tmp_path / f"daemon{len(started)}"
        daemon = DaemonProcess(models or [tiny_llama_dir], workdir, extra_args, socket_path=socket_path, env=env)
        started.append(daemon)
        if start:
            daemon.start()
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
