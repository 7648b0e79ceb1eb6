"""``prefixd serve --ranks N`` on one machine: N ranks of the same command over MLX's ring backend.

Why not mlx.launch, which ``--ranks`` ran until 2026-12-07: its relay keeps,
per rank, a thread that ``select()``s on that rank's stdin pipe for writing,
and a pipe with room is always writable, so the launcher spins a CPU core for
as long as the daemon lives (4 s of CPU in 4 s with two ranks sleeping,
mlx 0.32.4). On the 2-core machines this project serves, that is a core taken
from the ranks. Here the ranks inherit the launcher's stdin, stdout and
stderr (every JSON log line is one write and says its rank, logs.py), and the
launcher only waits for them.

Each rank gets what mlx.launch gives it for the ring backend on one host,
which ``mx.distributed.init`` reads: ``MLX_RANK``, and ``MLX_HOSTFILE`` naming
a JSON file with one ``["127.0.0.1:port"]`` per rank. The other backends
(NCCL on several GPUs, JACCL, MPI) set up more than a local launcher should
copy, and stay with mlx.launch (``launch_ranks`` below execs it). Each
follower also gets the read end of a pipe whose write end rank 0 holds, on
which it sleeps until rank 0's next iteration (distributed/doorbell.py).

Supervision: SIGTERM, SIGINT or SIGHUP to the launcher go to rank 0, which
shuts down like a one-process daemon and stops the others (the followers
ignore those signals, distributed/follower.py). When a rank fails (a non-zero
exit, a signal) the launcher asks rank 0 to stop, and any rank still running
``STOP_GRACE_S`` later is killed; the launcher exits with the first failure's
status, else rank 0's. On Linux every rank is killed if the launcher itself
dies (``PR_SET_PDEATHSIG``), so a SIGKILLed launcher leaves no ranks behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# What distributed/doorbell.py reads (the names only: importing it would import MLX into the launcher).
DOORBELL_LEADER_ENV = "PREFIXD_RANK_DOORBELLS"
DOORBELL_FOLLOWER_ENV = "PREFIXD_RANK_DOORBELL"
# How long the other ranks may take to stop once rank 0 was asked to (its --shutdown-grace is
# separate: this counts from rank 0's exit, or from a failure when rank 0 is the one still up).
STOP_GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.1  # how often the launcher looks for exited ranks: 10 wake-ups a second, no spinning


def ring_hostfile(first_port: int, num_ranks: int) -> list[list[str]]:
    """mlx.launch's ring hostfile for ``num_ranks`` ranks on this host, one connection each."""
    return [[f"127.0.0.1:{first_port + rank}"] for rank in range(num_ranks)]


