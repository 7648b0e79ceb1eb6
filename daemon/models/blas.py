"""Load an optimized BLAS into the process before MLX, where that helps.

The Linux mlx-cpu wheel bundles netlib's reference BLAS, which runs float32
matmuls at about 5 GFLOPS. If an optimized BLAS exporting the standard cblas
symbols is loaded with RTLD_GLOBAL *before* ``import mlx.core``, MLX resolves
to it instead (about 300 GFLOPS here: prefill 30x faster). This module must
therefore be imported, and ``preload_blas()`` called, before anything imports
mlx. On macOS (Accelerate) and CUDA builds it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_CANDIDATES = (
    "libopenblas.so.0",
    "libopenblasp-r0.so",
    "libopenblas.so",
    "libmkl_rt.so.2",
    "libmkl_rt.so",
)

_loaded: str | None = None


def preload_blas() -> str | None:
    """Load the first optimized BLAS found; return its name, or None.

    Set ``PREFIXD_BLAS=none`` to keep MLX's bundled BLAS (for comparisons),
    or ``PREFIXD_BLAS=/path/to/libblas.so`` to pick one.
    """
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    choice = os.environ.get("PREFIXD_BLAS", "")
    if choice == "none":
        return None
    if "mlx.core" in sys.modules:
        # Too late: MLX already bound its BLAS symbols.
        return None
    for name in [choice] if choice else _CANDIDATES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = name
        return name
    return None
