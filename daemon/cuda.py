"""Whether MLX runs on a CUDA GPU: where per-shape builds and CUDA graphs shape what the engine does.

Several choices depend on it (tail_attention.py, short_conv.py, kv/fork.py):
MLX's CUDA backend prepares cuDNN plans per shape and replays evaluations as
CUDA graphs cached by topology; Metal and the CPU do neither.
"""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()
