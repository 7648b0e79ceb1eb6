"""A prefixd daemon across several local ranks over the ring backend on loopback.

``RankedDaemon`` is a ``DaemonProcess`` whose process is a launcher: by default
``prefixd serve --ranks N`` (its own launcher, daemon/service/rank_launcher.py),
or ``mlx.launch -n N --backend ring`` (``launcher="mlx"``, how a set-up across
machines starts it). Either runs ``python -m prefixd.daemon ...`` once per rank
(rank 0 serves the socket, the others follow). The ranks' pids come from their
``rank_ready`` log lines; ``stop()`` sends SIGTERM to rank 0, which stops the
others, and the launcher then exits. Each daemon gets ring ports of its own, so
tests and benchmarks running at the same time do not meet.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Iterable

from prefixd.daemon.service.rank_launcher import free_port_range
from tests.e2e.daemon_process import DaemonProcess


def mlx_launcher() -> str:
    return str(Path(sys.executable).with_name("mlx.launch"))


def launch_command(num_ranks: int, port: int, command: list[str]) -> list[str]:
    """``command`` (``[python, args...]``) on ``num_ranks`` local ranks through mlx.launch."""
    return [mlx_launcher(), "-n", str(num_ranks), "--backend", "ring", "-p", str(port),
            "--python", command[0], *command[1:]]


class RankedDaemon(DaemonProcess):
    def __init__(self, model_dirs: Iterable[Path], workdir: Path, num_ranks: int = 2,
                 extra_args: Iterable[str] = (), launcher: str = "prefixd"):
        super().__init__(model_dirs, workdir, ["--rank-timeout", "30", *extra_args])
        self.num_ranks = num_ranks
        if launcher == "prefixd":  # prefixd serve --ranks N launches its ranks itself
            self.args = [*self.args, "--ranks", str(num_ranks), "--distributed-backend", "ring"]
        elif launcher == "mlx":
            self.args = launch_command(num_ranks, free_port_range(num_ranks), self.args)
        else:
            raise ValueError(f"unknown launcher {launcher!r}: prefixd or mlx")

    def start(self, timeout: float = 120.0) -> None:
        super().start(timeout)
        for rank in range(self.num_ranks):
            self.wait_for_event("rank_ready", rank=rank)

    def rank_pid(self, rank: int) -> int:
        return self.events("rank_ready", rank=rank)[0]["pid"]

    def kill_rank(self, rank: int) -> None:
        _signal(self.rank_pid(rank), signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM to rank 0: it shuts down like a one-process daemon and tells the others to stop."""
        if self.proc is not None and self.proc.poll() is None:
            ready = self.events("rank_ready", rank=0)
            if ready:
                _signal(ready[0]["pid"], signal.SIGTERM)
            else:  # not started: the launcher takes its ranks down with it
                self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        for entry in self.events("rank_ready"):
            _signal(entry["pid"], signal.SIGKILL)
        super().kill()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # gone already
