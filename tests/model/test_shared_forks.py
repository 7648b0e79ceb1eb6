"""--fork share: a hit reads the stored segments in place and answers what a cold run answers.

Real (tiny) models in float32, through the engine's own pieces: an exact
repeat and a longer prompt on a stored prefix decode on the shared cache
(solo path), requests sharing a prefix join the decode batch (padded and
ragged, each row still reading the pieces in place), and a stop that trims
into the stored part. Where sharing cannot be exact the model copies and
says why.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import mlx.core as mx
from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.engine.inline_runner import run_inline, run_one_inline
from prefixd.daemon.engine.jobs import GenerateJob
from prefixd.daemon.kv import fork
from prefixd.daemon.kv.fork import fork_cache
from prefixd.daemon.kv.shared_prefix_cache import SharedPrefixKVCache, tokens_read_in_store
from prefixd.daemon.models.loaded_model import load_model
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput

SOURCE_TEXT = (__import__("inspect").getsource(__import__("argparse")))[:20000]


@pytest.fixture(scope="module", params=["llama", "lfm2", "gemma3", "qwen3_moe"])
def shared(request):
    return load_model(str(request.getfixturevalue(f"tiny_{request.param}_dir")), dtype="float32", fork="share")


@pytest.fixture(autouse=True)
def short_hits_share_too(monkeypatch):
    """The tiny models' prompts here are a few hundred tokens: share them as the daemon shares 1,024 and more."""
    monkeypatch.setattr(fork, "SHARED_FORK_MIN_TOKENS", 0)


def job(tokens, max_tokens=8, use=True) -> GenerateJob:
    params = GenerateParams(
        prompt=PromptInput(tokens=tuple(tokens)), max_tokens=max_tokens, cache=CacheOptions(use=use, store=use)
    )
    return GenerateJob("test", 1, params, emit=lambda kind, payload: None)


def make_store() -> PrefixStore:
    return PrefixStore(max_bytes=2 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)


def test_the_model_serves_with_shared_forks(shared):
    assert shared.fork == "share" and shared.layout.shares_forks


def test_a_shared_hit_answers_as_a_cold_run_and_leaves_the_store_as_it_was(shared):
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:300]
    store = make_store()
    cold = run_one_inline(job(tokens, use=False), shared, None, 64)
    first = run_one_inline(job(tokens), shared, store, 64)
    match = store.match(shared.fingerprint, tokens, requires_snapshot=shared.layout.is_hybrid)
    stored = [np.array(k) for s in match.segments for k in s.keys + s.values]
    forked = fork_cache(shared.model, shared.layout, list(match.segments), match.snapshot, match.length)
    assert any(isinstance(layer, SharedPrefixKVCache) for layer in forked)
    store.release(match.lease)
    repeat = run_one_inline(job(tokens), shared, store, 64)
    assert repeat["cache"]["hit"] == "exact"
    assert first["text"] == cold["text"] == repeat["text"]
    longer = tokens + tokens[:40]
    warm = run_one_inline(job(longer), shared, store, 64)
    assert warm["cache"]["reused_tokens"] > 0
    assert warm["text"] == run_one_inline(job(longer, use=False), shared, None, 64)["text"]
    match = store.match(shared.fingerprint, tokens, requires_snapshot=shared.layout.is_hybrid)
    after = [np.array(k) for s in match.segments for k in s.keys + s.values]
    store.release(match.lease)
    assert len(after) == len(stored) and all(np.array_equal(a, b) for a, b in zip(stored, after))


