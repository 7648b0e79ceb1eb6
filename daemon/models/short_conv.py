"""Hybrid models' short convolutions as shifted multiply-adds on CUDA, where a new pass length costs a build.

Why: LFM2's ShortConv layers run a depthwise ``nn.Conv1d`` (kernel
``conv_L_cache``, 3 wide) over the new tokens and the two before them. MLX's
CUDA backend hands a convolution to cuDNN, which prepares it per input
shape. A cache hit's tail (a chat turn, an edit) has a new length on nearly
every request, and on an H200 lfm2's 32-token chat tails took 263-279 ms at a
new length against 30 ms at a length met before (bench/results/gpu/2026-12-04-c,
run 5; bench/conv_shape_probe.py measures the two forms).

A depthwise convolution of K taps is K shifted multiply-adds: elementwise
kernels, the same ones at every length, nothing prepared per shape. Each
output position is a sum over the same K products whatever the pass's
length, so a tail computes exactly what a full prefill computes at that
position, and cached answers stay identical to uncached ones. The sum is
kept in float32 (as a convolution kernel accumulates) and rounded once.

On CUDA the same sum runs as one small kernel of its own (``mx.fast.cuda_kernel``,
compiled once and kept with MLX's other compiled kernels): K multiply-adds per
output in float32, one launch per layer instead of seven, which a decode step
of a small model notices (bench/conv_shape_probe.py: the elementwise form cost
0.2-0.4 ms more per step than cuDNN's on an H200). At install it is checked
against the elementwise form on random input; a kernel that fails to build or
disagrees is not used, and the elementwise form serves (logged).

Elsewhere (Metal, CPU) MLX's own convolution stays: it has no per-shape cost there.
"""

from __future__ import annotations

from typing import Any

import types

import mlx.core as mx
import mlx.nn as nn
import structlog

from ..cuda import on_cuda

log = structlog.get_logger()

MODES = ("auto", "native", "shifted", "kernel")


class ShiftedDepthwiseConv(nn.Module):
    """``conv(x)`` of a depthwise, unpadded, stride-1 ``nn.Conv1d``, as K shifted multiply-adds."""

    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        self.weight = conv.weight  # (channels, K, 1)
        if "bias" in conv:
            self.bias = conv.bias
        # The taps in float32, (channels, K), made once; held outside the module's parameters.
        self._float32 = types.SimpleNamespace(taps=mx.contiguous(conv.weight[:, :, 0].astype(mx.float32)))

    def __call__(self, x: mx.array) -> mx.array:
        taps = self.weight.shape[1]
        length = x.shape[1] - taps + 1
        weight = self._float32.taps
        if length == 1:  # a decode step: one product and one sum, fewer kernels than K multiply-adds
            out = mx.sum(x.astype(mx.float32) * weight.T, axis=1, keepdims=True)
        else:
            out = x[:, :length, :].astype(mx.float32) * weight[:, 0]
            for k in range(1, taps):
                out = out + x[:, k : k + length, :].astype(mx.float32) * weight[:, k]
        if "bias" in self:
            out = out + self.bias.astype(mx.float32)
        return out.astype(x.dtype)


_KERNEL_SOURCE = """
    size_t elem = cooperative_groups::this_grid().thread_rank();
    size_t channels = x_shape[2];
    size_t length_in = x_shape[1];
    size_t num_taps = taps_shape[1];
    size_t length_out = length_in - num_taps + 1;
    if (elem >= x_shape[0] * length_out * channels) {
        return;
    }
    size_t channel = elem % channels;
    size_t row_position = elem / channels;
    size_t position = row_position % length_out;
    size_t row = row_position / length_out;
    const T* first = x + (row * length_in + position) * channels + channel;
    float sum = 0.0f;
    for (size_t k = 0; k < num_taps; ++k) {
        sum += static_cast<float>(first[k * channels]) * taps[channel * num_taps + k];
    }
    out[elem] = static_cast<T>(sum);
"""
_kernel: list[Any] = []  # built once per process


class KernelDepthwiseConv(ShiftedDepthwiseConv):
    """The same sum as ShiftedDepthwiseConv, one CUDA kernel launch per call (no bias: LFM2's convolutions have none)."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _kernel:
            _kernel.append(mx.fast.cuda_kernel(name="prefixd_depthwise_conv", input_names=["x", "taps"],
                                               output_names=["out"], source=_KERNEL_SOURCE))
        taps = self._float32.taps
        length = x.shape[1] - taps.shape[1] + 1
        size = x.shape[0] * length * x.shape[2]
        (out,) = _kernel[0](inputs=[x, taps], template=[("T", x.dtype)], grid=(size, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[(x.shape[0], length, x.shape[2])], output_dtypes=[x.dtype])
        return out


def resolve_mode(mode: str) -> str:
    """``auto``: the kernel (else shifted) on a CUDA GPU, where cuDNN prepares each new length; native elsewhere."""
    if mode not in MODES:
        raise ValueError(f"short convolution mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode != "auto":
        return mode
    return "kernel" if on_cuda() else "native"


def install(model: Any, mode: str = "auto") -> str:
    """Swap each depthwise short convolution of the model for the form ``mode`` asks; the form in use."""
    mode = resolve_mode(mode)
    convs = [(module, module.conv) for module in _modules(model)
             if isinstance(getattr(module, "conv", None), nn.Conv1d) and _is_plain_depthwise(module.conv)]
    if mode == "native" or not convs:
        return "native"
    biasless = [conv for _, conv in convs if "bias" not in conv]
    if mode == "kernel" and (not biasless or not kernel_agrees(biasless[0])):
        mode = "shifted"
    for module, conv in convs:
        use_kernel = mode == "kernel" and "bias" not in conv
        module.conv = KernelDepthwiseConv(conv) if use_kernel else ShiftedDepthwiseConv(conv)
    return mode


def kernel_agrees(conv: nn.Conv1d) -> bool:
    """Whether the kernel builds and computes what the elementwise form computes (on random input, every length kind)."""
    try:
        checked = KernelDepthwiseConv(conv)
        reference = ShiftedDepthwiseConv(conv)
        channels, taps = conv.weight.shape[0], conv.weight.shape[1]
        for shape in ((1, taps, channels), (3, taps + 37, channels)):
            x = mx.random.normal(shape, key=mx.random.key(shape[1])).astype(conv.weight.dtype)
            got, wanted = checked(x), reference(x)
            if not mx.allclose(got.astype(mx.float32), wanted.astype(mx.float32), rtol=1e-2, atol=1e-2).item():
                log.warning("short_conv_kernel_disagrees", using="shifted")
                return False
        return True
    except Exception as exc:  # no CUDA, NVRTC missing, a changed kernel API: the elementwise form serves
        log.warning("short_conv_kernel_unavailable", error=f"{type(exc).__name__}: {exc}", using="shifted")
        return False


def _is_plain_depthwise(conv: nn.Conv1d) -> bool:
    channels, _, per_group = conv.weight.shape
    return (conv.groups == channels and per_group == 1 and conv.padding == 0 and conv.stride == 1
            and conv.dilation == 1)


def _modules(model: Any) -> list[Any]:
    modules = getattr(model, "modules", None)
    return list(modules()) if callable(modules) else []
