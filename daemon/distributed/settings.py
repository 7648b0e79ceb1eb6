"""What the command line chose for a daemon that spans several ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Backends mx.distributed.init accepts; "any" takes the first that works
# (what mlx.launch set up: MLX_HOSTFILE for ring, NCCL_HOST_IP for nccl, ...).
BACKENDS = ("any", "ring", "nccl", "jaccl", "mpi")
# How a model is split over the ranks (sharded_loading.py): mlx-lm's shard() or its pipeline().
PARALLEL_MODES = ("tensor", "pipeline")


class DistributedStartError(Exception):
    """The ranks cannot serve together (another model or version on a rank, a model that does not shard)."""


@dataclass(frozen=True)
class DistributedSettings:
    backend: str  # one of BACKENDS
    rank_timeout_seconds: float  # an engine iteration taking longer means a rank is stuck or gone
    load_timeout_seconds: float = 600.0  # loading the models and the handshake, on every rank
    parallel: str = "tensor"  # one of PARALLEL_MODES

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"unknown parallel mode {self.parallel!r}: one of {', '.join(PARALLEL_MODES)}")
        if self.rank_timeout_seconds <= 0:
            raise ValueError("the rank timeout must be positive")


def started_by_launcher(environ=os.environ) -> bool:
    """True in a process that mlx.launch started (it sets MLX_RANK for every backend)."""
    return "MLX_RANK" in environ


def launcher_rank(environ=os.environ) -> int:
    """This process's rank as mlx.launch numbered it (0: the one that serves)."""
    return int(environ["MLX_RANK"])
