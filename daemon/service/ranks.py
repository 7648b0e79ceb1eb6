"""One daemon across several processes (ranks): ``prefixd serve --ranks N`` and a rank's own start.

``--ranks N`` (N > 1) in a process that no launcher started runs the same command
line on N local ranks (rank_launcher.py); on several machines or GPUs run
mlx.launch yourself with a hostfile (docs/scaling.md, *One daemon across several
processes*). In a process a launcher started, the engine takes its inputs from
the lock-step of the ranks (daemon/distributed/): rank 0 serves, the others follow.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..distributed.lockstep import LockstepInputs
from ..distributed.settings import DistributedSettings
from ..engine.engine import Engine
from ..engine.inbox import Inbox
from .server import ServerSettings


def distributed_engine(settings: ServerSettings, args: argparse.Namespace) -> Engine:
    """This rank's engine; refuses what does not work across ranks yet, with a message saying so."""
    if settings.disk_cache is not None:
        raise ValueError(
            "--disk-cache-bytes is not available on a daemon spanning several ranks yet "
            "(each rank holds its own shard of every KV entry); leave it at 0"
        )
    if settings.engine.batch_step == "ragged":
        raise ValueError(
            "--batch-step ragged is not available on a daemon spanning several ranks yet "
            "(its load-time check runs passes a pipeline rank can fail halfway); leave it at auto or padded"
        )
    # The shadow check re-runs prompts whenever this rank is idle, outside the lock-step: off.
    # Models load at start and stay (below): no keep-alive, no model-memory limit.
    # Decode rows stay padded: ragged is checked at load by passes every rank must run alike (a pipeline
    # rank's model ties its send to ``cache.keys``, which a ragged layer has not), and is not measured here.
    engine_settings = dataclasses.replace(
        settings.engine, shadow_rate=0.0, keep_alive_s=-1.0, max_model_bytes=0, batch_step="padded"
    )
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