@pytest.mark.parametrize("batch_step", ["padded", "ragged"])
def test_shared_hits_that_join_the_batch_answer_as_their_cold_runs(shared, batch_step, monkeypatch):
    from prefixd.daemon.models import tail_attention

    if batch_step == "ragged" and shared.layout.is_hybrid:
        pytest.skip("conv/SSM state layers decode in mlx-lm's padded batch (models/batch_step.py)")
    loaded = replace(shared, batch_step=batch_step)
    batch_steps = []  # attention calls of a decode batch that read stored pieces in place
    if batch_step == "padded":
        counted = tail_attention.batch_prefix_attention
        monkeypatch.setattr(tail_attention, "batch_prefix_attention", lambda *a: batch_steps.append(1) or counted(*a))
    else:
        row_attention = tail_attention._row_attention

        def counted_row(queries, keys, values, cache, scale, sinks):
            if isinstance(cache, SharedPrefixKVCache) and cache.prefix_len:
                batch_steps.append(1)
            return row_attention(queries, keys, values, cache, scale, sinks)

        monkeypatch.setattr(tail_attention, "_row_attention", counted_row)
    tokens = loaded.tokenizer.encode(SOURCE_TEXT)[:260]
    store = make_store()
    run_one_inline(job(tokens, max_tokens=2), loaded, store, 64)  # stores the shared prefix
    prompts = [tokens + tokens[i * 10 : i * 10 + 7] for i in range(3)]
    together = run_inline([job(p) for p in prompts], loaded, store, 64)
    assert batch_steps  # the rows decoded together, reading the stored prefix in place
    for prompt, result in zip(prompts, together):
        assert result["cache"]["reused_tokens"] > 0
        assert result["text"] == run_one_inline(job(prompt, use=False), loaded, None, 64)["text"]


def test_where_sharing_cannot_be_exact_the_model_copies_and_says_why(tiny_mamba_dir, tiny_llama_dir):
    mamba = load_model(str(tiny_mamba_dir), dtype="float32", fork="share")
    assert not mamba.layout.shares_forks and mamba.fork.startswith("copy (no global attention")
    bf16 = load_model(str(tiny_llama_dir), dtype="bfloat16", fork="share")
    assert not bf16.layout.shares_forks and "float32 only" in bf16.fork
    assert load_model(str(tiny_llama_dir), dtype="float32", fork="copy").fork == "copy"
    assert load_model(str(tiny_llama_dir), dtype="float32").fork == "share"  # auto: share on a CPU


def test_a_hit_shorter_than_the_threshold_copies(shared, monkeypatch):
    monkeypatch.setattr(fork, "SHARED_FORK_MIN_TOKENS", 1024)
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:300]
    store = make_store()
    run_one_inline(job(tokens), shared, store, 64)
    match = store.match(shared.fingerprint, tokens, requires_snapshot=shared.layout.is_hybrid)
    forked = fork_cache(shared.model, shared.layout, list(match.segments), match.snapshot, match.length)
    store.release(match.lease)
    assert not any(isinstance(layer, SharedPrefixKVCache) for layer in forked)


def test_the_load_check_refuses_a_model_whose_attention_skips_the_routing(tiny_llama_dir, monkeypatch):
    from prefixd.daemon.models import tail_attention

    # An attention that ignores the stored pieces: what a model calling MLX's kernel directly would do.
    monkeypatch.setattr(
        tail_attention,
        "prefix_attention",
        lambda q, pk, pv, k, v, scale, mask: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
    )
    loaded = load_model(str(tiny_llama_dir), dtype="float32", fork="share")
    assert not loaded.layout.shares_forks and "answered differently" in loaded.fork


def test_what_a_shared_fork_copies_is_not_counted_as_the_stores(shared):
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:300]
    store = make_store()
    run_one_inline(job(tokens, max_tokens=1), shared, store, 64)  # stored in 64-token segments
    match = store.match(shared.fingerprint, tokens + [7, 8], requires_snapshot=shared.layout.is_hybrid)
    forked = fork_cache(shared.model, shared.layout, list(match.segments), match.snapshot, match.length)
    store.release(match.lease)
    assert any(isinstance(layer, SharedPrefixKVCache) for layer in forked)
    # runs of segments under SHARED_PIECE_MIN_TOKENS are joined: the fork's own copies
    assert tokens_read_in_store(forked) < match.length
    one = make_store()
    run_one_inline(job(tokens, max_tokens=1), shared, one, 512)  # one long segment
    match = one.match(shared.fingerprint, tokens[:280] + [7, 8], requires_snapshot=shared.layout.is_hybrid)
    forked = fork_cache(shared.model, shared.layout, list(match.segments), match.snapshot, match.length)
    one.release(match.lease)
    if not shared.layout.is_hybrid:  # a hybrid resumes at a snapshot only: no cut head there
        assert match.copied_tail_tokens == match.length == 280  # the head of the stored segment, cut for this hit
    assert tokens_read_in_store(forked) == match.length  # read in place; prefill subtracts copied_tail_tokens


