"""One prefixd across several processes (ranks) on MLX's own distributed backends.

Started by ``mlx.launch`` (ring, JACCL, NCCL or MPI), every rank loads its
shard of each model with mlx-lm's ``sharded_load`` (tensor parallel) and runs
the same engine code in lock-step. Rank 0 runs the fronts and the inbox; once
per engine iteration it broadcasts what that iteration consumes (new jobs with
their token ids, cancellations, store-changing control calls, a clock
reading), and every rank's scheduler and prefix store then take the very same
decisions, so every rank's KV shard sits under the same radix nodes.

Modules, one job each: ``settings`` (what the command line chose),
``channel`` (the collectives, and the error a lost rank raises),
``messages`` (what one iteration broadcasts), ``sharded_loading``,
``handshake`` (refuse a rank with another model, version or settings),
``lockstep`` (the input source every rank's engine runs on), ``lockstep_controls``
(store-changing control calls on every rank), ``watchdog`` (a silent rank),
``follower`` (the process of a rank other than 0). ``service/ranks.py``
starts them.
"""

from .settings import DistributedSettings, DistributedStartError, started_by_launcher

__all__ = ["DistributedSettings", "DistributedStartError", "started_by_launcher"]