def rank_environment(base: dict[str, str], rank: int, hostfile_path: str) -> dict[str, str]:
    return {**base, "MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile_path}


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class RankSupervisor:
    """The ranks as child processes: start, forward stop signals, reap, take the rest down on a failure."""

    commands: list[list[str]]
    environments: list[dict[str, str]]
    log: Callable[..., None]
    pass_fds: list[tuple[int, ...]] = field(default_factory=list)  # per rank: descriptors it inherits
    stop_grace_s: float = STOP_GRACE_S
    procs: list[subprocess.Popen] = field(default_factory=list)
    exit_codes: dict[int, int] = field(default_factory=dict)  # rank -> os.waitstatus_to_exitcode
    first_failure: int | None = None
    _stop_deadline: float | None = None

    def start(self) -> None:
        for rank, (command, environment) in enumerate(zip(self.commands, self.environments)):
            fds = self.pass_fds[rank] if rank < len(self.pass_fds) else ()
            # A process group of its own: a Ctrl-C in the terminal reaches the launcher alone, which passes it
            # to rank 0 once (rank 0 takes a second SIGINT as "exit now").
            self.procs.append(
                subprocess.Popen(command, env=environment, pass_fds=fds, preexec_fn=_die_with_parent, process_group=0)
            )
        self.log("ranks_started", pids=[proc.pid for proc in self.procs])

    def forward(self, signum: int) -> None:
        """A stop signal for the daemon: rank 0 handles it (and stops the others)."""
        self._signal_rank(0, signum)
        self._begin_stop()

    def run(self) -> int:
        """Reap the ranks until all have exited; the launcher's exit status.

        A poll every ``POLL_S`` rather than a blocking wait: a wait that a stop signal interrupts
        is resumed by Python, and the grace period after it must still be counted.
        """
        while len(self.exit_codes) < len(self.procs):
            if self._reap_one():
                continue
            if self._stop_deadline is not None and time.monotonic() >= self._stop_deadline:
                for rank in self._running():
                    self.log("rank_killed", rank=rank, after_s=self.stop_grace_s)
                    self._signal_rank(rank, signal.SIGKILL)
                self._stop_deadline = float("inf")  # killed: only reaping is left
            time.sleep(POLL_S)
        code = self.exit_codes[self.first_failure] if self.first_failure is not None else self.exit_codes.get(0, 0)
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it

    def _reap_one(self) -> bool:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        rank = next((r for r, proc in enumerate(self.procs) if proc.pid == pid), None) if pid else None
        if rank is None:
            return False
        code = os.waitstatus_to_exitcode(status)
        self.procs[rank].returncode = code  # reaped here: Popen must not wait for it again
        self.exit_codes[rank] = code
        self.log("rank_exited", rank=rank, code=code)
        if code != 0 and self.first_failure is None and self._stop_deadline is None:
            self.first_failure = rank  # a failure, not the end of a requested stop
            self._signal_rank(0, signal.SIGTERM)
        if code != 0 or rank == 0:
            self._begin_stop()
        return True

    def _begin_stop(self) -> None:
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.stop_grace_s

    def _running(self) -> list[int]:
        return [rank for rank in range(len(self.procs)) if rank not in self.exit_codes]

    def _signal_rank(self, rank: int, signum: int) -> None:
        if rank in self.exit_codes or rank >= len(self.procs):
            return
        try:
            os.kill(self.procs[rank].pid, signum)
        except ProcessLookupError:
            pass  # exited, not reaped yet


def run_local_ring(num_ranks: int, first_port: int, command: list[str], log: Callable[..., None]) -> int:
    """Run ``command`` as ``num_ranks`` ring ranks on this host until they end; their status."""
    with tempfile.NamedTemporaryFile("w", prefix="prefixd-ring-", suffix=".json", delete=False) as hostfile:
        json.dump(ring_hostfile(first_port, num_ranks), hostfile)
    # One doorbell pipe per follower (distributed/doorbell.py): rank 0 holds every write end, each follower
    # the read end of its own; the launcher closes its copies once the ranks hold theirs.
    pipes = [os.pipe() for _ in range(num_ranks - 1)]
    environments = [rank_environment(dict(os.environ), rank, hostfile.name) for rank in range(num_ranks)]
    environments[0][DOORBELL_LEADER_ENV] = ",".join(str(write) for _, write in pipes)
    for rank, (read, _) in enumerate(pipes, start=1):
        environments[rank][DOORBELL_FOLLOWER_ENV] = str(read)
    pass_fds = [tuple(write for _, write in pipes)] + [(read,) for read, _ in pipes]
    try:
        supervisor = RankSupervisor([command] * num_ranks, environments, log, pass_fds=pass_fds)
        previous = {
            signum: signal.signal(signum, lambda signum, _frame: supervisor.forward(signum))
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }
        try:
            try:
                supervisor.start()
            finally:
                for fd in (fd for pipe in pipes for fd in pipe):
                    os.close(fd)
            return supervisor.run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    finally:
        os.unlink(hostfile.name)


def launch_ranks(num_ranks: int, backend: str, argv: list[str]) -> int:
    """Run this same command on ``num_ranks`` local ranks until they end; their exit status.

    Over the ring backend (``any`` on a machine without CUDA) they are this process's children
    (run_local_ring); any other backend becomes ``mlx.launch`` (this call then never returns).
    """
    # The ring backend listens on one port per rank, from 32323 by default: two daemons on one
    # machine would collide there, so each takes ports that are free now.
    first_port = free_port_range(num_ranks)
    command = [sys.executable, "-m", "prefixd.daemon", *argv]
    if backend == "ring" or (backend == "any" and not _cuda_available()):
        import structlog

        log = structlog.get_logger("prefixd.ranks")
        return run_local_ring(num_ranks, first_port, command, lambda event, **fields: log.info(event, **fields))
    launcher = Path(sys.executable).with_name("mlx.launch")
    launcher = str(launcher) if launcher.is_file() else shutil.which("mlx.launch")
    if launcher is None:
        raise FileNotFoundError(
            f"--ranks over {backend} needs MLX's launcher, mlx.launch, beside this Python or on PATH"
        )
    backend_args = [] if backend == "any" else ["--backend", backend]
    os.execv(launcher, [launcher, "-n", str(num_ranks), *backend_args, "-p", str(first_port), "--python", *command])


def _cuda_available() -> bool:
    """What mlx.launch asks to pick a backend for ``any`` (nccl with CUDA, else ring), asked in a child:
    this process has not loaded its BLAS yet, and must not import MLX before it does."""
    probe = subprocess.run(
        [sys.executable, "-c", "import mlx.core as mx; print(mx.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    return probe.stdout.strip() == "True"


def free_port_range(num_ports: int, first: int = 32323, last: int = 60000) -> int:
    """The first of ``num_ports`` consecutive loopback ports that are free now, from ``first`` on."""
    for start in range(first, last, num_ports):
        try:
            for port in range(start, start + num_ports):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return start
    raise OSError(f"no {num_ports} consecutive free ports between {first} and {last} for the ranks")
