"""The daemon's MLX environment defaults: set where the operator set nothing, never over the operator's value."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from prefixd.daemon.models.mlx_runtime_env import apply_daemon_defaults


def test_the_cache_thrashing_fuse_is_off_unless_the_operator_says_otherwise():
    environ: dict[str, str] = {}
    assert apply_daemon_defaults(environ)["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    assert environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"

    operator = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1", "MLX_PTX_CACHE_DIR": "/srv/kernels"}
    assert apply_daemon_defaults(operator) == {}
    assert operator == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1", "MLX_PTX_CACHE_DIR": "/srv/kernels"}


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS keeps caches in ~/Library/Caches")
def test_compiled_kernels_are_kept_in_the_daemons_cache_directory_per_mlx_version(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    applied = apply_daemon_defaults(environ)
    expected = tmp_path / "prefixd" / "mlx-kernels" / metadata.version("mlx")
    assert applied["MLX_PTX_CACHE_DIR"] == environ["MLX_PTX_CACHE_DIR"] == str(expected)
