"""Hybrid models' short convolutions as shifted multiply-adds on CUDA, where a new pass length costs a build.

Why: LFM2's ShortConv layers run a depthwise ``nn.Conv1d`` (kernel
``conv_L_cache``, 3 wide) over the new tokens and the two before them. MLX's
CUDA backend hands a convolution to cuDNN, which prepares it per input
shape. A cache hit's tail (a chat turn, an edit) has a new length on nearly
every request, and on a GPU such a tail costs several times more at a new
length than at one met before (bench/probes/conv_shape_probe.py measures the
two forms; the figures are in docs/decisions.md).

A depthwise convolution of K taps is K shifted multiply-adds: elementwise
kernels, the same ones at every length, nothing prepared per shape. Each
output position is a sum over the same K products whatever the pass's
length, so a tail computes exactly what a full prefill computes at that
position, and cached answers stay identical to uncached ones. The sum is
kept in float32 (as a convolution kernel accumulates) and rounded once.

Decode steps take this form too: with cuDNN's the first steps at each batch
size cost seconds, and later steps cost the same in either form within the
noise (so a one-kernel ``mx.fast.cuda_kernel`` version would buy nothing).

Elsewhere (Metal, CPU) MLX's own convolution stays: it has no per-shape cost there.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cuda import choose_form

MODES = ("auto", "native", "shifted")


class ShiftedDepthwiseConv(nn.Module):
    """``conv(x)`` of a depthwise, unpadded, stride-1 ``nn.Conv1d``, as K shifted multiply-adds."""

    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        self.weight = conv.weight  # (channels, K, 1)
        if "bias" in conv:
            self.bias = conv.bias

    def __call__(self, x: mx.array) -> mx.array:
        taps = self.weight.shape[1]
        length = x.shape[1] - taps + 1
        weight = self.weight[:, :, 0].astype(mx.float32)
        if length == 1:  # a decode step: one product and one sum, fewer kernels than K multiply-adds
            out = mx.sum(x.astype(mx.float32) * weight.T, axis=1, keepdims=True)
        else:
            out = x[:, :length, :].astype(mx.float32) * weight[:, 0]
            for k in range(1, taps):
                out = out + x[:, k : k + length, :].astype(mx.float32) * weight[:, k]
        if "bias" in self:
            out = out + self.bias.astype(mx.float32)
        return out.astype(x.dtype)


def resolve_mode(mode: str) -> str:
    """``auto``: shifted on a CUDA GPU (where cuDNN prepares each new length), native elsewhere."""
    return choose_form(mode, MODES, "short convolution mode", on_cuda_form="shifted", elsewhere="native")


def install(model: Any, mode: str = "auto") -> str:
    """Swap each depthwise short convolution of the model for the shifted form if ``mode`` says so; the form in use."""
    if resolve_mode(mode) != "shifted":
        return "native"
    swapped = 0
    for module in _modules(model):
        conv = getattr(module, "conv", None)
        if isinstance(conv, nn.Conv1d) and _is_plain_depthwise(conv):
            module.conv = ShiftedDepthwiseConv(conv)
            swapped += 1
    return "shifted" if swapped else "native"


def _is_plain_depthwise(conv: nn.Conv1d) -> bool:
    channels, _, per_group = conv.weight.shape
    return conv.groups == channels and per_group == 1 and conv.padding == 0 and conv.stride == 1 and conv.dilation == 1


def _modules(model: Any) -> list[Any]:
    modules = getattr(model, "modules", None)
    return list(modules()) if callable(modules) else []
