"""Real model layers through the matmul form of attention give what MLX's own attention gives.

On a CPU MLX's multi-token attention is this very formulation, so the logits
must be bit-identical: any difference is a mask or a head-grouping mistake in
tail_attention.py (the attention-only llama, the hybrid lfm2, gemma3's
sliding-window layers with their array masks, each a cold pass and a tail on
a warm cache, alone and as a left-padded batch).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from prefixd.daemon.models import tail_attention
from prefixd.daemon.models.loaded_model import load_model


@pytest.fixture(params=["llama", "lfm2", "gemma3"])
def loaded(request):
    model = load_model(str(request.getfixturevalue(f"tiny_{request.param}_dir")), attention="matmul")
    yield model
    tail_attention._state["mode"] = "fused"


def _cold_then_tail(model, tokens: list[int], split: int) -> tuple[mx.array, mx.array]:
    cache = make_prompt_cache(model)
    cold = model(mx.array(tokens[:split])[None], cache=cache)
    tail = model(mx.array(tokens[split:])[None], cache=cache)
    mx.eval(cold, tail)
    return cold, tail


def test_cold_pass_and_warm_tail_match_mlx_attention(loaded):
    assert loaded.attention == "matmul"
    tokens = [(i * 37) % 1500 + 20 for i in range(90)]  # past the tiny gemma3's 32-token window
    before = tail_attention.matmul_passes()
    routed = _cold_then_tail(loaded.model, tokens, 70)
    assert tail_attention.matmul_passes() > before
    tail_attention._state["mode"] = "fused"
    plain = _cold_then_tail(loaded.model, tokens, 70)
    tail_attention._state["mode"] = "matmul"
    for a, b in zip(routed, plain):
        assert mx.array_equal(a, b).item()


def test_a_left_padded_batch_matches_mlx_attention(loaded):
    from mlx_lm.generate import BatchGenerator

    prompts = [[(i * 11 + row) % 1500 + 20 for i in range(length)] for row, length in enumerate((9, 40, 23))]

    def answers() -> list[list[int]]:
        gen = BatchGenerator(loaded.model, max_tokens=6, stop_tokens=set())
        uids = gen.insert(prompts)
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while any(len(tokens) < 6 for tokens in out.values()):
            _, responses = gen.next()  # (prompt progress, generation responses)
            for r in responses:
                out[r.uid].append(r.token)
        gen.close()
        return [out[uid] for uid in uids]

    routed = answers()
    tail_attention._state["mode"] = "fused"
    plain = answers()
    tail_attention._state["mode"] = "matmul"
    assert routed == plain and all(len(a) == 6 for a in routed)


def test_the_padded_decode_kernel_gives_way_to_matmul_where_it_cannot_build(tiny_llama_dir):
    """``--attention kernel`` on a machine without CUDA: the kernel is checked at load, fails, and matmul serves."""
    if mx.default_device().type == mx.gpu and not mx.metal.is_available():
        pytest.skip("on CUDA the kernel builds")
    try:
        loaded = load_model(str(tiny_llama_dir), attention="kernel")
        assert loaded.attention == "matmul"
    finally:
        tail_attention._state["mode"] = "fused"
