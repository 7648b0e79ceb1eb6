"""A few rows through the linear layers as one matrix-vector product per row (models/row_linear.py, CUDA's form).

The form must compute ``x @ W.T`` (to rounding), leave longer passes and
other layers alone, and a model in it must decode a batch as it decodes each
sequence alone: the greedy answers of a batch equal the uncached solo ones.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.engine.inline_runner import run_inline, run_one_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.models import row_linear
from prefixd.daemon.models.loaded_model import load_model
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput


def job(tokens: list[int], use: bool = True, max_tokens: int = 12) -> GenerateJob:
    params = GenerateParams(prompt=PromptInput(tokens=tuple(tokens)), max_tokens=max_tokens,
                            cache=CacheOptions(use=use, store=use))
    return GenerateJob("test", 1, params, emit=lambda kind, payload: None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [(2, 1, 48), (8, 1, 48), (1, 5, 48), (2, 3, 48), (1, 1, 48), (1, 12, 48)])
def test_the_rows_form_is_the_linear_layer(shape, dtype, bias):
    layer = nn.Linear(48, 40, bias=bias)
    layer.set_dtype(dtype)
    x = mx.random.normal(shape).astype(dtype)
    expected = layer(x)
    layer.__class__ = row_linear.RowwiseLinear
    rows = shape[0] * shape[1]
    assert row_linear.takes_rows(x) == (2 <= rows <= row_linear.MAX_ROWS)  # the others take nn.Linear's own body
    got = layer(x)
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    assert got.shape == expected.shape == (*shape[:-1], 40) and got.dtype == dtype
    assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), atol=tolerance, rtol=tolerance).item()


def test_one_row_long_passes_and_large_weights_keep_the_matmul():
    assert not row_linear.takes_rows(mx.zeros((1, 1, 48)))  # MLX already runs one row as a gemv
    assert not row_linear.takes_rows(mx.zeros((1, row_linear.MAX_ROWS + 1, 48)))

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.Linear(48, 40)
            self.large = nn.Linear(1024, row_linear.MAX_WEIGHT_BYTES // 4096 + 1, bias=False)  # float32

    holder = Holder()
    assert row_linear.install(holder, "rows") == "rows"
    assert type(holder.small) is row_linear.RowwiseLinear and type(holder.large) is nn.Linear
    x = mx.random.normal((2, 1, 48))
    assert mx.allclose(holder.small(x), x @ holder.small.weight.T + holder.small.bias, atol=1e-5).item()


def test_the_tied_output_projection_takes_the_form_too():
    embedding = nn.Embedding(100, 16)
    x = mx.random.normal((4, 1, 16))
    expected = embedding.as_linear(x)
    embedding.__class__ = row_linear.RowwiseEmbedding
    assert mx.allclose(embedding.as_linear(x), expected, atol=1e-5).item()
    assert mx.array_equal(embedding(mx.array([3, 7])), embedding.weight[mx.array([3, 7])]).item()


def test_auto_keeps_the_matmul_on_a_cpu_and_a_bad_mode_is_refused(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    assert loaded.linear == "matmul"
    assert not any(isinstance(m, row_linear.RowwiseLinear) for m in loaded.model.modules())
    with pytest.raises(ValueError, match="auto, matmul, rows"):
        row_linear.install(loaded.model, "gemv")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def rowwise_llama(request, tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), dtype=request.param, linear="rows")
    assert loaded.linear == "rows"
    swapped = [m for m in loaded.model.modules() if isinstance(m, row_linear.RowwiseLinear)]
    assert swapped and all(isinstance(m, nn.Linear) for m in swapped)
    return loaded


def test_a_decode_batch_in_the_rows_form_answers_as_each_sequence_alone(rowwise_llama):
    loaded = rowwise_llama
    shared = [(i * 31) % 1200 + 40 for i in range(150)]
    prompts = [shared + [(i * 7 + row) % 1000 + 50 for i in range(5 + 4 * row)] for row in range(4)]
    alone = [run_one_inline(job(p, use=False), loaded, None, 64)["text"] for p in prompts]
    together = run_inline([job(p) for p in prompts], loaded, PrefixStore(max_bytes=1 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28), 64)
    assert [result["text"] for result in together] == alone
