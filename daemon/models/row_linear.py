"""A few rows through a linear layer as one matrix-vector product per row, on CUDA.

Why: a decode batch of B sequences sends B rows through every linear layer of
the model. MLX's CUDA matmul runs one row (a single sequence's step) in its own
matrix-vector kernel, but ``x @ W.T`` folds two rows or more into one matrix and
hands it to cuBLASLt (mlx/ops.cpp ``matmul`` flattens x; mlx/backend/cuda/
matmul.cpp ``gemm_and_bias`` takes gemv only for M == 1). A small model's
step is a few hundred such matmuls, and on an H100 two rows through cuBLASLt
cost 2.3-2.8x one row's gemv per layer shape (bench/probes/row_linear_probe.py;
the figures are in docs/decisions.md).

Asked as ``W @ x_i`` for every row i at once (the rows as a batch of column
vectors, the weight shared with batch stride 0), MLX takes its batched gemv
kernel instead: one launch, every row computed by the kernel a single row gets.

The kernel reads the weight once per row, so this form is kept to at most
``MAX_ROWS`` rows (measured up to 8) and to weights of at most
``MAX_WEIGHT_BYTES``: on the H100 every layer weight of 2-6 MiB was faster
this way at 2-8 rows, and the 96 MiB output projection slower (1.2x at 2
rows, 3x at 8); the bound between them is not measured. Longer passes (a
prompt's chunks) keep the matmul.

Elsewhere (Metal, a CPU) MLX's own matmul stays: on this project's CPU the
rows form is slower at every row count (BLAS handles a few rows well).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cuda import choose_form

MODES = ("auto", "matmul", "rows")
MAX_ROWS = 8
MAX_WEIGHT_BYTES = 64 << 20


def resolve_mode(mode: str) -> str:
    """``auto``: rows on a CUDA GPU, matmul elsewhere."""
    return choose_form(mode, MODES, "linear mode", on_cuda_form="rows", elsewhere="matmul")


def takes_rows(x: mx.array) -> bool:
    return 2 <= x.size // x.shape[-1] <= MAX_ROWS


def rows_times_weight(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for every row of x as ``weight @ row``: one batched matrix-vector kernel."""
    rows = x.size // x.shape[-1]
    columns = weight @ x.reshape(rows, x.shape[-1], 1)  # (rows, out, 1); weight broadcast with stride 0
    return columns.reshape(*x.shape[:-1], weight.shape[0])


class RowwiseLinear(nn.Linear):
    """``nn.Linear`` whose few-row inputs take ``rows_times_weight``.

    Every other input takes ``nn.Linear``'s own body, written out here: this
    runs a few hundred times per decode step, and a call through ``super()``
    cost 0.7 µs over ``nn.Linear``'s 2.4 µs per call on this project's CPU,
    against 0.3 µs this way.
    """

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if takes_rows(x):
            y = rows_times_weight(x, weight)
            return y + self["bias"] if "bias" in self else y
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight.T)
        return x @ weight.T


class RowwiseEmbedding(nn.Embedding):
    """``nn.Embedding`` whose output projection (tied weights: ``as_linear``) does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        return rows_times_weight(x, self.weight) if takes_rows(x) else x @ self.weight.T


def install(model: Any, mode: str = "auto") -> str:
    """Give the model's plain linear layers and embeddings the few-row form if ``mode`` says so; the form in use.

    The layers keep their class's behaviour and their arrays; only their class
    changes, so checks like ``isinstance(layer, nn.Linear)`` still hold. A
    layer whose weight is over ``MAX_WEIGHT_BYTES`` is left as it is.
    """
    if resolve_mode(mode) != "rows":
        return "matmul"
    swapped = 0
    for module in _modules(model):
        if type(module) not in _ROWWISE or module["weight"].nbytes > MAX_WEIGHT_BYTES:
            continue
        module.__class__ = _ROWWISE[type(module)]
        swapped += 1
    return "rows" if swapped else "matmul"


_ROWWISE = {nn.Linear: RowwiseLinear, nn.Embedding: RowwiseEmbedding}


def _modules(model: Any) -> list[Any]:
    modules = getattr(model, "modules", None)
    return list(modules()) if callable(modules) else []
