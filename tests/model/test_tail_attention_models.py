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


class _PassLengths:
    """A model that records the length of every forward pass (everything else passes through)."""

    def __init__(self, model):
        self.inner, self.lengths = model, []

    def __call__(self, inputs, cache=None):
        self.lengths.append(inputs.shape[1])
        return self.inner(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _answers(loaded, prompts: list[list[int]]) -> list[list[int]]:
    from prefixd.daemon.cache import PrefixStore
    from prefixd.daemon.engine.inline_runner import run_one_inline
    from prefixd.daemon.engine.jobs import GenerateJob
    from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput

    store = PrefixStore(max_bytes=1 << 30, max_nodes=100_000, max_pinned_bytes=1 << 26)
    answers = []
    for tokens in prompts:
        params = GenerateParams(prompt=PromptInput(tokens=tuple(tokens)), max_tokens=6, cache=CacheOptions())
        result = run_one_inline(GenerateJob("test", 1, params, emit=lambda kind, payload: None), loaded, store, 64)
        answers.append(result["tokens"] if "tokens" in result else result["text"])
    return answers


def test_padded_passes_give_the_answers_of_unpadded_ones_and_keep_only_real_tokens(tiny_llama_dir, tiny_lfm2_dir, tiny_gemma3_dir):
    loaded = load_model(str(tiny_llama_dir), attention="matmul")
    try:
        assert loaded.tail_bucket == tail_attention.TAIL_BUCKET
        # padding would enter a conv state or push real tokens out of a window: those models never pad
        assert load_model(str(tiny_lfm2_dir), attention="matmul").tail_bucket == 0
        assert load_model(str(tiny_gemma3_dir), attention="matmul").tail_bucket == 0
        assert load_model(str(tiny_llama_dir), attention="fused").tail_bucket == 0
        base = [(i * 29) % 1500 + 20 for i in range(100)]
        prompts = [base, base + [(i * 13) % 1500 + 20 for i in range(37)], base[:70] + [7, 8, 9]]  # cold, tail of 37, a fork
        loaded.model = recorder = _PassLengths(loaded.model)
        padded = _answers(loaded, prompts)
        multi_token = [n for n in recorder.lengths if n > 1]
        assert multi_token and all(n % tail_attention.TAIL_BUCKET == 0 for n in multi_token)
        loaded.tail_bucket, recorder.lengths = 0, []
        plain = _answers(loaded, prompts)
        assert any(n % tail_attention.TAIL_BUCKET for n in recorder.lengths if n > 1)
        assert padded == plain
    finally:
        tail_attention._state["mode"] = "fused"


def test_warming_the_buckets_runs_each_length_once(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), attention="matmul")
    try:
        recorder = _PassLengths(loaded.model)
        assert tail_attention.warm_buckets(recorder, 64, longest=200) > 0
        assert recorder.lengths == [64, 128, 192]
    finally:
        tail_attention._state["mode"] = "fused"