def test_an_exact_repeat_reads_the_prompt_in_place_and_holds_its_last_token_itself(shared):
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:300]
    store = make_store()
    first = run_one_inline(job(tokens), shared, store, 512)  # one segment of 299 tokens, the last token alone
    match = store.match(shared.fingerprint, tokens, requires_snapshot=shared.layout.is_hybrid, whole_with_logits=True)
    assert [s.num_tokens for s in match.segments] == [299, 1] and match.logits is not None
    forked = fork_cache(shared.model, shared.layout, list(match.segments), match.snapshot, match.length)
    store.release(match.lease)
    shared_layers = [layer for layer in forked if isinstance(layer, SharedPrefixKVCache)]
    assert shared_layers and all(len(layer.prefix_keys) == 1 and layer.own_len == 1 for layer in shared_layers)
    assert tokens_read_in_store(forked) == 299  # the 1-token piece is the fork's own: no piece of its own per step
    repeat = run_one_inline(job(tokens), shared, store, 512)
    assert repeat["cache"]["prefilled_tokens"] == 0 and repeat["text"] == first["text"]


def test_the_reply_says_how_much_of_the_hit_was_read_in_place(shared, tiny_llama_dir):
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:300]
    store = make_store()
    run_one_inline(job(tokens, max_tokens=1), shared, store, 512)  # one segment of 299 tokens: read in place
    warm = run_one_inline(job(tokens + [7, 8]), shared, store, 512)["cache"]
    assert 256 <= warm["in_place_tokens"] <= warm["reused_tokens"]  # global layers' (a window is copied)
    copying = load_model(str(tiny_llama_dir), dtype="float32", fork="copy")
    store = make_store()
    run_one_inline(job(tokens, max_tokens=1), copying, store, 512)
    warm = run_one_inline(job(tokens + [7, 8]), copying, store, 512)["cache"]
    assert warm["reused_tokens"] >= 256 and warm["in_place_tokens"] == 0


def test_a_long_prompt_cut_into_shortening_passes_is_stored_in_chunks_a_fork_reads_in_place(shared):
    if shared.layout.window_layers:
        pytest.skip("a window layer is stored at every pass, before it slides on")
    tokens = shared.tokenizer.encode(SOURCE_TEXT)[:3000]
    assert len(tokens) == 3000
    store = make_store()
    run_inline([job(tokens, max_tokens=1)], shared, store, 512, pass_depth_scale=256)  # passes of 512 .. 40
    edges = sorted(store.edges(shared.fingerprint), key=lambda edge: edge.start_depth)
    prompt_edges = [edge for edge in edges if edge.start_depth < 2999]
    # Stored at the planned stops only: every 512 tokens and the prompt's end, not at each cut.
    assert [len(edge.key) for edge in prompt_edges] == [512] * 5 + [2999 - 5 * 512]
    match = store.match(shared.fingerprint, tokens + [7, 8], requires_snapshot=shared.layout.is_hybrid)
    forked = fork_cache(shared.model, shared.layout, list(match.segments), match.snapshot, match.length)
    store.release(match.lease)
    # All of it read in place but the prompt's last token, stored alone (with its logits): the fork's own.
    assert match.length == 3000 and tokens_read_in_store(forked) == match.length - 1
    cold = run_one_inline(job(tokens + [7, 8], use=False), shared, None, 512)
    warm = run_inline([job(tokens + [7, 8])], shared, store, 512, pass_depth_scale=256)[0]
    assert warm["text"] == cold["text"] and warm["cache"]["in_place_tokens"] == match.length - 1
