"""Whether MLX runs on a CUDA GPU: where per-shape builds and CUDA graphs shape what the engine does.

Several choices depend on it (tail_attention.py, short_conv.py, kv/fork.py):
MLX's CUDA backend prepares cuDNN plans per shape and replays evaluations as
CUDA graphs cached by topology; Metal and the CPU do neither.
"""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()


def choose_form(mode: str, modes: tuple[str, ...], what: str, on_cuda_form: str, elsewhere: str) -> str:
    """A form setting's value: itself, or for ``auto`` the form measured best here (a CUDA GPU or elsewhere).

    Raises ValueError naming ``what`` when ``mode`` is not one of ``modes``.
    """
    if mode not in modes:
        raise ValueError(f"{what} must be one of {', '.join(modes)}, not {mode!r}")
    if mode != "auto":
        return mode
    return on_cuda_form if on_cuda() else elsewhere
