"""The shifted form of a hybrid model's short convolutions (models/short_conv.py, the form used on CUDA).

It must compute what MLX's convolution computes (to rounding), and, since a
tail's positions are computed exactly as a full prefill computes them, a
cached answer must stay the uncached answer, in float32 and in bfloat16.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.engine.inline_runner import run_inline, run_one_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.models import short_conv
from prefixd.daemon.models.loaded_model import load_model
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput


def job(tokens: list[int], use: bool = True, max_tokens: int = 10) -> GenerateJob:
    params = GenerateParams(prompt=PromptInput(tokens=tuple(tokens)), max_tokens=max_tokens,
                            cache=CacheOptions(use=use, store=use))
    return GenerateJob("test", 1, params, emit=lambda kind, payload: None)


def store() -> PrefixStore:
    return PrefixStore(max_bytes=1 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)


def short_convs(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "ShortConv"]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_shifted_form_is_the_depthwise_convolution(bias, dtype):
    conv = nn.Conv1d(16, 16, 3, groups=16, bias=bias)
    if bias:
        conv.bias = mx.random.normal((16,))
    conv.set_dtype(dtype)
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    for length in (9, 3):  # a pass of 7 new positions, and a decode step's one
        x = mx.random.normal((2, length, 16)).astype(dtype)
        shifted = short_conv.ShiftedDepthwiseConv(conv)(x)
        native = conv(x)
        assert shifted.shape == native.shape == (2, length - 2, 16) and shifted.dtype == dtype
        assert mx.allclose(shifted.astype(mx.float32), native.astype(mx.float32), atol=tolerance, rtol=tolerance).item()


def test_other_convolutions_are_left_alone():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 3, padding=1, groups=8)  # padded: not the short convolution's shape

    holder = Holder()
    assert short_conv.install(holder, "shifted") == "native" and isinstance(holder.conv, nn.Conv1d)
    with pytest.raises(ValueError, match="native, shifted"):
        short_conv.install(holder, "fast")


def test_auto_keeps_mlx_convolution_on_a_cpu(tiny_lfm2_dir):
    loaded = load_model(str(tiny_lfm2_dir))
    assert loaded.short_conv == "native"
    assert all(isinstance(layer.conv, nn.Conv1d) for layer in short_convs(loaded.model))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def shifted_lfm2(request, tiny_lfm2_dir):
    loaded = load_model(str(tiny_lfm2_dir), dtype=request.param, conv="shifted")
    assert loaded.short_conv == "shifted"
    layers = short_convs(loaded.model)
    assert layers and all(isinstance(layer.conv, short_conv.ShiftedDepthwiseConv) for layer in layers)
    return loaded


def test_a_tail_on_a_warm_cache_gives_the_cold_pass_logits(shifted_lfm2, tiny_lfm2_dir):
    model = shifted_lfm2.model
    tokens = [(i * 29) % 900 + 30 for i in range(75)]
    cold_cache = make_prompt_cache(model)
    cold = model(mx.array(tokens)[None], cache=cold_cache)[0]
    warm_cache = make_prompt_cache(model)
    model(mx.array(tokens[:61])[None], cache=warm_cache)
    tail = model(mx.array(tokens[61:])[None], cache=warm_cache)[0]
    native = load_model(str(tiny_lfm2_dir), dtype=shifted_lfm2.dtype).model(mx.array(tokens)[None])[0]
    tolerance = 1e-4 if shifted_lfm2.dtype == "float32" else 0.1
    assert mx.allclose(tail, cold[61:], atol=tolerance, rtol=tolerance).item()
    assert mx.allclose(cold, native, atol=tolerance, rtol=tolerance).item()
    if shifted_lfm2.dtype == "float32":
        assert mx.array_equal(mx.argmax(tail, axis=-1), mx.argmax(native[61:], axis=-1)).item()


def test_greedy_cached_answers_equal_uncached_with_the_shifted_form(shifted_lfm2):
    loaded = shifted_lfm2
    tokens = [(i * 31) % 1200 + 40 for i in range(150)]
    prefixes = store()
    cold = run_one_inline(job(tokens, use=False), loaded, None, 64)
    first = run_one_inline(job(tokens), loaded, prefixes, 64)
    repeat = run_one_inline(job(tokens), loaded, prefixes, 64)
    assert repeat["cache"]["hit"] == "exact" and first["text"] == cold["text"] == repeat["text"]
    prompts = [tokens + [(i * 7 + row) % 1000 + 50 for i in range(5 + 4 * row)] for row in range(3)]
    together = run_inline([job(p) for p in prompts], loaded, prefixes, 64)
    for prompt, result in zip(prompts, together):
        assert result["cache"]["reused_tokens"] >= 128
        assert result["text"] == run_one_inline(job(prompt, use=False), loaded, None, 64)["text"]
