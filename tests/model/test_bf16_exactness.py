"""bfloat16, the dtype a GPU serves in: greedy answers with the cache are the answers without it.

Reused KV is the very KV a cold run computes (the store keeps what the
prefill wrote, and both runs cut the prompt at the same absolute chunk
ends), so only the tail's pass differs in shape; these tests pin that this
does not change greedy tokens on the attention-only, the hybrid and the real
model, for an exact repeat, a longer prompt on a stored prefix and a chat's
next turn, through the solo decode path and the batch. Kept short: bfloat16
has no BLAS path on a Linux CPU, so every pass here is several times slower
than in float32.
"""

from __future__ import annotations

import pytest

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.engine.inline_runner import run_inline, run_one_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.models.loaded_model import load_model
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput

SOURCE_TEXT = (__import__("inspect").getsource(__import__("argparse")))[:20000]


def load_bf16(request, kind: str):
    name = "smollm2_dir" if kind == "smollm2" else f"tiny_{kind}_dir"
    model = load_model(str(request.getfixturevalue(name)), dtype="bfloat16")
    assert model.dtype == "bfloat16"
    return model


@pytest.fixture(scope="module", params=["llama", "lfm2", "gemma3", "smollm2"])
def loaded(request):
    return load_bf16(request, request.param)


@pytest.fixture(scope="module", params=["llama", "lfm2", "gemma3"])
def tiny_loaded(request):
    """The tiny models only: SmolLM2 in bfloat16 takes 90 s for this test on a 2-core CPU."""
    return load_bf16(request, request.param)


def job(*, tokens=None, messages=None, max_tokens=8, use=True) -> GenerateJob:
    params = GenerateParams(
        prompt=PromptInput(tokens=tuple(tokens) if tokens else None, messages=tuple(messages) if messages else None),
        max_tokens=max_tokens, cache=CacheOptions(use=use, store=use))
    return GenerateJob("test", 1, params, emit=lambda kind, payload: None)


def make_store() -> PrefixStore:
    return PrefixStore(max_bytes=2 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)


def test_bf16_greedy_cached_equals_uncached(loaded):
    tokens = loaded.tokenizer.encode(SOURCE_TEXT)[:300]
    store = make_store()
    cold = run_one_inline(job(tokens=tokens, use=False), loaded, None, 64)
    first = run_one_inline(job(tokens=tokens), loaded, store, 64)
    repeat = run_one_inline(job(tokens=tokens), loaded, store, 64)
    assert repeat["cache"]["hit"] == "exact"
    assert first["text"] == cold["text"] == repeat["text"]
    longer = tokens + tokens[:40]
    warm = run_one_inline(job(tokens=longer), loaded, store, 64)
    assert warm["cache"]["reused_tokens"] > 0
    assert warm["text"] == run_one_inline(job(tokens=longer, use=False), loaded, None, 64)["text"]


def test_bf16_chat_next_turn_cached_equals_uncached(loaded):
    store = make_store()
    chat = [{"role": "system", "content": SOURCE_TEXT[:800]}, {"role": "user", "content": "What does this do?"}]
    answer = run_one_inline(job(messages=chat), loaded, store, 64)
    chat += [{"role": "assistant", "content": answer["text"]}, {"role": "user", "content": "And then?"}]
    warm = run_one_inline(job(messages=chat), loaded, store, 64)
    assert warm["cache"]["reused_tokens"] > 0
    assert warm["text"] == run_one_inline(job(messages=chat, use=False), loaded, None, 64)["text"]


def test_bf16_batched_warm_requests_match_their_solo_cold_runs(tiny_loaded):
    loaded = tiny_loaded
    tokens = loaded.tokenizer.encode(SOURCE_TEXT)[:260]
    store = make_store()
    run_one_inline(job(tokens=tokens, max_tokens=2), loaded, store, 64)  # stores the shared prefix
    prompts = [tokens + tokens[i * 10:i * 10 + 7] for i in range(3)]
    together = run_inline([job(tokens=p) for p in prompts], loaded, store, 64)
    for prompt, result in zip(prompts, together):
        assert result["cache"]["reused_tokens"] > 0
        assert result["text"] == run_one_inline(job(tokens=prompt, use=False), loaded, None, 64)["text"]
