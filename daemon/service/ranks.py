"""One daemon across several processes (ranks): ``prefixd serve --ranks N`` and a rank's own start.

``--ranks N`` (N > 1) in a process that mlx.launch did not start replaces it
with ``mlx.launch -n N`` running the same command line on N local ranks; on
several machines or GPUs run mlx.launch yourself with a hostfile (docs/scaling.md,
*One daemon across several processes*). In a process mlx.launch started, the engine takes its
inputs from the lock-step of the ranks (daemon/distributed/): rank 0 serves, the others follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import sys
from pathlib import Path

from ..distributed.lockstep import LockstepInputs
from ..distributed.settings import DistributedSettings
from ..engine.engine import Engine
from ..engine.inbox import Inbox
from .server import ServerSettings


def launch_ranks(num_ranks: int, backend: str, argv: list[str]) -> None:
    """Become ``mlx.launch`` running this same command on ``num_ranks`` local ranks (never returns)."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    launcher = str(launcher) if launcher.is_file() else shutil.which("mlx.launch")
    if launcher is None:
        raise FileNotFoundError("--ranks needs MLX's launcher, mlx.launch, beside this Python or on PATH")
    backend_args = [] if backend == "any" else ["--backend", backend]
    # The ring backend listens on one port per rank, from 32323 by default: two daemons on one
    # machine would collide there, so each takes ports that are free now.
    port_args = ["-p", str(free_port_range(num_ranks))]
    os.execv(
        launcher,
        [
            launcher,
            "-n",
            str(num_ranks),
            *backend_args,
            *port_args,
            "--python",
            sys.executable,
            "-m",
            "prefixd.daemon",
            *argv,
        ],
    )


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


def distributed_engine(settings: ServerSettings, args: argparse.Namespace) -> Engine:
    """This rank's engine; refuses what does not work across ranks yet, with a message saying so."""
    if settings.disk_cache is not None:
        raise ValueError(
            "--disk-cache-bytes is not available on a daemon spanning several ranks yet "
            "(each rank holds its own shard of every KV entry); leave it at 0"
        )
    # The shadow check re-runs prompts whenever this rank is idle, outside the lock-step: off.
    # Models load at start and stay (below): no keep-alive, no model-memory limit.
    engine_settings = dataclasses.replace(settings.engine, shadow_rate=0.0, keep_alive_s=-1.0, max_model_bytes=0)
    inputs = LockstepInputs(
        Inbox(engine_settings.max_queued, engine_settings.max_queued_per_client),
        DistributedSettings(
            backend=args.distributed_backend,
            rank_timeout_seconds=args.rank_timeout,
            load_timeout_seconds=settings.load_timeout_seconds,
            parallel=args.parallel,
        ),
    )
    # Each rank loads its shard of every model, at start, whole, and keeps it: a load or an unload is a
    # collective (the sharded weights) and would split the ranks unless every rank did it at the same
    # step. No warm-up: every rank would have to run the same passes.
    return Engine(
        inputs,
        engine_settings,
        load_weights=inputs.load_shard,
        loads_on_demand=False,
        unloads_idle=False,
        warms_up=False,
    )
