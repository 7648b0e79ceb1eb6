"""MLX settings a long-lived daemon needs, put in the environment before MLX reads them.

MLX's CUDA backend keeps its cuDNN attention graphs (one per exact query/key
shape) and its CUDA graphs in LRU caches, and by default counts every miss
over the process's lifetime: once the misses pass twice a cache's capacity,
every further miss raises "Cache thrashing is happening" out of the
evaluation (mlx/backend/cuda/lru_cache.h, MLX_ENABLE_CACHE_THRASHING_CHECK),
and a commit that fails that way can leave the stream's encoder unusable. A
script meets a few shapes; a daemon meets a new one with nearly every cold
prompt (the last prefill chunk has a new length at a new depth), so after some
hundreds of distinct prompts every request would fail, on every model, until
a restart. The caches still evict least-recently-used entries with the check
off (MLX's own test runner turns it off the same way).

A guard for the MLX builds that have the check: not every wheel trips it
(bench/probes/cuda_cache_fuse.py shows whether one does; docs/decisions.md),
and pyproject.toml allows newer MLX.

MLX's CUDA backend also compiles some kernels at their first use (NVRTC) and
keeps what it compiled under the system's temporary directory
(``/tmp/mlx/<version>/ptx``), which a reboot or a service's private /tmp
empties; then the daemon's load-time warm-up (engine/warm_up.py) compiles
them again, tens of seconds on a GPU against under a second with them on disk.
So the daemon keeps them in its own cache directory, per MLX version
(``MLX_PTX_CACHE_DIR``).

An operator's own value is kept. MLX reads these when it first builds each
cache, so setting them before the engine's first GPU pass is enough; the
daemon does it before importing MLX at all.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from importlib import metadata
from pathlib import Path

DAEMON_DEFAULTS = {
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
}


def kernel_cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Where MLX keeps the kernels it compiles: the daemon's cache directory, per MLX version."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(environ.get("XDG_CACHE_HOME") or Path(environ.get("HOME") or Path.home()) / ".cache")
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return str(base / "prefixd" / "mlx-kernels" / version)


def apply_daemon_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each default the environment lacks; returns what was set (for the start-up log)."""
    applied = {}
    for name, value in {**DAEMON_DEFAULTS, "MLX_PTX_CACHE_DIR": kernel_cache_dir(environ)}.items():
        if name not in environ:
            environ[name] = value
            applied[name] = value
    return applied
