"""The daemon's MLX environment defaults: set where the operator set nothing, never over the operator's value."""

from __future__ import annotations

from prefixd.daemon.models.mlx_runtime_env import DAEMON_DEFAULTS, apply_daemon_defaults


def test_the_cache_thrashing_fuse_is_off_unless_the_operator_says_otherwise():
    environ: dict[str, str] = {}
    assert apply_daemon_defaults(environ) == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
    assert environ == DAEMON_DEFAULTS

    operator = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    assert apply_daemon_defaults(operator) == {}
    assert operator == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
