"""Ranks on one host share its cores: each rank's BLAS gets its share of threads, not all of them.

Every rank's OpenBLAS (models/blas.py) starts one thread per core and keeps
them spinning after each matmul. Two ranks on two cores then run four
spinning BLAS threads beside the ring backend's own, and every collective
waits until the peer it needs is scheduled again: a decode step then costs
several times more, an all_sum tens of times more (docs/decisions.md). So a
rank that shares its host with
other ranks sets ``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` to the cores
divided by the ranks on its host, before the BLAS loads. A value the user
set is kept; ranks on hosts of their own (one rank per machine) are left alone.
"""

from __future__ import annotations

import json
import os
from typing import MutableMapping

THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def ranks_on_this_host(environ: MutableMapping[str, str]) -> int | None:
    """How many ranks share this rank's host, read from mlx.launch's ring hostfile; None when unknown.

    The ring hostfile lists each rank's addresses (``[["127.0.0.1:32323"], ["127.0.0.1:32324"]]``);
    ranks on one host listen on the same address. Other backends' files are not read: None.
    """
    try:
        rank = int(environ["MLX_RANK"])
        with open(environ["MLX_HOSTFILE"]) as handle:
            hosts = json.load(handle)
        own_host = _host(hosts[rank])
        return sum(1 for addresses in hosts if _host(addresses) == own_host)
    except (KeyError, ValueError, OSError, IndexError, TypeError, AttributeError):
        return None


def _host(addresses: list[str]) -> str:
    return addresses[0].rsplit(":", 1)[0]


def share_cpu_threads(environ: MutableMapping[str, str] = os.environ, num_cores: int | None = None) -> dict[str, str]:
    """Set this rank's BLAS threads to its share of the host's cores; returns what it set (nothing: {})."""
    if any(name in environ for name in THREAD_VARIABLES):
        return {}
    num_ranks = ranks_on_this_host(environ)
    if num_ranks is None or num_ranks <= 1:
        return {}
    threads = str(max(1, (num_cores or _usable_cores()) // num_ranks))
    chosen = {name: threads for name in THREAD_VARIABLES}
    environ.update(chosen)
    return chosen


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (a container, taskset)
    except AttributeError:  # macOS
        return os.cpu_count() or 1
